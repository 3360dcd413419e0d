"""Worker of tests/ops/test_folded_checks.py, run in a subprocess with TRITON_INTERPRET=1 (the interpreter must be
switched on before triton is imported): the Triton sampler's folded logits checks against the torch backend.

For hypothesis-chosen rows / vocab sizes (degenerate ones included: V = 1, one row, partial and exact 2048-blocks)
and a defect (none; NaN; +inf; a row of -inf; logits / temperature overflowing fp32; a temperature, top_p or
top_k out of range) at a chosen place, in the eager form, the static form and as a CUDA-graph capture records it
(with the capture's filtering hint; a top-k row in a graph captured without filtering), with and without top-k
and greedy rows: a clean input gives the torch backend's tokens bit for bit, a defective one the torch backend's
first error, message for message (eager: naming the first bad index)."""

from __future__ import annotations

import sys
import traceback

DEFECTS = ("none", "nan", "posinf", "neginf_row", "overflow", "temperature", "top_p", "top_k")
PARAM_DEFECTS = ("temperature", "top_p", "top_k")   # checked on the host by ops.sample in the eager form
MODES = ("eager", "static", "capture")
VOCABS = (1, 2, 3, 100, 2047, 2048, 2049, 4097)


def _inputs(rows, vocab, defect, row, col, greedy_rows, filter_rows, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[torch.rand(rows, vocab, generator=g) < 0.2] = float("-inf")   # masked tokens are allowed
    logits[:, col] = 1.0     # every row keeps a finite logit unless the defect removes them
    temperature = torch.where(torch.arange(rows) % 3 == 1, 1.0, 0.7).float()
    temperature[list(greedy_rows)] = 0.0
    if defect == "nan":
        logits[row, col] = float("nan")
    elif defect == "posinf":
        logits[row, col] = float("inf")
    elif defect == "neginf_row":
        logits[row] = float("-inf")
    elif defect == "overflow":
        logits[row, col] = 3.0e38
        temperature[row] = 0.25
    top_k = torch.zeros(rows, dtype=torch.int64)
    top_k[list(filter_rows)] = 2
    top_p = torch.ones(rows)
    if defect == "temperature":
        temperature[row] = float("nan") if seed % 2 else -0.5
    elif defect == "top_p":
        top_p[row] = 0.0 if seed % 2 else 1.5
    elif defect == "top_k":
        top_k[row] = -1
    args = (torch.full((rows,), 1234), torch.arange(rows), torch.arange(rows) * 7 + seed, temperature, top_k, top_p)
    return logits, args


def _outcome(fn):
    from rlalign.contract.errors import ContractError
    try:
        return "tokens", fn()
    except ContractError as err:
        return "error", str(err)


def _captured(fn, hint):
    """Run ``fn`` as a CUDA-graph capture records it (on the CPU: the verdicts are recorded, not raised); the
    first failing verdict's message, else the tokens."""
    from rlalign.ops import _checks as chk
    with chk.capturing_graph(sample_filtered=hint) as verdicts:
        tokens = fn()
    failed = [message for _, message, ok in verdicts if not bool(ok)]
    return ("error", failed[0]) if failed else ("tokens", tokens)


def check_case(rows, vocab, defect, row, col, greedy_rows, filter_rows, seed, mode, hint=True):
    import torch
    from rlalign.ops import static_decode
    from rlalign.ops.torch_backend import sample as reference
    from rlalign.ops.triton_backend import sample as triton_sample
    if mode == "eager" and defect in PARAM_DEFECTS:
        return
    logits, args = _inputs(rows, vocab, defect, row, col, greedy_rows, filter_rows, seed)
    if mode == "capture":
        want = _captured(lambda: reference.sample(logits, *args), hint)
        got = _captured(lambda: triton_sample.sample(logits, *args), hint)
    elif mode == "static":
        with static_decode():
            want = _outcome(lambda: reference.sample(logits, *args))
            got = _outcome(lambda: triton_sample.sample(logits, *args))
    else:
        want = _outcome(lambda: reference.sample(logits, *args))
        got = _outcome(lambda: triton_sample.sample(logits, *args))
    case = f"rows={rows} V={vocab} defect={defect} at [{row}, {col}] greedy={greedy_rows} top-k={filter_rows} " \
           f"mode={mode} capture hint={hint}"
    # a NaN temperature on a greedy row is still a bad parameter; a top-k row captured without filtering fails
    filtering = vocab > 2 and bool(set(filter_rows) - set(greedy_rows))   # top_k = 2 >= V is off
    expect_error = defect != "none" or (mode == "capture" and not hint and filtering)
    if expect_error != (want[0] == "error"):
        raise AssertionError(f"{case}: the torch backend's outcome {want} does not match the defect")
    if got[0] != want[0]:
        raise AssertionError(f"{case}: triton gave {got}, the torch backend {want}")
    if want[0] == "error":
        assert got[1] == want[1], f"{case}: message {got[1]!r} != the torch backend's {want[1]!r}"
        return
    if not torch.equal(got[1], want[1]):
        i = int((got[1] != want[1]).nonzero()[0])
        raise AssertionError(f"{case}: first differing row {i}: triton token {int(got[1][i])}, "
                             f"torch backend {int(want[1][i])}")


def run(max_examples: int) -> None:
    from hypothesis import HealthCheck, given, settings, strategies as st

    @st.composite
    def cases(draw):
        rows = draw(st.integers(1, 4))
        vocab = draw(st.sampled_from(VOCABS))
        subset = st.sets(st.integers(0, rows - 1), max_size=rows)
        return (rows, vocab, draw(st.sampled_from(DEFECTS)), draw(st.integers(0, rows - 1)),
                draw(st.integers(0, vocab - 1)), sorted(draw(subset)), sorted(draw(subset)),
                draw(st.integers(0, 2 ** 16)), draw(st.sampled_from(MODES)), draw(st.booleans()))

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def folded_checks_match_the_torch_backend(case):
        check_case(*case)

    folded_checks_match_the_torch_backend()
    for defect in DEFECTS:   # every defect at least once, at the edges of a 2048-block, in every form
        for mode in MODES:
            check_case(2, 2049, defect, 1, 2048, [], [], 7, mode)
        check_case(1, 1, defect, 0, 0, [], [], 3, "capture")
    check_case(3, 100, "none", 0, 5, [1], [0, 1], 5, "capture", hint=False)   # top-k row in an unfiltered graph
    check_case(3, 100, "none", 0, 5, [1], [1], 5, "capture", hint=False)      # greedy rows never filter
    check_case(3, 100, "overflow", 2, 5, [], [0], 5, "capture", hint=False)   # the verdicts' order


if __name__ == "__main__":
    from tests.ops.test_triton_interpret import _patch_interpreter
    _patch_interpreter()
    try:
        run(int(sys.argv[1]) if len(sys.argv) > 1 else 25)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    print("OK")
