"""attention_varlen / attention_paged / write_kv_cache: bitwise invariance, accuracy, errors.

Tier 1 (bitwise, strict): a token's output is the same bits packed with any other sequences in any
order, alone, decoded step by step against a paged cache (random page ids, page sizes 1..128),
and in any chunked prefill; forward and backward are the same run to run.
Tier 2 (accuracy): strict and native vs a float64 naive causal softmax attention (fp32 atol 1e-5,
bf16 atol 1e-2 on unit-scale values); gradients vs float64 autograd of the naive reference.
Tier 3: bad inputs raise ContractError naming the op and the problem.
"""

import math
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract import spec
from rlalign.contract.errors import ContractError
from tests.bitwise import assert_bitwise_equal, assert_close_report
from tests.references import causal_attention_float64

DTYPES = [torch.float32, torch.bfloat16]
SETTINGS = dict(max_examples=15, deadline=None)
PAGE_SIZES = [1, 3, 16, 64, 128]


# ---- helpers -----------------------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _seq(length, hq, hkv, d, dtype, seed):
    """Random q [L, Hq, D], k/v [L, Hkv, D] of one sequence."""
    g = _gen(seed)
    return tuple(torch.randn(length, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


def _pack(seqs):
    cu = torch.tensor([0] + [s[0].shape[0] for s in seqs]).cumsum(0).to(torch.int32)
    return tuple(torch.cat([s[i] for s in seqs]) for i in range(3)) + (cu,)


def _naive(q, k, v, cu, scale=None):
    """float64 causal softmax attention per sequence (GQA by repeating kv heads)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return causal_attention_float64(q, k, v, cu.diff().tolist(), scale)


class _PagedCache:
    """A paged KV cache filled with NaN (so reading outside a context would show), pages handed
    out to sequences in a random order."""

    def __init__(self, lengths, page_size, hkv, d, dtype, seed):
        pages = [math.ceil(n / page_size) for n in lengths]
        total = sum(pages) + 3
        self.k = torch.full((total, page_size, hkv, d), float("nan"), dtype=dtype)
        self.v = torch.full_like(self.k, float("nan"))
        perm = torch.randperm(total, generator=_gen(seed)).to(torch.int32)
        width = max(pages) + 1
        self.table = torch.full((len(lengths), width), -1, dtype=torch.int32)
        used = 0
        for s, n in enumerate(pages):
            self.table[s, :n] = perm[used:used + n]
            used += n
        self.page_size = page_size

    def write(self, seq_ids, starts, ks, vs):
        """Writes ks[i] (tokens starts[i]..) of sequence seq_ids[i] into its pages."""
        slots = []
        for s, start, kk in zip(seq_ids, starts, ks):
            pos = torch.arange(start, start + kk.shape[0])
            slots.append(self.table[s].long()[pos // self.page_size] * self.page_size + pos % self.page_size)
        ops.write_kv_cache(torch.cat(ks), torch.cat(vs), self.k, self.v, torch.cat(slots))

    def attend(self, seq_ids, qs, ctx_lens, **kw):
        n_q = torch.tensor([0] + [q.shape[0] for q in qs]).cumsum(0).to(torch.int32)
        return ops.attention_paged(torch.cat(qs), self.k, self.v, self.table[list(seq_ids)],
                                   torch.tensor(ctx_lens, dtype=torch.int32), n_q, **kw)


heads = st.sampled_from([(2, 2), (4, 2), (4, 1), (8, 2)])     # (Hq, Hkv): GQA ratios 1, 2, 4
head_dims = st.sampled_from([32, 64, 128])
dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**16)


# ---- tier 1: bitwise ------------------------------------------------------------------------------

@settings(**SETTINGS)
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=8), hk=heads, d=head_dims, dtype=dtypes,
       seed=seeds, data=st.data())
def test_packed_equals_alone_and_any_batch(lens, hk, d, dtype, seed, data):
    (hq, hkv) = hk
    seqs = [_seq(n, hq, hkv, d, dtype, seed + i) for i, n in enumerate(lens)]
    q, k, v, cu = _pack(seqs)
    out = ops.attention_varlen(q, k, v, cu)
    for i, s in enumerate(seqs):
        alone = ops.attention_varlen(*s, torch.tensor([0, lens[i]]))
        assert_bitwise_equal(out[cu[i]:cu[i + 1]], alone, f"sequence {i} packed vs alone")
    # the same sequence among fresh random sequences, at a random place, int64 cu_seqlens
    target = data.draw(st.integers(0, len(lens) - 1))
    others = data.draw(st.lists(st.integers(1, 150), min_size=0, max_size=5))
    batch = [_seq(n, hq, hkv, d, dtype, seed + 1000 + i) for i, n in enumerate(others)]
    where = data.draw(st.integers(0, len(batch)))
    batch.insert(where, seqs[target])
    q2, k2, v2, cu2 = _pack(batch)
    out2 = ops.attention_varlen(q2, k2, v2, cu2.long())
    assert_bitwise_equal(out2[cu2[where]:cu2[where + 1]], out[cu[target]:cu[target + 1]], "other batch")


def _decode_and_compare(lens, seqs, packed, cache, start):
    """Prefills each sequence's first start[s] tokens in one chunk, then decodes the rest token by
    token (the sequences sharing every call, in alternating order); compares with ``packed``."""
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    cache.write(range(len(lens)), [0] * len(lens), [s[1][:n] for s, n in zip(seqs, start)],
                [s[2][:n] for s, n in zip(seqs, start)])
    for t in range(min(start), max(lens)):
        live = [s for s in range(len(lens)) if start[s] <= t < lens[s]][::-1 if t % 2 else 1]
        if not live:
            continue
        cache.write(live, [t] * len(live), [seqs[s][1][t:t + 1] for s in live], [seqs[s][2][t:t + 1] for s in live])
        out = cache.attend(live, [seqs[s][0][t:t + 1] for s in live], [t + 1] * len(live))
        for row, s in enumerate(live):
            assert_bitwise_equal(out[row:row + 1], packed[cu[s] + t:cu[s] + t + 1],
                                 f"sequence {s}, token {t}, page_size {cache.page_size}")


@settings(**SETTINGS)
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=3), page_size=st.sampled_from(PAGE_SIZES),
       hk=heads, d=head_dims, dtype=dtypes, seed=seeds, data=st.data())
def test_decode_step_by_step_equals_packed(lens, page_size, hk, d, dtype, seed, data):
    """The last (up to) 24 tokens of each sequence decoded one at a time against a NaN-filled paged
    cache with a random page layout, next to the other sequences in the same calls."""
    hq, hkv = hk
    seqs = [_seq(n, hq, hkv, d, dtype, seed + i) for i, n in enumerate(lens)]
    packed = ops.attention_varlen(*_pack(seqs))
    start = [data.draw(st.integers(max(0, n - 24), n - 1)) for n in lens]
    _decode_and_compare(lens, seqs, packed, _PagedCache(lens, page_size, hkv, d, dtype, seed), start)


def prefill_in_chunks_and_compare(cache, seqs, lens, cu, packed, chunk) -> None:
    """Fill ``cache`` in chunks of ``chunk(sequence, tokens left)`` tokens per step, every live sequence's chunk in
    one call, each chunk's output bitwise the packed forward's rows."""
    done = [0] * len(lens)
    while any(done[s] < lens[s] for s in range(len(lens))):
        live = [s for s in range(len(lens)) if done[s] < lens[s]]
        sizes = [chunk(s, lens[s] - done[s]) for s in live]
        cache.write(live, [done[s] for s in live], [seqs[s][1][done[s]:done[s] + n] for s, n in zip(live, sizes)],
                    [seqs[s][2][done[s]:done[s] + n] for s, n in zip(live, sizes)])
        out = cache.attend(live, [seqs[s][0][done[s]:done[s] + n] for s, n in zip(live, sizes)],
                           [done[s] + n for s, n in zip(live, sizes)])
        row = 0
        for s, n in zip(live, sizes):
            first = int(cu[s]) + done[s]
            assert_bitwise_equal(out[row:row + n], packed[first:first + n], f"sequence {s} chunk at {done[s]}")
            row, done[s] = row + n, done[s] + n


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_whole_sequences_token_by_token(page_size):
    lens = [150, 70]
    seqs = [_seq(n, 4, 2, 32, torch.bfloat16, i) for i, n in enumerate(lens)]
    packed = ops.attention_varlen(*_pack(seqs))
    _decode_and_compare(lens, seqs, packed, _PagedCache(lens, page_size, 2, 32, torch.bfloat16, 1), [0, 0])


@settings(**SETTINGS)
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=3), page_size=st.sampled_from(PAGE_SIZES),
       hk=heads, d=head_dims, dtype=dtypes, seed=seeds, data=st.data())
def test_chunked_prefill_equals_packed(lens, page_size, hk, d, dtype, seed, data):
    """Random chunk sizes per step (1 = decode), the sequences' chunks sharing each call."""
    hq, hkv = hk
    seqs = [_seq(n, hq, hkv, d, dtype, seed + i) for i, n in enumerate(lens)]
    q, k, v, cu = _pack(seqs)
    packed = ops.attention_varlen(q, k, v, cu)
    cache = _PagedCache(lens, page_size, hkv, d, dtype, seed)
    prefill_in_chunks_and_compare(cache, seqs, lens, cu, packed, lambda s, left: data.draw(st.integers(1, min(100, left))))
    # one-shot prefill of every sequence at once against the full cache
    full = cache.attend(range(len(lens)), [s[0] for s in seqs], lens)
    assert_bitwise_equal(full, packed, "one-shot prefill")


@pytest.mark.parametrize("dtype", DTYPES)
def test_signed_zero_values_agree_between_packed_and_decode(dtype):
    """V columns that are -0.0: keys past a row's position contribute 0 * V in the packed forward
    (-0.0) but 0 * 0 in decode; the contract's final + 0.0 makes both +0.0."""
    q, k, v = _seq(70, 2, 2, 32, dtype, 7)
    v[:, :, :4] = -0.0
    packed = ops.attention_varlen(q, k, v, torch.tensor([0, 70]))
    cache = _PagedCache([70], 16, 2, 32, dtype, 7)
    cache.write([0], [0], [k], [v])
    for t in (0, 5, 63, 64, 69):
        assert_bitwise_equal(cache.attend([0], [q[t:t + 1]], [t + 1]), packed[t:t + 1], f"token {t}")


def test_contract_formula_for_one_tile():
    """The strict output equals the contract written out by hand for one 16-row tile (Hq = Hkv = 1:
    rows are 16 consecutive tokens): per 64-key block, fp32 bmm, -inf mask, online softmax with
    tree_sum, a where-select for unseen blocks, acc / l rounded once."""
    from rlalign.reductions import tree_sum
    length, first, d = 150, 96, 64
    q, k, v = _seq(length, 1, 1, d, torch.bfloat16, 11)
    out = ops.attention_varlen(q, k, v, torch.tensor([0, length]))
    tile = q[first:first + 16, 0].float()[None]
    row_pos = torch.arange(first, first + 16)
    m, l, acc = torch.full((16,), float("-inf")), torch.zeros(16), torch.zeros(16, d)
    for j in range(math.ceil(length / spec.ATTN_KV_BLOCK)):
        key_pos = j * spec.ATTN_KV_BLOCK + torch.arange(spec.ATTN_KV_BLOCK)
        inside = key_pos < length
        kb = torch.where(inside[:, None], k[key_pos.clamp(max=length - 1), 0].float(), 0.0)
        vb = torch.where(inside[:, None], v[key_pos.clamp(max=length - 1), 0].float(), 0.0)
        s = torch.bmm(tile, kb.t()[None])[0] * d ** -0.5
        s = torch.where(key_pos <= row_pos[:, None], s, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[:, None])
        alpha = torch.exp(m - m_new)
        sees = row_pos >= j * spec.ATTN_KV_BLOCK
        l = torch.where(sees, l * alpha + tree_sum(p), l)
        acc = torch.where(sees[:, None], acc * alpha[:, None] + torch.bmm(p[None], vb[None])[0], acc)
        m = torch.where(sees, m_new, m)
    assert_bitwise_equal(out[first:first + 16, 0], (acc / l[:, None] + 0.0).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_backward_are_deterministic(dtype):
    seqs = [_seq(n, 4, 2, 64, dtype, i) for i, n in enumerate([130, 7, 64, 200])]
    q, k, v, cu = _pack(seqs)
    grad = torch.randn(q.shape, generator=_gen(3)).to(dtype)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ops.attention_varlen(*leaves, cu)
        return (out,) + torch.autograd.grad(out, leaves, grad)

    for name, a, b in zip(("out", "dq", "dk", "dv"), run(), run()):
        assert_bitwise_equal(a, b, name)


# ---- tier 2: accuracy -------------------------------------------------------------------------------

ACC_SHAPES = [(4, 4, 64), (8, 2, 128), (4, 1, 32)]
LENS = [1, 37, 65, 130]


def _atol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("profile", ["strict", "native"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ACC_SHAPES)
def test_varlen_matches_float64_reference(shape, dtype, profile):
    hq, hkv, d = shape
    q, k, v, cu = _pack([_seq(n, hq, hkv, d, dtype, i) for i, n in enumerate(LENS)])
    out = ops.attention_varlen(q, k, v, cu, profile=profile)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close_report(out, _naive(q, k, v, cu), atol=_atol(dtype), rtol=0, what=f"{profile} {shape}")
    scaled = ops.attention_varlen(q, k, v, cu, scale=0.3, profile=profile)
    assert_close_report(scaled, _naive(q, k, v, cu, scale=0.3), atol=_atol(dtype), rtol=0, what="scale=0.3")


@pytest.mark.parametrize("profile", ["strict", "native"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_matches_float64_reference(dtype, profile):
    hq, hkv, d = 8, 2, 64
    seqs = [_seq(n, hq, hkv, d, dtype, i) for i, n in enumerate(LENS)]
    q, k, v, cu = _pack(seqs)
    expected = _naive(q, k, v, cu)
    cache = _PagedCache(LENS, 16, hkv, d, dtype, 0)
    cache.write(range(len(LENS)), [0] * len(LENS), [s[1] for s in seqs], [s[2] for s in seqs])
    # the last 3 tokens (or fewer) of every sequence as a prefill chunk
    n_q = [min(3, n) for n in LENS]
    out = cache.attend(range(len(LENS)), [s[0][-n:] for s, n in zip(seqs, n_q)], LENS, profile=profile)
    rows = torch.cat([torch.arange(int(cu[i + 1]) - n, int(cu[i + 1])) for i, n in enumerate(n_q)])
    assert_close_report(out, expected[rows], atol=_atol(dtype), rtol=0, what=profile)


@pytest.mark.parametrize("profile", ["strict", "native"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 2, 64), (2, 2, 128), (4, 1, 32)])
def test_gradients_match_float64_autograd(shape, dtype, profile):
    hq, hkv, d = shape
    q, k, v, cu = _pack([_seq(n, hq, hkv, d, dtype, i) for i, n in enumerate([1, 70, 200, 64, 13])])
    grad = torch.randn(q.shape, generator=_gen(5)).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(ops.attention_varlen(*leaves, cu, profile=profile), leaves, grad)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(_naive(*ref_leaves, cu), ref_leaves, grad.double())
    # fp32: the only error is fp32 rounding; bf16: inputs, output and gradients are rounded to bf16
    atol, rtol = (2e-5, 1e-4) if dtype == torch.float32 else (3e-2, 2e-2)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == dtype
        assert_close_report(g, w, atol=atol, rtol=rtol, what=f"{profile} {name}")


def test_empty_sequences_and_empty_batch():
    seqs = [_seq(n, 2, 1, 32, torch.float32, i) for i, n in enumerate([5, 3])]
    q, k, v, _ = _pack(seqs)
    out = ops.attention_varlen(q, k, v, torch.tensor([0, 0, 5, 5, 8]))
    assert_bitwise_equal(out, ops.attention_varlen(q, k, v, torch.tensor([0, 5, 8])))
    empty = q[:0]
    assert ops.attention_varlen(empty, k[:0], v[:0], torch.tensor([0])).shape == (0, 2, 32)


# ---- tier 3: errors ----------------------------------------------------------------------------------

def _varlen_inputs():
    q, k, v, cu = _pack([_seq(n, 4, 2, 32, torch.float32, i) for i, n in enumerate([5, 9])])
    return dict(q=q, k=k, v=v, cu_seqlens=cu)


def _with(base, **changes):
    return {**base, **changes}


@pytest.mark.parametrize("change, message", [
    (lambda a: dict(q=a["q"].half(), k=a["k"].half(), v=a["v"].half()), "not supported in strict"),
    (lambda a: dict(k=a["k"].bfloat16()), "mixed dtypes"),
    (lambda a: dict(q=a["q"][:, :3]), "multiple of kv heads"),
    (lambda a: dict(q=a["q"][..., :31], k=a["k"][..., :31], v=a["v"][..., :31]), "head_dim must be even"),
    (lambda a: dict(q=a["q"][..., :16]), "head_dim"),
    (lambda a: dict(v=a["v"][:, :1]), "same T and Hkv"),
    (lambda a: dict(v=a["v"][..., :0]), "v's head_dim must be > 0"),
    (lambda a: dict(q=a["q"][0]), "must have 3 dims"),
    (lambda a: dict(cu_seqlens=torch.tensor([1, 5, 14])), "cu_seqlens[0] must be 0"),
    (lambda a: dict(cu_seqlens=torch.tensor([0, 9, 5, 14])), "non-decreasing"),
    (lambda a: dict(cu_seqlens=torch.tensor([0, 5, 13])), "does not match"),
    (lambda a: dict(cu_seqlens=torch.tensor([0.0, 5.0, 14.0])), "int32/int64"),
    (lambda a: dict(q=a["q"].index_fill(0, torch.tensor([3]), float("nan"))), "q contains NaN"),
    (lambda a: dict(k=a["k"].index_fill(0, torch.tensor([7]), float("inf"))), "k contains NaN or inf"),
    (lambda a: dict(v=a["v"].index_fill(0, torch.tensor([0]), float("-inf"))), "v contains NaN or inf"),
])
def test_varlen_bad_inputs_raise(change, message):
    base = _varlen_inputs()
    with pytest.raises(ContractError, match="rlalign.ops.attention_varlen: .*" + _re(message)):
        ops.attention_varlen(**_with(base, **change(base)))


def _re(text):
    return re.escape(text)


def _paged_inputs():
    hq, hkv, d = 4, 2, 32
    seqs = [_seq(n, hq, hkv, d, torch.float32, i) for i, n in enumerate([5, 9])]
    cache = _PagedCache([5, 9], 4, hkv, d, torch.float32, 0)
    cache.write([0, 1], [0, 0], [s[1] for s in seqs], [s[2] for s in seqs])
    return dict(q=torch.cat([seqs[0][0][-1:], seqs[1][0][-2:]]), k_cache=cache.k, v_cache=cache.v,
                block_table=cache.table, seq_lens=torch.tensor([5, 9]), cu_seqlens_q=torch.tensor([0, 1, 3]))


@pytest.mark.parametrize("change, message", [
    (lambda a: dict(seq_lens=torch.tensor([5, 17])), "needs 5"),
    (lambda a: dict(block_table=a["block_table"].index_fill(1, torch.tensor([0]), 99)), "is not a page id"),
    (lambda a: dict(seq_lens=torch.tensor([5, 1])), "has 2 queries but seq_lens[1]=1"),
    (lambda a: dict(cu_seqlens_q=torch.tensor([0, 1, 2])), "does not match"),
    (lambda a: dict(seq_lens=torch.tensor([5])), "must have S=2 rows"),
    (lambda a: dict(k_cache=a["k_cache"].bfloat16()), "mixed dtypes"),
    (lambda a: dict(k_cache=a["k_cache"][:, :, :1]), "same first three"),
    (lambda a: dict(k_cache=a["k_cache"].transpose(1, 2).contiguous().transpose(1, 2),
                    v_cache=a["v_cache"].transpose(1, 2).contiguous().transpose(1, 2)), "must be contiguous"),
    (lambda a: dict(q=a["q"].index_fill(0, torch.tensor([0]), float("nan"))), "q contains NaN"),
    (lambda a: dict(k_cache=_poison(a, "k_cache", float("inf"))), "NaN or inf within a sequence's context"),
    (lambda a: dict(v_cache=_poison(a, "v_cache", float("nan"))), "NaN or inf within a sequence's context"),
    (lambda a: dict(k_cache=_poison(a, "k_cache", float("-inf"))), "NaN or inf within a sequence's context"),
])
def test_paged_bad_inputs_raise(change, message):
    base = _paged_inputs()
    with pytest.raises(ContractError, match="rlalign.ops.attention_paged: .*" + _re(message)):
        ops.attention_paged(**_with(base, **change(base)))


def _poison(inputs, name, value):
    """A copy of the cache with one non-finite entry inside sequence 1's context (token 2)."""
    cache = inputs[name].clone()
    page = int(inputs["block_table"][1, 0])
    cache[page, 2, 1, 5] = value
    return cache


def test_paged_ignores_cache_outside_the_context():
    base = _paged_inputs()
    out = ops.attention_paged(**base)
    k, v = base["k_cache"].clone(), base["v_cache"].clone()
    unused = [p for p in range(k.shape[0]) if p not in base["block_table"].flatten().tolist()]
    k[unused], v[unused] = 1e30, float("-inf")
    k[int(base["block_table"][0, 1]), 1:] = float("inf")    # past sequence 0's 5 tokens in its 2nd page
    assert_bitwise_equal(ops.attention_paged(**_with(base, k_cache=k, v_cache=v)), out)


@pytest.mark.parametrize("change, message", [
    (lambda a: dict(k=a["k"].bfloat16(), v=a["v"].bfloat16()), "differs from the cache dtype"),
    (lambda a: dict(slot_mapping=torch.tensor([0, 400])), "outside the cache's"),
    (lambda a: dict(slot_mapping=torch.tensor([-1, 3])), "outside the cache's"),
    (lambda a: dict(slot_mapping=torch.tensor([3, 3])), "same slot twice"),
    (lambda a: dict(slot_mapping=torch.tensor([1, 2, 3])), "slot_mapping must be [T]"),
    (lambda a: dict(slot_mapping=torch.tensor([1.0, 2.0])), "int32/int64"),
    (lambda a: dict(k=a["k"][:, :1], v=a["v"][:, :1]), "do not match the cache"),
])
def test_write_kv_cache_bad_inputs_raise(change, message):
    base = dict(k=torch.randn(2, 2, 8), v=torch.randn(2, 2, 8), k_cache=torch.zeros(10, 4, 2, 8),
                v_cache=torch.zeros(10, 4, 2, 8), slot_mapping=torch.tensor([0, 5]))
    with pytest.raises(ContractError, match="rlalign.ops.write_kv_cache: .*" + _re(message)):
        ops.write_kv_cache(**_with(base, **change(base)))


def test_write_kv_cache_is_an_exact_copy():
    k, v = torch.randn(3, 2, 8).bfloat16(), torch.randn(3, 2, 8).bfloat16()
    kc, vc = torch.zeros(5, 4, 2, 8, dtype=torch.bfloat16), torch.zeros(5, 4, 2, 8, dtype=torch.bfloat16)
    ops.write_kv_cache(k, v, kc, vc, torch.tensor([17, 2, 9], dtype=torch.int32))
    for t, slot in enumerate([17, 2, 9]):
        assert_bitwise_equal(kc[slot // 4, slot % 4], k[t])
        assert_bitwise_equal(vc[slot // 4, slot % 4], v[t])
    assert int((kc != 0).any(-1).any(-1).sum()) == 3


def test_paged_forward_with_grad_enabled_is_the_no_grad_forward():
    """The paged path has no autograd (documented): with grad enabled and parameters that require grad,
    a model's paged forward still runs, gives the same bits, and leaves the KV cache a plain tensor."""
    from rlalign.models.batch import ForwardBatch, KVCache, contiguous_block_tables
    from rlalign.models.testing import tiny_model

    model = tiny_model("qwen3", seed=0)
    seqs = [[1, 2, 3, 4, 5], [6, 7]]

    def forward():
        cache = KVCache.for_model(model.config, 16, 4, torch.float32)
        batch = ForwardBatch.prefill(seqs, cache, contiguous_block_tables([len(s) for s in seqs], 4))
        return model.forward_hidden(batch), cache

    with_grad, cache = forward()
    with torch.no_grad():
        without, _ = forward()
    assert torch.equal(with_grad.detach(), without)
    assert not cache.k[0].requires_grad
