"""Attention with V heads of their own width (multi-head latent attention: DeepSeek-V3's K heads are 192 wide, its V
heads 128): attention_varlen / attention_paged / write_kv_cache with v [T, Hkv, Dv] and v_cache [.., .., Hkv, Dv].

Strict (CPU, the torch backend): a query's output has the same bits packed, alone, in a chunked prefill and decoded
step by step against NaN-filled caches of any page size, with and without a window and sinks, V narrower and wider
than K; accurate vs float64, and so are the gradients (dv of V's width). Native: accurate. Portable: refused in one
line. The Triton kernels: tests/ops/test_attention_window_interpret.py (CPU interpreter) and
tests/cuda/test_cuda_attention_window.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract.errors import ContractError
from tests.bitwise import assert_bitwise_equal, assert_close_report
from tests.references import causal_attention_float64

WIDTHS = st.sampled_from([(24, 16), (16, 40), (8, 2)])   # (K's head width, V's)


def _batch(lens, hq, hkv, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv))
    v = torch.randn(t, hkv, dv, generator=g).to(dtype)
    return q, k, v, torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())


def _caches(k, v, lens, page_size, seed):
    """NaN-filled caches of K's and V's widths, every sequence's rows in shuffled pages, written by
    ops.write_kv_cache -> (k_cache, v_cache, block_table)."""
    pages = [-(-n // page_size) for n in lens]
    perm = torch.randperm(sum(pages) + 2, generator=torch.Generator().manual_seed(seed)).tolist()
    kc = torch.full((len(perm), page_size) + tuple(k.shape[1:]), float("nan"), dtype=k.dtype)
    vc = torch.full((len(perm), page_size) + tuple(v.shape[1:]), float("nan"), dtype=v.dtype)
    table = torch.zeros((len(lens), max(pages)), dtype=torch.int64)
    start, used = 0, 0
    for s, n in enumerate(lens):
        ids = torch.tensor(perm[used:used + pages[s]])
        used += pages[s]
        table[s, :len(ids)] = ids
        pos = torch.arange(n)
        ops.write_kv_cache(k[start:start + n], v[start:start + n], kc, vc, ids[pos // page_size] * page_size
                           + pos % page_size)
        start += n
    return kc, vc, table


@settings(max_examples=8, deadline=None)
@given(lens=st.lists(st.integers(1, 90), min_size=1, max_size=3), widths=WIDTHS,
       heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]), window=st.one_of(st.none(), st.integers(1, 70)),
       with_sinks=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       page_size=st.sampled_from([1, 3, 16]), seed=st.integers(0, 2**16), data=st.data())
def test_every_path_gives_the_packed_bits(lens, widths, heads, window, with_sinks, dtype, page_size, seed, data):
    (d, dv), (hq, hkv) = widths, heads
    q, k, v, cu = _batch(lens, hq, hkv, d, dv, dtype, seed)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed)) if with_sinks else None
    kw = dict(window=window, sinks=sinks)
    packed = ops.attention_varlen(q, k, v, cu, **kw)
    assert packed.shape == (sum(lens), hq, dv) and packed.dtype == dtype
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close_report(packed, causal_attention_float64(q, k, v, lens, d ** -0.5, window, sinks), atol, 0,
                        f"packed vs float64 ({d}/{dv})")
    kc, vc, table = _caches(k, v, lens, page_size, seed)
    starts = cu[:-1].tolist()
    for s, n in enumerate(lens):
        r = slice(starts[s], starts[s] + n)
        assert_bitwise_equal(ops.attention_varlen(q[r], k[r], v[r], torch.tensor([0, n]), **kw), packed[r],
                             f"sequence {s} alone")
        a = 0
        while a < n:                                  # chunked prefill, then decode steps of 1
            b = min(n, a + data.draw(st.integers(1, 40)))
            rows = slice(starts[s] + a, starts[s] + b)
            out = ops.attention_paged(q[rows], kc, vc, table[s:s + 1], torch.tensor([b]), torch.tensor([0, b - a]),
                                      **kw)
            assert_bitwise_equal(out, packed[rows], f"sequence {s}: chunk [{a}, {b}) (page {page_size})")
            a = b


@pytest.mark.parametrize("window, with_sinks", [(None, False), (7, True)])
@pytest.mark.parametrize("widths", [(24, 16), (16, 40)])
def test_gradients_match_float64_autograd(widths, window, with_sinks):
    d, dv = widths
    lens = [3, 70, 20]
    q, k, v, cu = _batch(lens, 4, 2, d, dv, torch.float32, 1)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2)) if with_sinks else None
    grad = torch.randn(sum(lens), 4, dv, generator=torch.Generator().manual_seed(3))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)] + ([sinks.clone().requires_grad_(True)]
                                                                    if with_sinks else [])
    out = ops.attention_varlen(*leaves[:3], cu, window=window, sinks=leaves[3] if with_sinks else None)
    (out * grad).sum().backward()
    ref = [x.double().requires_grad_(True) for x in (q, k, v)] + ([sinks.double().requires_grad_(True)]
                                                                  if with_sinks else [])
    (causal_attention_float64(*ref[:3], lens, d ** -0.5, window, ref[3] if with_sinks else None)
     * grad.double()).sum().backward()
    for name, a, b in zip("q k v sinks".split(), leaves, ref):
        assert a.grad.shape == b.grad.shape
        assert_close_report(a.grad, b.grad, 2e-5, 1e-4, f"d{name} ({d}/{dv})")


@pytest.mark.parametrize("window", [None, 9])
def test_native_is_accurate(window):
    lens = [5, 40]
    q, k, v, cu = _batch(lens, 4, 2, 24, 16, torch.float32, 4)
    ref = causal_attention_float64(q, k, v, lens, 24 ** -0.5, window)
    packed = ops.attention_varlen(q, k, v, cu, window=window, profile="native")
    assert_close_report(packed, ref, 1e-5, 0, "native packed")
    kc, vc, table = _caches(k, v, lens, 16, 0)
    paged = ops.attention_paged(q, kc, vc, table, torch.tensor(lens), cu, window=window, profile="native")
    assert_close_report(paged, ref, 1e-5, 0, "native paged")


def test_portable_refuses_and_bad_widths_raise():
    q, k, v, cu = _batch([5], 2, 2, 8, 4, torch.float32, 0)
    with pytest.raises(ContractError, match="V's head_dim 4 differs from Q/K's 8: not implemented in the portable"):
        ops.attention_varlen(q, k, v, cu, profile="portable")
    with pytest.raises(ContractError, match="same T and Hkv"):
        ops.attention_varlen(q, k, v[:, :1], cu)
    kc, vc, table = _caches(k, v, [5], 4, 0)
    with pytest.raises(ContractError, match="must match pairwise"):
        ops.write_kv_cache(k, v[:, :1], kc, vc, torch.arange(5))
    with pytest.raises(ContractError, match="do not match the caches"):
        ops.write_kv_cache(k, v, kc, kc, torch.arange(5))
