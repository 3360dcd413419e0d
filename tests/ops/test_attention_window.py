"""Sliding-window and sink attention (gpt-oss): attention_varlen / attention_paged with ``window`` / ``sinks``.

Bitwise (strict, CPU): a token's output is the same bits packed with other sequences, alone, in any chunked
prefill and decoded step by step against a NaN-filled paged cache of any page size, for any window (1, inside a
key block, across block boundaries, >= the length); the window's first key is masked inside the fixed grid of
64-position key blocks. Accuracy (strict and native): vs a float64 softmax with the window mask and the sink
logit in the denominator; gradients (q, k, v, sinks) vs float64 autograd. Refusals: bad window / sinks. The
Triton backend's kernels: tests/ops/test_attention_window_interpret.py (CPU interpreter) and
tests/cuda/test_cuda_attention_window.py.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract.errors import ContractError
from tests.bitwise import assert_bitwise_equal, assert_close_report
from tests.references import causal_attention_float64
from tests.ops.test_attention import DTYPES, _PagedCache, _decode_and_compare, _pack, _seq, prefill_in_chunks_and_compare

SETTINGS = dict(max_examples=12, deadline=None)
windows = st.one_of(st.integers(1, 3), st.integers(4, 140), st.just(10_000))
heads = st.sampled_from([(2, 2), (4, 1), (4, 2)])


def _sinks(hq, seed, dtype=torch.float32):
    return (torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def reference(q, k, v, lens, window, sinks, scale=None):
    """float64: softmax over [visible keys' scores, sink] (the sink's probability dropped), GQA by repetition."""
    return causal_attention_float64(q, k, v, lens, q.shape[-1] ** -0.5 if scale is None else scale, window, sinks)


@settings(**SETTINGS)
@given(lens=st.lists(st.integers(1, 150), min_size=1, max_size=4), hk=heads, window=windows,
       with_sinks=st.booleans(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_packed_equals_alone(lens, hk, window, with_sinks, dtype, seed):
    hq, hkv = hk
    sinks = _sinks(hq, seed) if with_sinks else None
    seqs = [_seq(n, hq, hkv, 32, dtype, seed + i) for i, n in enumerate(lens)]
    q, k, v, cu = _pack(seqs)
    out = ops.attention_varlen(q, k, v, cu, window=window, sinks=sinks)
    for i, s in enumerate(seqs):
        alone = ops.attention_varlen(*s, torch.tensor([0, lens[i]]), window=window, sinks=sinks)
        assert_bitwise_equal(out[cu[i]:cu[i + 1]], alone, f"sequence {i} packed vs alone (window {window})")


@settings(**SETTINGS)
@given(lens=st.lists(st.integers(1, 150), min_size=1, max_size=3), page_size=st.sampled_from([1, 3, 16, 64, 128]),
       hk=heads, window=windows, with_sinks=st.booleans(), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), data=st.data())
def test_decode_and_chunked_prefill_equal_packed(lens, page_size, hk, window, with_sinks, dtype, seed, data):
    """Decode token by token after a prefill chunk, and a random chunked prefill: the packed op's bits."""
    hq, hkv = hk
    sinks = _sinks(hq, seed) if with_sinks else None
    seqs = [_seq(n, hq, hkv, 32, dtype, seed + i) for i, n in enumerate(lens)]
    q, k, v, cu = _pack(seqs)
    packed = ops.attention_varlen(q, k, v, cu, window=window, sinks=sinks)

    class Cache(_PagedCache):
        def attend(self, seq_ids, qs, ctx_lens, **kw):
            return super().attend(seq_ids, qs, ctx_lens, window=window, sinks=sinks, **kw)

    start = [data.draw(st.integers(max(0, n - 20), n - 1)) for n in lens]
    _decode_and_compare(lens, seqs, packed, Cache(lens, page_size, hkv, 32, dtype, seed), start)
    prefill_in_chunks_and_compare(Cache(lens, page_size, hkv, 32, dtype, seed + 1), seqs, lens, cu, packed,
                                  lambda s, left: data.draw(st.integers(1, min(80, left))))


def test_window_at_least_the_length_is_full_attention():
    """window >= length masks nothing: the bits of the op without a window (the same route, no sinks)."""
    seqs = [_seq(n, 4, 2, 32, torch.float32, n) for n in (1, 64, 65, 130)]
    q, k, v, cu = _pack(seqs)
    full = ops.attention_varlen(q, k, v, cu, window=130, sinks=torch.full((4,), -float(2**100)))
    assert_close_report(full, ops.attention_varlen(q, k, v, cu), 1e-6, 0, "window >= length")


def test_window_one_attends_to_itself_only():
    q, k, v = _seq(100, 2, 2, 32, torch.float32, 3)
    out = ops.attention_varlen(q, k, v, torch.tensor([0, 100]), window=1)
    assert_bitwise_equal(out, v, "window 1: the softmax of one key is exactly 1")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, with_sinks", [(1, True), (5, False), (63, True), (64, True), (100, True),
                                                (None, True), (1000, False)])
def test_matches_float64_reference(dtype, window, with_sinks):
    lens = [1, 40, 64, 65, 150]
    seqs = [_seq(n, 4, 2, 64, dtype, i) for i, n in enumerate(lens)]
    q, k, v, cu = _pack(seqs)
    sinks = _sinks(4, 7) if with_sinks else None
    out = ops.attention_varlen(q, k, v, cu, window=window, sinks=sinks)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close_report(out, reference(q, k, v, lens, window, sinks), atol, 0, f"window {window}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, with_sinks", [(1, True), (7, False), (70, True), (None, True)])
def test_native_matches_float64_reference_packed_and_paged(dtype, window, with_sinks):
    """The native profile: one padded SDPA call with an explicit mask (sinks as a zero key whose mask entry is
    the sink logit); no bitwise promise, the same accuracy."""
    lens = [1, 40, 70]
    seqs = [_seq(n, 4, 2, 32, dtype, 20 + i) for i, n in enumerate(lens)]
    q, k, v, cu = _pack(seqs)
    sinks = _sinks(4, 3, dtype) if with_sinks else None
    ref = reference(q, k, v, lens, window, sinks)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    packed = ops.attention_varlen(q, k, v, cu, window=window, sinks=sinks, profile="native")
    assert_close_report(packed, ref, atol, 0, "native packed")
    cache = _PagedCache(lens, 16, 2, 32, dtype, 0)
    cache.write(range(3), [0] * 3, [s[1] for s in seqs], [s[2] for s in seqs])
    paged = cache.attend(range(3), [s[0] for s in seqs], lens, window=window, sinks=sinks, profile="native")
    assert_close_report(paged, ref, atol, 0, "native paged prefill")
    last = cache.attend(range(3), [s[0][-1:] for s in seqs], lens, window=window, sinks=sinks, profile="native")
    assert_close_report(last, ref[cu[1:].long() - 1], atol, 0, "native paged decode")
    if dtype == torch.float32 and sinks is not None:   # the sinks' gradient through the mask
        leaf = sinks.clone().requires_grad_(True)
        ops.attention_varlen(q, k, v, cu, window=window, sinks=leaf, profile="native").sum().backward()
        ref_leaf = sinks.double().requires_grad_(True)
        reference(q, k, v, lens, window, ref_leaf).sum().backward()
        assert_close_report(leaf.grad, ref_leaf.grad, 1e-5, 1e-4, "native d sinks")


@pytest.mark.parametrize("window", [1, 7, 64, 70, None])
def test_gradients_match_float64_autograd(window):
    lens = [3, 70, 90]
    seqs = [_seq(n, 4, 2, 32, torch.float32, 10 + i) for i, n in enumerate(lens)]
    q, k, v, cu = _pack(seqs)
    sinks = _sinks(4, 1)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]
    (ops.attention_varlen(*leaves[:3], cu, window=window, sinks=leaves[3]) * grad).sum().backward()
    ref = [x.detach().double().requires_grad_(True) for x in (q, k, v, sinks)]
    (reference(*ref[:3], lens, window, ref[3]) * grad.double()).sum().backward()
    for name, a, b in zip("q k v sinks".split(), leaves, ref):
        assert_close_report(a.grad, b.grad, 2e-5, 1e-4, f"d{name}")


def test_refusals():
    q, k, v = _seq(5, 4, 2, 32, torch.float32, 0)
    cu = torch.tensor([0, 5])
    for bad, message in [(dict(window=0), "window must be an integer >= 1"),
                         (dict(window=2.0), "window must be an integer >= 1"),
                         (dict(sinks=torch.zeros(2)), r"sinks must be \[Hq\]=\[4\]"),
                         (dict(sinks=torch.tensor([0.0, float("nan"), 0, 0])), "sinks"),
                         ]:
        with pytest.raises(ContractError, match=message):
            ops.attention_varlen(q, k, v, cu, **bad)
