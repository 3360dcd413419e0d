"""The native profile's static-shape paged decode (inside decode graphs: ``ops.static_decode``) computes what
its eager form computes -- no bitwise promise (native promises nothing), fp32 agreement to rounding.

Shapes: one query per sequence at the end of its context; the block table's width may exceed what the
longest sequence needs (the graphs pad it to a width bucket); stale page ids past a sequence's pages must
not enter the math; degenerate sizes included (one sequence, contexts of one token, pages of one slot).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from tests.bitwise import assert_bitwise_equal


@st.composite
def decode_steps(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([2, 8, 16]))
    lens = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    extra_width = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    return page_size, hkv, group, d, lens, extra_width, seed


def _inputs(page_size, hkv, group, d, lens, extra_width, seed):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=gen).tolist()          # pages scattered through the cache
    width = max(need) + extra_width
    table = torch.empty((len(lens), width), dtype=torch.int32)
    nxt = 0
    for s, k in enumerate(need):
        table[s, :k] = torch.tensor(perm[nxt:nxt + k])
        nxt += k
        table[s, k:] = torch.randint(0, num_pages, (width - k,), generator=gen)   # stale ids past the pages
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    q = torch.randn(len(lens), hkv * group, d, generator=gen)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens) + 1)


@settings(max_examples=60, deadline=None)
@given(decode_steps())
def test_static_decode_equals_the_eager_native_form(case):
    q, kc, vc, table, lens, cu = _inputs(*case)
    want = ops.attention_paged(q, kc, vc, table, lens, cu, profile="native")
    # a NaN in pages past every context must not reach the static form (it gathers inside contexts only)
    used = set()
    for s, n in enumerate(lens.tolist()):
        used |= set(table[s, :-(-n // kc.shape[1])].tolist())
    for page in set(range(kc.shape[0])) - used:
        kc[page], vc[page] = float("nan"), float("nan")
    with ops.static_decode():
        got = ops.attention_paged(q, kc, vc, table, lens, cu, profile="native")
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 1e-5, f"max |static - eager| = {err}"


def test_static_decode_refuses_a_prefill_shaped_batch():
    q, kc, vc, table, lens, cu = _inputs(4, 2, 2, 8, [5, 9], 0, 0)
    with ops.static_decode(), pytest.raises(Exception, match="one query per sequence"):
        ops.attention_paged(torch.cat([q, q]), kc, vc, table, lens + 1, torch.tensor([0, 2, 4]), profile="native")


def test_strict_ignores_static_decode():
    q, kc, vc, table, lens, cu = _inputs(4, 2, 2, 8, [5, 9, 1], 2, 1)
    want = ops.attention_paged(q, kc, vc, table, lens, cu)
    with ops.static_decode():
        got = ops.attention_paged(q, kc, vc, table, lens, cu)
    assert_bitwise_equal(got, want, "strict paged attention under static_decode")
