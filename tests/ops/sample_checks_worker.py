"""Worker of tests/ops/test_folded_checks.py, run in a subprocess with TRITON_INTERPRET=1 (the interpreter must be
switched on before triton is imported): the Triton sampler's folded logits checks against the torch backend.

For hypothesis-chosen rows / vocab sizes (degenerate ones included: V = 1, one row, partial and exact 2048-blocks)
and a defect (none; NaN; +inf; a row of -inf; logits / temperature overflowing fp32) at a chosen place, in the
eager and the static form, with and without top-k rows: a clean input gives the torch backend's tokens bit for
bit, a defective one raises the torch backend's error, message for message (eager: the first bad index)."""

from __future__ import annotations

import os
import sys
import traceback

DEFECTS = ("none", "nan", "posinf", "neginf_row", "overflow")
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
    args = (torch.full((rows,), 1234), torch.arange(rows), torch.arange(rows) * 7 + seed, temperature, top_k,
            torch.ones(rows))
    return logits, args


def _outcome(fn):
    from rlalign.contract.errors import ContractError
    try:
        return "tokens", fn()
    except ContractError as err:
        return "error", str(err)


def check_case(rows, vocab, defect, row, col, greedy_rows, filter_rows, seed, static):
    import torch
    from rlalign.ops import static_decode
    from rlalign.ops.torch_backend import sample as reference
    from rlalign.ops.triton_backend import sample as triton_sample
    logits, args = _inputs(rows, vocab, defect, row, col, greedy_rows, filter_rows, seed)
    if static:
        with static_decode():
            want = _outcome(lambda: reference.sample(logits, *args))
            got = _outcome(lambda: triton_sample.sample(logits, *args))
    else:
        want = _outcome(lambda: reference.sample(logits, *args))
        got = _outcome(lambda: triton_sample.sample(logits, *args))
    case = f"rows={rows} V={vocab} defect={defect} at [{row}, {col}] greedy={greedy_rows} top-k={filter_rows} " \
           f"static={static}"
    if (defect == "none") != (want[0] == "tokens"):
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
                draw(st.integers(0, 2 ** 16)), draw(st.booleans()))

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def folded_checks_match_the_torch_backend(case):
        check_case(*case)

    folded_checks_match_the_torch_backend()
    for defect in DEFECTS:   # every defect at least once, at the edges of a 2048-block, both forms
        for static in (False, True):
            check_case(2, 2049, defect, 1, 2048, [], [], 7, static)
            check_case(1, 1, defect, 0, 0, [], [], 3, static)


if __name__ == "__main__":
    from tests.ops.test_triton_interpret import _patch_interpreter
    _patch_interpreter()
    try:
        run(int(sys.argv[1]) if len(sys.argv) > 1 else 25)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    print("OK")
