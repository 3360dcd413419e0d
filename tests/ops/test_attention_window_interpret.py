"""Sliding-window and sink attention (gpt-oss) in the Triton kernels, under the CPU interpreter (fp32).

The kernels' WINDOW / HAS_SINKS variants (rlalign/ops/triton_backend/attention.py: the window walk from the first key
block a tile's window reaches, the split merges of the rows that see a key of the split, the sink folded in after
the last split; the backward's windowed dQ and dK/dV walks and the sinks' gradient). Hypothesis draws packed batches
(lengths 1..80, one sequence past the 256-key split when the explicit examples run), windows (1, inside a 64-key
block, across blocks, at least the length, or none with sinks), sinks or not, GQA groups of 1 to 3, head widths
6 / 16 / 24 (24 pads to 32 columns: a width that is not a power of two) and V heads of their own width (MLA:
24 / 16, 16 / 40), pages of 1 / 3 / 16 / 64 slots shuffled in a NaN-filled cache. Per case:

* bitwise (the interpreter's row-wise dot, so a row's bits are its own as on the GPU): the packed forward ==
  each sequence alone == one paged prefill of the batch == a chunked prefill (drawn chunks) == batched decode,
  token by token;
* accuracy: the forward, and dq, dk, dv, dsinks of the backward, within TOL of float64 (relative to the
  reference's largest magnitude, at least 1);
* the backward: the same bits run to run, and a sequence's dq / dk / dv the same bits wherever it is packed.

fp32 only (the interpreter mis-rounds bf16; tests/cuda/test_cuda_attention_window.py runs bf16 and fp32 on the GPU).
One subprocess runs every check (the interpreter must be on before triton is imported).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import pytest

from tests.workers import run_worker

TOL = 2e-5
CHECKS = ("forward paths and accuracy", "backward")


def _i32(xs):
    import torch
    return torch.tensor(xs, dtype=torch.int32)


def _case(lens, hq, hkv, d, dv, window, with_sinks, seed):
    """(q, k, v, cu, sinks, scale) of a packed batch (V heads dv wide); unit-scale inputs, sinks around the
    scores' size."""
    import torch
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k = (torch.randn(t, h, d, generator=g) for h in (hq, hkv))
    v = torch.randn(t, hkv, dv, generator=g)
    sinks = torch.randn(hq, generator=g) * 2 if with_sinks else None
    return q, k, v, _i32([0] + torch.tensor(lens).cumsum(0).tolist()), sinks, d ** -0.5


def _rel(got, want):
    import torch
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1.0))


def _forward_paths(lens, hq, hkv, d, dv, window, with_sinks, page_size, chunks, decode_from, seed):
    """Every path's bits against the packed forward's, and the packed forward against float64."""
    from rlalign.contract.bits import bits_equal, describe_difference
    from rlalign.ops.triton_backend import attention as A
    from tests.ops.test_triton_interpret import _shuffled_cache
    from tests.references import causal_attention_float64
    import torch
    q, k, v, cu, sinks, scale = _case(lens, hq, hkv, d, dv, window, with_sinks, seed)
    kw = dict(window=window, sinks=sinks)
    what = f"lens {lens}, heads {hq}/{hkv}, d {d}/{dv}, window {window}, sinks {with_sinks}, page {page_size}"
    packed = A.varlen_forward(q, k, v, cu, scale, **kw)[0]
    err = _rel(packed, causal_attention_float64(q, k, v, lens, scale, window, sinks))
    assert err <= TOL, f"{what}: forward relative error {err:.3g} vs float64 > {TOL}"

    def same(out, rows, path):
        assert bits_equal(out, packed[rows]), f"{what}: {path} vs packed: {describe_difference(out, packed[rows])}"
    starts = cu[:-1].tolist()
    for s, n in enumerate(lens):
        r = slice(starts[s], starts[s] + n)
        same(A.varlen_forward(q[r], k[r], v[r], _i32([0, n]), scale, tile=(64, 4, 1), **kw)[0], r,
             f"sequence {s} alone")
    kc, _, table = _shuffled_cache(k, k, lens, page_size, torch.Generator().manual_seed(seed + 1))
    vc, _, _ = _shuffled_cache(v, v, lens, page_size, torch.Generator().manual_seed(seed + 1))   # the same pages
    same(A.paged_forward(q, kc, vc, table, _i32(lens), cu, scale, **kw), slice(0, sum(lens)), "one paged prefill")
    for s, n in enumerate(lens):                      # chunked prefill of each sequence
        a = 0
        for size in chunks[s]:
            b = min(n, a + size)
            r = slice(starts[s] + a, starts[s] + b)
            same(A.paged_forward(q[r], kc, vc, table[s:s + 1], _i32([b]), _i32([0, b - a]), scale, **kw), r,
                 f"chunk [{a}, {b}) of sequence {s}")
            a = b
            if a == n:
                break
    for pos in range(decode_from, max(lens)):       # batched decode: every sequence still at least pos + 1 long
        live = [s for s, n in enumerate(lens) if n > pos]
        rows = [starts[s] + pos for s in live]
        out = A.paged_forward(q[rows], kc, vc, table[live], _i32([pos + 1] * len(live)),
                              _i32(list(range(len(live) + 1))), scale, **kw)
        same(out, rows, f"batched decode at position {pos}")


def _backward(lens, hq, hkv, d, dv, window, with_sinks, seed):
    """Gradients vs float64 autograd, run to run, and per sequence (sequence 0 packed again, last)."""
    from rlalign.contract.bits import bits_equal, describe_difference
    from rlalign.ops.triton_backend import attention as A
    from tests.references import causal_attention_float64
    import torch
    lens = lens + [lens[0]]
    q, k, v, cu, sinks, scale = _case(lens, hq, hkv, d, dv, window, with_sinks, seed)
    n0, t = lens[0], sum(lens)
    for x in (q, k, v):                                 # the first sequence again, last
        x[t - n0:] = x[:n0]
    go = torch.randn(q.shape[:2] + (dv,), generator=torch.Generator().manual_seed(seed + 2))
    go[t - n0:] = go[:n0]
    what = f"lens {lens}, heads {hq}/{hkv}, d {d}/{dv}, window {window}, sinks {with_sinks}"
    out, lse = A.varlen_forward(q, k, v, cu, scale, store_lse=True, window=window, sinks=sinks)
    grads = A.varlen_backward(q, k, v, out, lse, cu, go, scale, window=window, sinks=sinks)
    again = A.varlen_backward(q, k, v, out, lse, cu, go, scale, window=window, sinks=sinks)
    leaves = [x.double().requires_grad_() for x in (q, k, v)] + ([sinks.double().requires_grad_()] if with_sinks else [])
    ref = causal_attention_float64(*leaves[:3], lens, scale, window, leaves[3] if with_sinks else None)
    ref.backward(go.double())
    for name, got, rerun, leaf in zip(("dq", "dk", "dv", "dsinks"), grads, again, leaves):
        err = _rel(got, leaf.grad)
        assert err <= TOL, f"{what}: {name} relative error {err:.3g} vs float64 > {TOL}"
        assert bits_equal(got, rerun), f"{what}: {name} run to run: {describe_difference(got, rerun)}"
        if name != "dsinks":                            # dsinks sums over every token of the batch
            assert bits_equal(got[:n0], got[t - n0:]), \
                f"{what}: {name} of sequence 0 first vs last: {describe_difference(got[:n0], got[t - n0:])}"


def _run(check) -> str | None:
    """None, or the first failure (hypothesis' falsifying example included)."""
    from hypothesis import example, given, settings, strategies as st

    windows = st.one_of(st.integers(1, 3), st.integers(4, 90), st.just(1000), st.none())
    shapes = st.sampled_from([(4, 2, 16, 16), (3, 1, 24, 24), (2, 2, 6, 6), (2, 1, 24, 16), (4, 2, 16, 40)])

    if check == "backward":
        @settings(max_examples=3, deadline=None, derandomize=True, database=None)
        @given(lens=st.lists(st.integers(1, 80), min_size=1, max_size=2), shape=shapes, window=windows,
               with_sinks=st.booleans(), seed=st.integers(0, 2**16))
        @example(lens=[262, 5], shape=(4, 2, 24, 16), window=12, with_sinks=True, seed=1)
        @example(lens=[1], shape=(2, 2, 6, 6), window=1, with_sinks=True, seed=2)
        def run(lens, shape, window, with_sinks, seed):
            if window is None and not with_sinks:
                window = 5
            _backward(lens, *shape, window, with_sinks, seed)
    else:
        @settings(max_examples=4, deadline=None, derandomize=True, database=None)
        @given(lens=st.lists(st.integers(1, 80), min_size=1, max_size=3), shape=shapes, window=windows,
               with_sinks=st.booleans(), page_size=st.sampled_from([1, 3, 16, 64]), seed=st.integers(0, 2**16),
               data=st.data())
        @example(lens=[262, 1, 30], shape=(4, 2, 24, 16), window=12, with_sinks=True, page_size=16, seed=1,
                 data=None)
        def run(lens, shape, window, with_sinks, page_size, seed, data):
            if window is None and not with_sinks:
                window = 5
            if data is None:   # the explicit example: chunks that start and end around the split at 256
                chunks, decode_from = [[100, 155, 3, 4], [1], [7, 23]], 250
            else:
                chunks = [data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4)) + [n] for n in lens]
                decode_from = data.draw(st.integers(0, max(lens) - 1).map(lambda p: max(p, max(lens) - 12)))
            _forward_paths(lens, *shape, window, with_sinks, page_size, chunks, decode_from, seed)
    try:
        run()
    except Exception:  # noqa: BLE001 - reported to the test
        return traceback.format_exc(limit=3)[-2500:]
    return None


def _worker() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_triton_interpret import _patch_interpreter
    _patch_interpreter()
    print("RESULTS " + json.dumps({check: _run(check) for check in CHECKS}))


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    return run_worker([os.path.abspath(__file__), "--worker"], interpret=True, timeout=900)


@pytest.mark.parametrize("check", CHECKS)
def test_window_and_sinks_under_the_interpreter(results, check):
    assert results[check] is None, f"{check}: {results[check]}"


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
