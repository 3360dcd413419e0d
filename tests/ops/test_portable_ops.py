"""The portable profile's ops (rlalign/ops/portable): accuracy against float64, the aten census that makes "the same
bits on every device" hold by construction, prefill == decode == packed bitwise, row independence, and the
refusals. Their CPU-vs-CUDA bit comparison is tests/cuda/test_cuda_portable.py."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rlalign import ops
from rlalign.contract import use_profile
from rlalign.contract.errors import ContractError
from rlalign.ops.portable import arith
from tests.bitwise import assert_bitwise_equal

FAST = settings(max_examples=12, deadline=None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in units of the fp32 ulp at ref (ref float64)."""
    r32 = ref.float().abs()
    ulp = (torch.nextafter(r32, torch.tensor(float("inf"))) - r32).double()
    return (got.double() - ref).abs() / ulp


# ---- primitives: accuracy against float64 -----------------------------------------------------------------

def test_exp_within_one_ulp_over_the_normal_range():
    x = torch.cat([torch.rand(200_000, generator=_gen(1)) * 175.0 - 87.0,
                   torch.rand(20_000, generator=_gen(2)) * 2e-3 - 1e-3])
    assert float(_ulps(arith.exp(x), torch.exp(x.double())).max()) <= 1.0


def test_exp_subnormal_results_within_one_subnormal_step():
    x = torch.rand(20_000, generator=_gen(3)) * 16.5 - 103.9
    err = (arith.exp(x).double() - torch.exp(x.double())).abs()
    assert float(err.max()) <= 2.0 ** -149


def test_log_within_one_ulp_over_all_positive_floats():
    bits = torch.randint(1, 0x7F800000, (200_000,), generator=_gen(4), dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    assert float(_ulps(arith.log(x), torch.log(x.double())).max()) <= 1.0


def test_special_values():
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -1.0, 1.0])
    e, lg, sq = arith.exp(x), arith.log(x), arith.sqrt(x)
    assert e[:4].tolist() == [1.0, 1.0, float("inf"), 0.0] and e[4].isnan() and e[6] == float(np.float32(np.e))
    assert lg[:3].tolist() == [float("-inf"), float("-inf"), float("inf")] and lg[3:6].isnan().all() and lg[6] == 0
    assert sq[:3].tolist() == [0.0, 0.0, float("inf")] and sq[3:6].isnan().all() and sq[6] == 1.0
    assert arith.exp(torch.tensor([88.8, -104.0])).tolist() == [float("inf"), 0.0]


def test_sqrt_is_correctly_rounded():
    """numpy's fp32 sqrt is the hardware's (IEEE, correctly rounded); torch's CPU sqrt is MKL's and is not."""
    bits = torch.randint(0, 0x7F800001, (300_000,), generator=_gen(5), dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    assert np.array_equal(arith.sqrt(x).numpy(), np.sqrt(x.numpy()))


def test_sin_cos64_accuracy():
    a = torch.rand(200_000, generator=_gen(6), dtype=torch.float64) * 2e5
    s, c = arith.sin_cos64(a)
    assert float((s - torch.sin(a)).abs().max()) < 1e-15 and float((c - torch.cos(a)).abs().max()) < 1e-15


@FAST
@given(m=st.integers(1, 9), n=st.integers(1, 9), k=st.integers(1, 300), seed=st.integers(0, 2**31))
def test_matmul_nt_error_bound_and_row_independence(m, n, k, seed):
    """|error| <= (ceil(log2 K) + 1) u sum|x w| (a tree of depth ceil(log2 K), one rounding per product), and a
    row's bits do not depend on the other rows or on the chunking."""
    g = _gen(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    y = arith.matmul_nt(x, w)
    ref = x.double() @ w.double().T
    bound = (int(np.ceil(np.log2(k))) + 1) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert bool(((y.double() - ref).abs() <= bound).all())
    assert_bitwise_equal(y, arith.dot(x.unsqueeze(1), w.unsqueeze(0)), "the tree over the last dim")
    for i in range(m):
        assert_bitwise_equal(arith.matmul_nt(x[i:i + 1], w), y[i:i + 1], f"row {i} alone")
    saved = arith.DEFAULT_CHUNK_ELEMS
    try:
        arith.DEFAULT_CHUNK_ELEMS = 7
        assert_bitwise_equal(arith.matmul_nt(x, w), y, "tiny chunks")
    finally:
        arith.DEFAULT_CHUNK_ELEMS = saved


# ---- the census: only correctly rounded elementwise arithmetic, exact ops and copies --------------------

# float arithmetic IEEE rounds correctly one element at a time, and ops that are exact (no rounding at all)
ROUNDED = {"add", "sub", "mul", "div", "neg", "abs", "clamp", "round", "ceil", "floor", "nextafter", "mul_", "div_",
           "add_", "sub_"}
EXACT = {"amax", "max", "min", "maximum", "minimum", "argmax", "sort", "topk", "where", "eq", "ne", "lt", "le", "gt",
         "ge", "isnan", "isinf", "isposinf", "isneginf", "isfinite", "any", "all", "bitwise_and", "bitwise_or",
         "bitwise_not", "bitwise_xor", "bitwise_and_", "bitwise_or_", "bitwise_xor_", "bitwise_right_shift",
         "bitwise_right_shift_", "__lshift__", "__rshift__", "floor_divide", "remainder", "nonzero", "_unique2",
         "unique_consecutive",
         "_local_scalar_dense"}
MOVES = {"_to_copy", "copy_", "clone", "cat", "stack", "gather", "embedding", "index", "index_select", "index_copy_", "index_put_",
         "scatter_", "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "select", "slice",
         "unsqueeze", "squeeze", "detach", "alias", "lift_fresh", "empty", "empty_like", "new_empty", "zeros",
         "zeros_like", "ones", "ones_like", "full", "full_like", "new_ones", "new_zeros", "new_full", "arange", "scalar_tensor", "fill_", "zero_",
         "repeat_interleave", "slice_backward", "select_backward", "new_empty_strided", "_unsafe_index_put", "index_put", "_index_put_impl_",
         "masked_fill", "contiguous", "split", "unbind", "as_strided"}
INTEGER_ONLY = {"sum", "cumsum"}   # exact on integers and bools; a float sum would be a library reduction
FLOAT64_ONLY = {"sqrt"}            # arith.sqrt's guess, corrected exactly


class _Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bad = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        dtypes = {a.dtype for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        floats = {d for d in dtypes if d.is_floating_point}
        ok = name in ROUNDED | EXACT | MOVES
        if name in INTEGER_ONLY:
            ok = not floats
        if name in FLOAT64_ONLY:
            ok = floats == {torch.float64}
        if name in ("div", "div_") and floats:   # a scalar divisor is a reciprocal multiply on CUDA
            ok = isinstance(args[1], torch.Tensor) and args[1].ndim >= 1
        if name in ("add", "sub", "add_", "sub_") and kwargs.get("alpha", 1) != 1:
            ok = False
        if not ok:
            self.bad[f"{name}.{func._overloadname}{sorted(str(d) for d in dtypes)}"] += 1
        return func(*args, **kwargs)


def _every_op():
    """One call of every portable op (greedy, temperature, top-k, top-p and min-p rows in the sampler)."""
    g = _gen(7)
    x, w, b = torch.randn(6, 16, generator=g), torch.randn(10, 16, generator=g), torch.randn(10, generator=g)
    q, k, v = torch.randn(7, 4, 8, generator=g), torch.randn(7, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g)
    inv_freq = ops.rope_inv_freq(8, 10000.0)   # the model's float64 config value, computed once at load
    kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    yield lambda: ops.linear(x, w, b)
    yield lambda: ops.linear_group(x, (w, w[:3]))
    yield lambda: ops.rms_norm(x, b.new_ones(16), 1e-6, residual=x)
    yield lambda: ops.rope(q, *ops.rope_cos_sin(torch.arange(7), inv_freq))
    yield lambda: ops.silu_mul(x, x)
    yield lambda: ops.attention_varlen(q, k, v, torch.tensor([0, 3, 7]))
    yield lambda: ops.rope_write_kv(q, k, v, *ops.rope_cos_sin(torch.arange(7), inv_freq), kc, vc, torch.arange(7),
                                    qk_norm=(torch.ones(8), torch.ones(8), 1e-6))
    yield lambda: ops.attention_paged(q, kc, vc, torch.tensor([[1, 0]]), torch.tensor([7]), torch.tensor([0, 7]))
    yield lambda: ops.logprob_entropy(x, w, torch.arange(6) % 10, temperature=0.7)
    yield lambda: ops.sample(ops.lm_logits(x, w), seeds=1, seq_ids=torch.arange(6), positions=3,
                             temperature=torch.tensor([0.0, 0.5, 1, 1, 1, 1]), top_k=torch.tensor([0, 0, 3, 0, 2, 0]),
                             top_p=torch.tensor([1, 1, 1, 0.5, 0.9, 1.0]), min_p=0.1)


def test_portable_ops_call_only_correctly_rounded_or_exact_aten_ops():
    census = _Census()
    with use_profile("portable"), torch.no_grad():
        for call in _every_op():
            with census:
                call()
    assert not census.bad, f"library math or reductions in the portable profile: {dict(census.bad)}"


def test_the_census_catches_library_math():
    census = _Census()
    x = torch.ones(4, 4)
    with census:
        torch.exp(x), x @ x, x.sum(), x / 2.0
    assert {key.split(".")[0] for key in census.bad} >= {"exp", "mm", "sum", "div"}


# ---- prefill == decode == packed ------------------------------------------------------------------------

def _paged(k_rows, v_rows, page: int, order: list[int]):
    """One sequence's rows in pages laid out in ``order`` (page ids), caches with one spare page."""
    n_pages = len(order) + 1
    kc = torch.zeros(n_pages, page, *k_rows.shape[1:])
    vc = torch.zeros_like(kc)
    slots = torch.tensor([order[t // page] * page + t % page for t in range(k_rows.shape[0])])
    ops.write_kv_cache(k_rows, v_rows, kc, vc, slots)
    return kc, vc, torch.tensor([order + [n_pages - 1]])


def _packed_qkv(lens, hkv, group, d, seed):
    """Random packed q [T, hkv * group, d], k and v [T, hkv, d] of sequences ``lens`` and their cu_seqlens."""
    g, total = _gen(seed), sum(lens)
    q = torch.randn(total, hkv * group, d, generator=g)
    k, v = torch.randn(total, hkv, d, generator=g), torch.randn(total, hkv, d, generator=g)
    return q, k, v, torch.tensor([0] + list(np.cumsum(lens)))


@FAST
@given(lens=st.lists(st.integers(1, 19), min_size=1, max_size=3), hkv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3]), d=st.sampled_from([2, 6, 16]), page=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 2**31))
def test_prefill_decode_and_packed_give_the_same_bits(lens, hkv, group, d, page, seed):
    q, k, v, cu = _packed_qkv(lens, hkv, group, d, seed)
    with use_profile("portable"):
        packed = ops.attention_varlen(q, k, v, cu)
        for s, n in enumerate(lens):
            a = int(cu[s])
            order = list(range(-(-n // page)))[::-1]
            kc, vc, table = _paged(k[a:a + n], v[a:a + n], page, order)
            prefill = ops.attention_paged(q[a:a + n], kc, vc, table, torch.tensor([n]), torch.tensor([0, n]))
            assert_bitwise_equal(prefill, packed[a:a + n], f"prefill of sequence {s}")
            for t in range(n):   # decode: one query, the context up to it
                step = ops.attention_paged(q[a + t:a + t + 1], kc, vc, table, torch.tensor([t + 1]),
                                           torch.tensor([0, 1]))
                assert_bitwise_equal(step, packed[a + t:a + t + 1], f"decode step {t} of sequence {s}")


@FAST
@given(lens=st.lists(st.integers(1, 17), min_size=1, max_size=3), hkv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2]), d=st.sampled_from([2, 8, 32]), seed=st.integers(0, 2**31))
def test_attention_accuracy(lens, hkv, group, d, seed):
    """Against float64 causal softmax attention: |error| <= 1e-5 (|v| ~ 1)."""
    q, k, v, cu = _packed_qkv(lens, hkv, group, d, seed)
    with use_profile("portable"):
        out = ops.attention_varlen(q, k, v, cu)
    for s, n in enumerate(lens):
        a = int(cu[s])
        qs, ks, vs = (x[a:a + n].double() for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        scores = torch.einsum("thd,uhd->htu", qs, ks) * d ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("htu,uhd->thd", scores.softmax(-1), vs)
        assert float((out[a:a + n].double() - ref).abs().max()) <= 1e-5


@FAST
@given(t=st.integers(1, 4), h=st.integers(1, 70), seed=st.integers(0, 2**31))
def test_dense_ops_accuracy(t, h, seed):
    """rms_norm, silu_mul and rope against float64 (relative 1e-6 of the output scale)."""
    g = _gen(seed)
    x, w, up = torch.randn(t, h, generator=g), torch.randn(h, generator=g), torch.randn(t, h, generator=g)
    with use_profile("portable"):
        norm = ops.rms_norm(x, w, 1e-6)
        silu = ops.silu_mul(x, up)
        xr = torch.randn(t, 2, 2 * h, generator=g)
        cos, sin = ops.rope_cos_sin(torch.arange(t) * 1000, ops.rope_inv_freq(2 * h, 10000.0))
        rot = ops.rope(xr, cos, sin)
    xd = x.double()
    ref_norm = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert float((norm.double() - ref_norm).abs().max()) <= 1e-6 * (1 + float(ref_norm.abs().max()))
    ref_silu = xd * torch.sigmoid(xd) * up.double()
    assert float((silu.double() - ref_silu).abs().max()) <= 1e-6 * (1 + float(ref_silu.abs().max()))
    angles = (torch.arange(t) * 1000).double()[:, None] * ops.rope_inv_freq(2 * h, 10000.0)[None, :]
    c, s_ = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
    x1, x2 = xr[..., :h].double(), xr[..., h:].double()
    ref_rot = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1)
    assert float((rot.double() - ref_rot).abs().max()) <= 1e-6 * (1 + float(ref_rot.abs().max()))


# ---- LM head and sampler --------------------------------------------------------------------------------

@FAST
@given(t=st.integers(1, 5), vocab=st.integers(1, 70), h=st.integers(1, 40), temp=st.sampled_from([1.0, 0.7]),
       seed=st.integers(0, 2**31))
def test_logprob_entropy_accuracy_and_row_independence(t, vocab, h, temp, seed):
    g = _gen(seed)
    hidden, weight = torch.randn(t, h, generator=g), torch.randn(vocab, h, generator=g)
    targets = torch.randint(0, vocab, (t,), generator=g)
    with use_profile("portable"):
        lp, ent = ops.logprob_entropy(hidden, weight, targets, temperature=temp)
        z64 = (hidden.double() @ weight.double().T) / temp
        ref = torch.log_softmax(z64, -1)
        assert bool(((lp.double() - ref.gather(1, targets[:, None]).squeeze(1)).abs() <= 1e-5 * (1 + ref.abs().max())).all())
        ref_ent = -(ref.exp() * ref).sum(-1)
        assert bool(((ent.double() - ref_ent).abs() <= 1e-5 * (1 + z64.abs().max())).all())
        for i in range(t):
            one_lp, one_ent = ops.logprob_entropy(hidden[i:i + 1], weight, targets[i:i + 1], temperature=temp)
            assert_bitwise_equal(one_lp, lp[i:i + 1], f"token {i} alone")
            assert_bitwise_equal(one_ent, ent[i:i + 1], f"token {i} alone")


def test_sampled_rows_do_not_depend_on_the_batch():
    g = _gen(8)
    logits = torch.randn(9, 50, generator=g) * 3
    settings_ = dict(temperature=torch.tensor([0.0, 0.6, 1.0, 1.0, 1.3, 1.0, 0.9, 1.0, 1.0]),
                     top_k=torch.tensor([0, 0, 5, 0, 3, 0, 0, 1, 0]),
                     top_p=torch.tensor([1.0, 1.0, 1.0, 0.6, 0.95, 1.0, 1.0, 1.0, 0.3]))
    with use_profile("portable"):
        batch = ops.sample(logits, seeds=11, seq_ids=torch.arange(9), positions=4, **settings_)
        for i in range(9):
            one = ops.sample(logits[i:i + 1], seeds=11, seq_ids=i, positions=4,
                             **{key: val[i:i + 1] for key, val in settings_.items()})
            assert int(one) == int(batch[i])
    assert int(batch[0]) == int(logits[0].argmax())
    assert int(batch[7]) == int(logits[7].argmax())
    assert int(batch[2]) in logits[2].topk(5).indices.tolist()


# ---- fail closed ----------------------------------------------------------------------------------------

def test_unimplemented_ops_refuse_in_one_line():
    with use_profile("portable"):
        with pytest.raises(ContractError, match="not implemented in the portable profile"):
            ops.moe_route(torch.randn(3, 4), 2, normalize=True)
        with pytest.raises(ContractError, match="not implemented in the portable profile"):
            ops.sampled_logprob(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1]), top_k=2)
        w = torch.randn(3, 4, requires_grad=True)
        with pytest.raises(ContractError, match="backward pass .* not implemented in the portable profile"):
            ops.lm_logits(torch.randn(2, 4, requires_grad=True), w)
        with pytest.raises(ContractError, match="sliding-window"):
            ops.attention_varlen(torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4),
                                 torch.tensor([0, 3]), window=2)
    with pytest.raises(ContractError, match="not implemented in the portable profile"):
        ops.moe_route(torch.randn(3, 4), 2, normalize=True, profile="portable")

