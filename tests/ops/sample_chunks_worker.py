"""Worker of tests/ops/test_sample_chunks.py, run in a subprocess (the interpreter must be switched on, or the
stand-in sm_90 driver installed, before triton is imported).

``--interpret N`` (TRITON_INTERPRET=1, fp32): the Triton sampler's two kernels (a row split into vocabulary chunks,
then the chunks folded in order) against

* the same kernels with ONE chunk per row (``chunk_blocks`` = the row's block count), which is the serial walk of
  the row's blocks that one program per row did: tokens and all four flags bit for bit, for every input (NaN,
  +inf, an all -inf row, z overflowing, bad parameters, filtering rows); the flags also against
  :func:`reference_flags`, their rule written in torch;
* the torch backend's ``sample``: the same tokens on clean input (ties inside a chunk and across chunk boundaries,
  greedy rows, top-k / top-p keep masks, an all -inf row in a capture: token 0) and the same error, message for
  message, on a defective one (eager, and as a capture records it);

at vocab sizes that are not multiples of the chunk or of BLOCK_V (1, 2047, 2049, W - 1, W + 1, 3 W + 5 for chunk
widths W of 1, 2 and 8 blocks: 8 is the production constant), then for hypothesis-chosen rows / vocab / chunk
widths. Exact ties of sampled scores are planted as logits of 2**30: z is then at least 2**30 (ulp >= 128), and
z - log(-log(u)) rounds back to z for every |log(-log(u))| <= 16.7, whatever the log's last bit.

``--sm90``: compile both kernels for sm_90a at the decode shape (244 x 151,936, with and without keep masks);
prints ptxas's report per kernel."""

from __future__ import annotations

TIE = 2.0 ** 30
DEFECTS = ("none", "nan", "posinf", "neginf_row", "overflow", "temperature")


def _params(rows, greedy_rows, filter_rows, seed):
    """(seeds, seq_ids, positions, temperature, top_k, top_p): temperatures 0.7 / 1.0 / 0 (greedy rows); filtering
    rows alternate top-k 2 and top-p 0.9."""
    import torch
    temperature = torch.where(torch.arange(rows) % 2 == 0, 0.7, 1.0).float()
    temperature[list(greedy_rows)] = 0.0
    top_k = torch.zeros(rows, dtype=torch.int64)
    top_p = torch.ones(rows)
    for i, r in enumerate(filter_rows):
        if i % 2:
            top_p[r] = 0.9
        else:
            top_k[r] = 2
    return (torch.full((rows,), 1234) + seed, torch.arange(rows), torch.arange(rows) * 7 + seed, temperature, top_k,
            top_p)


def tie_pairs(vocab: int, width: int) -> list:
    """Column pairs straddling chunk boundaries of a chunk width (the first chunk's last column and the next one's
    first; columns in chunks 0 and 1, 1 and 2), those inside the vocab."""
    pairs = [(width - 1, width), (5, width + 3), (width + 1, 2 * width), (2, 3)]
    return [(a, b) for a, b in pairs if b < vocab]


def _logits(rows, vocab, seed, width, rounded):
    """(logits, ties): random logits (20% -inf, column 0 finite), rounded to few values (greedy ties) if ``rounded``;
    row r holds the row's largest logits, TIE, at tie_pairs(vocab, width)[r % pairs] (row 2 a third one in a later
    chunk), and ties[r] is the pair's first column (None: no pair fits)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    if rounded:
        logits = logits.round()
    logits[torch.rand(rows, vocab, generator=g) < 0.2] = float("-inf")
    logits[:, 0] = 1.0
    pairs = tie_pairs(vocab, width)
    ties = [pairs[r % len(pairs)][0] if pairs else None for r in range(rows)]
    for r in range(rows):
        if pairs:
            logits[r, list(pairs[r % len(pairs)])] = TIE
    if rows > 2 and pairs and 3 * width < vocab:
        logits[2, 3 * width] = TIE
    return logits, ties


def plant_defect(logits, params, defect, row, col):
    """Write a DEFECTS entry at (row, col): into the logits (sample_checks_worker's logit defects), or the row's
    temperature (in place)."""
    from tests.ops.sample_checks_worker import plant_logit_defect
    if defect == "temperature":   # a bad parameter (flag 1; its z flag sees x / -0.5 on the padded lanes too)
        params[3][row] = -0.5
    else:
        plant_logit_defect(logits, params[3], defect, row, col)


def launch(logits, params, chunk_blocks):
    """(tokens, flags [4, S]) of the two kernels as the eager sample() launches them (its keep mask for filtering
    rows), on the logits' device."""
    import torch
    from rlalign.ops.triton_backend import sample as S
    rows, vocab = logits.shape
    filtered = S._filtered(params[3], params[4], params[5], vocab)
    keep = S._keep(logits, params[3], params[4], params[5], False, filtered) if bool(filtered.any()) else None
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    flags = torch.empty((4, rows), dtype=torch.int8, device=logits.device)
    S._launch(logits, params, keep, out, flags, chunk_blocks)
    return out, flags


def reference_flags(logits, params):
    """The four flags the kernels must write (sample_fold_kernel's docstring), in torch: the logits padded with -inf
    to whole BLOCK_V blocks as the kernels read them, z = x / T (greedy rows: / 1) on the padded lanes too."""
    import torch
    from rlalign.ops.triton_backend import sample as S
    _, _, _, temperature, top_k, top_p = params
    rows, vocab = logits.shape
    x = torch.nn.functional.pad(logits, (0, -vocab % S.BLOCK_V), value=float("-inf"))
    z = x / torch.where(temperature == 0, 1.0, temperature)[:, None]

    def valid(t):
        return ~(t.isnan() | t.isposinf()).any(-1) & t.isfinite().any(-1)
    params_ok = temperature.isfinite() & (temperature >= 0) & (top_p > 0) & (top_p <= 1) & (top_k >= 0)
    unfiltered = ~S._filtered(temperature, top_k, top_p, vocab)
    return torch.stack([valid(x), params_ok, unfiltered, valid(z)]).to(torch.int8)


def _outcome(fn):
    from rlalign.contract.errors import ContractError
    try:
        return "tokens", fn()
    except ContractError as err:
        return "error", str(err)


def _captured(fn):
    """(tokens, the recorded verdicts' failing messages in order) as a capture (with filtering) records ``fn``."""
    from rlalign.ops import _checks as chk
    with chk.capturing_graph(sample_filtered=True) as verdicts:
        tokens = fn()
    return tokens, [message for _, message, ok in verdicts if not bool(ok)]


def check_case(rows, vocab, chunk_blocks, greedy_rows, filter_rows, seed, rounded=False, defect="none", at=(0, 0),
               capture=False):
    import torch
    from rlalign.ops.torch_backend import sample as reference
    from rlalign.ops.triton_backend import sample as S
    width = chunk_blocks * S.BLOCK_V
    logits, ties = _logits(rows, vocab, seed, width, rounded)
    params = _params(rows, greedy_rows, filter_rows, seed)
    plant_defect(logits, params, defect, *at)
    case = (f"rows={rows} V={vocab} chunk={width} greedy={greedy_rows} filter={filter_rows} seed={seed} "
            f"defect={defect} at {at}")
    serial = launch(logits, params, -(-vocab // S.BLOCK_V))   # one chunk per row: the serial walk of the blocks
    chunked = launch(logits, params, chunk_blocks)
    for name, got, want in (("tokens", chunked[0], serial[0]), ("flags", chunked[1], serial[1]),
                            ("flags (reference)", chunked[1], reference_flags(logits, params))):
        if not torch.equal(got, want):
            raise AssertionError(f"{case}: chunked {name} {got.tolist()} != {want.tolist()}")
    for r, col in enumerate(ties):   # the top-k 2 / top-p 0.9 rows keep both tied tokens
        if col is not None and (defect == "none" or r != at[0]) and int(chunked[0][r]) != col:
            raise AssertionError(f"{case}: row {r} took {int(chunked[0][r])}, not the first tied column {col}")
    if defect == "temperature":   # checked on the host by ops.sample (eager) or as a verdict: the flags above
        return
    want = _outcome(lambda: reference.sample(logits, *params))
    # the eager sample() after its launch (the launch above): its verdicts raise, else the tokens
    got = _outcome(lambda: S._verdicts(chunked[1], logits, False, check_unfiltered=False) or chunked[0])
    if (want[0] == "error") != (defect != "none") or got[0] != want[0]:
        raise AssertionError(f"{case}: triton {got}, torch backend {want}")
    if want[0] == "error":
        assert got[1] == want[1], f"{case}: message {got[1]!r} != the torch backend's {want[1]!r}"
    elif not torch.equal(got[1], want[1]):
        raise AssertionError(f"{case}: tokens {got[1].tolist()} != the torch backend's {want[1].tolist()}")
    if capture:
        got_c = _captured(lambda: S.sample(logits, *params, chunk_blocks=chunk_blocks))
        want_c = _captured(lambda: reference.sample(logits, *params))
        assert got_c[1][:1] == want_c[1][:1], f"{case}: captured verdicts {got_c[1]} != {want_c[1]}"
        same = ~(logits.isnan() | logits.isposinf()).any(-1)   # a NaN row: torch's argmax takes the NaN
        if not torch.equal(got_c[0][same], want_c[0][same]):
            raise AssertionError(f"{case}: captured tokens {got_c[0].tolist()} != {want_c[0].tolist()}")
        if defect == "neginf_row" and int(got_c[0][at[0]]) != 0:
            raise AssertionError(f"{case}: an all -inf row's token is {int(got_c[0][at[0]])}, not 0")


def fixed_cases() -> int:
    """The named vocab sizes at chunk widths of 1, 2 and 8 (production) blocks, ties across boundaries, every
    defect at a chunk edge. Returns the number of cases."""
    from rlalign.ops.triton_backend import sample as S
    width = {1: 2048, 2: 4096, S.CHUNK_BLOCKS: S.CHUNK_BLOCKS * 2048}
    # (chunk blocks, vocab, rows): row 0 samples, row 1 is greedy, row 2 filters (top-k 2), row 3 (top-p 0.9)
    sizes = [(2, 3 * width[2] + 5, 4), (2, width[2] + 1, 4), (2, width[2] - 1, 3), (2, 2049, 3), (2, 2047, 3),
             (2, 1, 2), (1, 3 * width[1] + 5, 3), (S.CHUNK_BLOCKS, 3 * width[S.CHUNK_BLOCKS] + 5, 3),
             (S.CHUNK_BLOCKS, width[S.CHUNK_BLOCKS] + 1, 2), (S.CHUNK_BLOCKS, width[S.CHUNK_BLOCKS] - 1, 2)]
    cases = [dict(rows=rows, vocab=vocab, chunk_blocks=blocks, greedy_rows=[1], filter_rows=[2, 3][:rows - 2],
                  seed=vocab, capture=vocab == 1) for blocks, vocab, rows in sizes]
    cases.append(dict(rows=2, vocab=4097, chunk_blocks=1, greedy_rows=[0, 1], filter_rows=[], seed=5, rounded=True))
    # every defect at the first column of the second chunk; an all -inf row of one column
    cases += [dict(rows=2, vocab=2049, chunk_blocks=1, greedy_rows=[], filter_rows=[0], seed=9, defect=d,
                   at=(1, 2048), capture=True) for d in DEFECTS[1:]]
    cases.append(dict(rows=2, vocab=1, chunk_blocks=1, greedy_rows=[], filter_rows=[], seed=3, defect="neginf_row",
                      at=(1, 0), capture=True))
    for case in cases:
        check_case(**case)
    return len(cases)


def run(max_examples: int) -> dict:
    from hypothesis import HealthCheck, given, settings, strategies as st

    @st.composite
    def cases(draw):
        rows = draw(st.integers(1, 3))
        vocab = draw(st.sampled_from((1, 2, 100, 2047, 2048, 2049, 4096, 4097, 6149)))
        subset = st.sets(st.integers(0, rows - 1), max_size=rows)
        defect = draw(st.sampled_from(DEFECTS))
        return dict(rows=rows, vocab=vocab, chunk_blocks=draw(st.integers(1, 3)), greedy_rows=sorted(draw(subset)),
                    filter_rows=sorted(draw(subset)), seed=draw(st.integers(0, 2 ** 16)), rounded=draw(st.booleans()),
                    defect=defect, at=(draw(st.integers(0, rows - 1)), draw(st.integers(0, vocab - 1))))

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def chunked_sampler_matches(case):
        check_case(**case)

    fixed = fixed_cases()
    chunked_sampler_matches()
    return {"fixed_cases": fixed}


def sm90() -> dict:
    """Both kernels compiled for sm_90a at 244 x 151,936 (no keep mask, then keep masks): name, grid, constexprs,
    ptxas's report."""
    import torch
    from tests.sm90 import activate_fake_sm90, compile_only_launches, ptxas_report
    activate_fake_sm90()
    compiled = compile_only_launches()
    from rlalign.ops import _checks as chk
    from rlalign.ops.triton_backend import sample as S
    rows, vocab = 244, 151936
    ints = torch.zeros(rows, dtype=torch.int64)
    for filtered in (False, True):   # as a capture records it: the compile-only launches leave the flags unwritten
        with chk.capturing_graph(sample_filtered=filtered):
            S.sample(torch.randn(rows, vocab), ints, ints, ints, torch.ones(rows), ints, torch.ones(rows))
    return {"kernels": [{"kernel": c.name, "grid": list(c.grid), "args": {k: str(v) for k, v in c.kwargs.items()},
                         "smem": c.kernel.metadata.shared, "ptxas": ptxas_report(c.kernel.asm["ptx"])}
                        for c in compiled]}


if __name__ == "__main__":
    from tests.workers import worker_main
    worker_main(sm90, lambda args: run(int(args[0])))
