"""The portable profile's backward (rlalign/ops/portable/grad.py): gradients against float64 autograd, the aten census
over ``backward()`` (only correctly rounded elementwise ops, exact ops, copies and tree sums), the embedding
gradient's fixed order, and the fused forwards unchanged by the autograd wrapping. CPU-vs-CUDA bits:
tests/cuda/test_cuda_portable_train.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract import use_profile
from rlalign.ops.portable import grad
from tests.bitwise import assert_bitwise_equal
from tests.ops.test_portable_ops import _Census

FAST = settings(max_examples=8, deadline=None)


def _cases(t: int, h: int, lens: list[int], hkv: int, group: int, d: int, vocab: int, seed: int):
    """(name, fn, inputs) of every differentiable portable op (and the embedding) on random inputs."""
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(t, h, generator=g), torch.randn(vocab, h, generator=g), torch.randn(vocab, generator=g)
    n = sum(lens)
    q, k, v = (torch.randn(n, hh, d, generator=g) for hh in (hkv * group, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    cos, sin = ops.rope_cos_sin(torch.arange(n), ops.rope_inv_freq(d, 10000.0))
    ids = torch.randint(0, vocab, (t, ), generator=g)
    yield "linear", lambda x, w, b: ops.linear(x, w, b), (x, w, b)
    yield "linear_group", lambda x, w: ops.linear_group(x, (w, w[:2] * 2.0)), (x, w)
    yield "rms_norm", lambda x, r, w: ops.rms_norm(x, w, 1e-6, residual=r), (x, torch.randn(t, h, generator=g),
                                                                             torch.randn(h, generator=g))
    yield "rope", lambda q: ops.rope(q, cos, sin), (q, )
    yield "silu_mul", lambda a, c: ops.silu_mul(a, c), (x, torch.randn(t, h, generator=g))
    yield "attention_varlen", lambda q, k, v: ops.attention_varlen(q, k, v, cu), (q, k, v)
    yield "logprob_entropy", lambda x, w: ops.logprob_entropy(x, w, ids, temperature=0.7), (x, w)
    yield "embedding", lambda w: ops.embedding(ids, w), (w, )


def _grads(fn, inputs, profile: str, dtype, seed: int):
    xs = [t.detach().to(dtype).requires_grad_() for t in inputs]
    with use_profile(profile):
        out = fn(*xs)
    outs = [o for o in (out if isinstance(out, tuple) else (out, )) if o is not None]
    g = torch.Generator().manual_seed(seed)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs])
    return [x.grad for x in xs]


@FAST
@given(t=st.integers(1, 7), h=st.integers(1, 12), lens=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       hkv=st.integers(1, 2), group=st.integers(1, 3), d=st.sampled_from([2, 4, 6]), vocab=st.integers(3, 13),
       seed=st.integers(0, 2**31))
def test_gradients_match_float64_autograd(t, h, lens, hkv, group, d, vocab, seed):
    """Every portable backward against autograd through the native formulas in float64 (relative to the largest
    gradient entry; the tolerance is a few fp32 roundings times the sizes' logs)."""
    for name, fn, inputs in _cases(t, h, lens, hkv, group, d, vocab, seed):
        got = _grads(fn, inputs, "portable", torch.float32, seed)
        ref = _grads(fn, inputs, "native", torch.float64, seed)
        for a, r in zip(got, ref):
            err = float((a.double() - r).abs().max()) / max(float(r.abs().max()), 1e-30)
            assert err < 2e-5, f"{name}: relative gradient error {err}"


def test_backward_uses_only_portable_arithmetic():
    """The aten census over each op's forward and backward (autograd's own bookkeeping included)."""
    census = _Census()
    for name, fn, inputs in _cases(5, 8, [3, 4], 2, 2, 4, 11, 1):
        xs = [t.detach().clone().requires_grad_() for t in inputs]
        with census:
            with use_profile("portable"):
                out = fn(*xs)
            outs = [o for o in (out if isinstance(out, tuple) else (out, )) if o is not None]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    assert not census.bad, f"library math or reductions in the portable backward: {dict(census.bad)}"


def test_embedding_gradient_is_a_tree_in_token_order():
    """Repeated ids: each row of dW is tree_sum of its tokens' rows, in token order (not an atomic scatter-add)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([4, 1, 4, 4, 0, 4, 1, 4, 4])
    dy = torch.randn(9, 5, generator=g) * torch.logspace(-4, 4, 9).unsqueeze(1)
    dw = grad.embedding_grad(ids, dy, (6, 5))
    from rlalign.reductions import tree_sum
    for v in range(6):
        rows = dy[ids == v]
        want = tree_sum(rows.t()) if len(rows) else torch.zeros(5)
        assert_bitwise_equal(dw[v], want)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_differentiable_forwards_keep_the_forward_bits(with_entropy):
    """Wrapping the ops in autograd Functions changes no forward bit (with or without a gradient)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 8, generator=g), torch.randn(9, 8, generator=g)
    t = torch.tensor([1, 2, 3, 8])
    with use_profile("portable"):
        plain = ops.logprob_entropy(x, w, t, with_entropy=with_entropy)
        tracked = ops.logprob_entropy(x, w.clone().requires_grad_(), t, with_entropy=with_entropy)
        assert_bitwise_equal(ops.linear(x, w), ops.linear(x, w.clone().requires_grad_()).detach())
    for a, b in zip(plain, tracked):
        if a is not None:
            assert_bitwise_equal(a, b.detach())


@FAST
@given(n=st.integers(1, 9), hkv=st.integers(1, 2), group=st.integers(1, 3), budget=st.integers(1, 200),
       seed=st.integers(0, 2**31))
def test_attention_backward_chunks_change_no_bit(n, hkv, group, budget, seed):
    """The attention backward's row and key chunks (memory only) against one chunk: the same bits."""
    from rlalign.ops.portable import attention
    g = torch.Generator().manual_seed(seed)
    q, o, do = (torch.randn(n, hkv * group, 4, generator=g) for _ in range(3))
    k, v = torch.randn(n, hkv, 4, generator=g), torch.randn(n, hkv, 4, generator=g)
    whole = grad._sequence_attention_grads(q, k, v, o, do, 0.5)
    saved = dict(attention.CHUNK_ELEMS), attention.DEFAULT_CHUNK_ELEMS
    try:
        attention.CHUNK_ELEMS.clear()
        attention.DEFAULT_CHUNK_ELEMS = budget
        chunked = grad._sequence_attention_grads(q, k, v, o, do, 0.5)
    finally:
        attention.CHUNK_ELEMS.update(saved[0])
        attention.DEFAULT_CHUNK_ELEMS = saved[1]
    for a, b in zip(whole, chunked):
        assert_bitwise_equal(a, b)


@FAST
@given(t=st.integers(1, 7), vocab=st.integers(2, 13), budget=st.integers(1, 60), entropy=st.booleans(),
       seed=st.integers(0, 2**31))
def test_head_backward_chunks_change_no_bit(t, vocab, budget, entropy, seed):
    """The head backward's token and vocab chunks (memory only) against the whole [tokens, vocab] at once."""
    from rlalign.ops.portable import logprob
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(t, 5, generator=g), torch.randn(vocab, 5, generator=g)
    targets, g_lp = torch.randint(0, vocab, (t, ), generator=g), torch.randn(t, generator=g)
    g_ent = torch.randn(t, generator=g) if entropy else None
    whole = grad._head_grads(h, w, targets, 0.7, g_lp, g_ent, True, True)
    saved = dict(logprob.CHUNK_ELEMS), logprob.DEFAULT_CHUNK_ELEMS
    try:
        logprob.CHUNK_ELEMS.clear()
        logprob.DEFAULT_CHUNK_ELEMS = budget
        chunked = grad._head_grads(h, w, targets, 0.7, g_lp, g_ent, True, True)
    finally:
        logprob.CHUNK_ELEMS.update(saved[0])
        logprob.DEFAULT_CHUNK_ELEMS = saved[1]
    for a, b in zip(whole, chunked):
        assert_bitwise_equal(a, b)
