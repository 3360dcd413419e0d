"""The native profile as a fair fast baseline for training, CPU tier.

- attention_varlen native vs strict within tolerance, forward and gradients, over ragged packed
  batches (empty and one-token sequences, GQA ratios); on CPU the flash varlen kernel is unavailable
  and the padded SDPA call runs, with one log line naming why (tests/cuda/ covers the flash kernel).
- logprob_entropy native (token-chunked, recomputing backward) vs float64 over shapes, chunk sizes
  at and around the token count, temperatures, with and without entropy; and it never creates a
  tensor of T x V elements when the batch spans several chunks (the fused loss's memory property).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from rlalign import ops
from rlalign.ops.attention import flash_varlen_unavailable
from tests.bitwise import assert_close_report

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _packed(lens, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return q, k, v, cu


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.sampled_from([0, 1, 2, 7, 33, 64, 65]), min_size=1, max_size=5),
       heads=st.sampled_from([(2, 2), (4, 2), (4, 1), (8, 2)]), d=st.sampled_from([8, 32, 64]),
       dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**16))
def test_native_varlen_matches_strict(lens, heads, d, dtype, seed):
    dt = DTYPES[dtype]
    q, k, v, cu = _packed(lens, *heads, d, dt, seed)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dt)
    results = {}
    for profile in ("strict", "native"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ops.attention_varlen(*leaves, cu, profile=profile)
        results[profile] = (out, *torch.autograd.grad(out, leaves, grad, allow_unused=True)) if out.numel() else (out,)
    atol, rtol = (3e-5, 1e-4) if dt == torch.float32 else (4e-2, 3e-2)
    for name, n, s in zip(("out", "dq", "dk", "dv"), results["native"], results["strict"]):
        assert n.dtype == s.dtype == dt and n.shape == s.shape
        assert_close_report(n.float(), s.float(), atol=atol, rtol=rtol, what=f"native vs strict {name} {lens}")


def test_cpu_native_varlen_says_why_it_pads(rlalign_log):
    q, k, v, cu = _packed([3, 5], 4, 2, 16, torch.float32, 0)
    assert "CUDA-only" in flash_varlen_unavailable(q, k)
    ops.attention_varlen(q, k, v, cu, profile="native")
    # logged once per reason per process: an earlier test may have logged it already
    from rlalign.ops.attention import _log_fallback
    _log_fallback.cache_clear()
    ops.attention_varlen(q, k, v, cu, profile="native")
    assert any("padded SDPA" in m and "CUDA-only" in m for m in rlalign_log.messages)


def _reference(hidden, weight, targets, temperature, g_lp, g_ent):
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logp = F.log_softmax(h @ w.T / temperature, dim=-1)
    lp = logp.gather(1, targets[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    loss = (lp * g_lp.double()).sum() + (0 if g_ent is None else (ent * g_ent.double()).sum())
    if h.shape[0]:
        loss.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@settings(max_examples=25, deadline=None)
@given(tokens=st.sampled_from([0, 1, 63, 64, 65, 130]), vocab=st.sampled_from([1, 2, 97, 1025]),
       token_chunk=st.sampled_from([None, 64, 128]), temperature=st.sampled_from([1.0, 0.7]),
       with_entropy=st.booleans(), dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**16))
def test_native_fused_logprob_matches_float64(tokens, vocab, token_chunk, temperature, with_entropy, dtype, seed):
    dt, hidden_size = DTYPES[dtype], 32
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=g).to(dt)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.3).to(dt)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    g_lp, g_ent = torch.randn(2, tokens, generator=g)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = ops.logprob_entropy(h, w, targets, temperature=temperature, token_chunk=token_chunk,
                                  with_entropy=with_entropy, profile="native")
    assert (ent is None) == (not with_entropy)
    ref_lp, ref_ent, ref_dh, ref_dw = _reference(hidden, weight, targets, temperature, g_lp,
                                                 g_ent if with_entropy else None)
    assert_close_report(lp, ref_lp, atol=1e-4, rtol=0, what="native logprob")
    if with_entropy:
        assert_close_report(ent, ref_ent, atol=1e-4, rtol=0, what="native entropy")
    if not tokens:
        return
    ((lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)).backward()
    # fp32 rounding of each d logit is ~1e-7 |g| (1 - p cancels when p is near 1, e.g. V = 2), summed over
    # the reduction: atol scales with |g| max|other operand| sqrt(reduction length); bf16 adds its final
    # rounding (rtol)
    rtol = 1e-4 if dt == torch.float32 else 2**-7
    g_max = float(g_lp.abs().max() + (g_ent.abs().max() if with_entropy else 0)) / temperature
    for name, got, ref, other, length in (("d hidden", h.grad, ref_dh, weight, vocab),
                                          ("d weight", w.grad, ref_dw, hidden, tokens)):
        atol = 2e-6 * g_max * float(other.float().abs().max()) * length ** 0.5
        assert got.dtype == dt
        assert_close_report(got, ref, atol=atol, rtol=rtol, what=f"native {name}")


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("with_entropy", [False, True])
def test_native_fused_logprob_never_makes_full_logits(with_entropy):
    tokens, vocab, chunk = 256, 3000, 64
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, 16, generator=g).requires_grad_()
    w = torch.randn(vocab, 16, generator=g).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    with _LargestTensor() as mode:
        lp, ent = ops.logprob_entropy(h, w, targets, token_chunk=chunk, with_entropy=with_entropy, profile="native")
        (lp.sum() + (ent.sum() if with_entropy else 0)).backward()
    assert mode.largest <= chunk * vocab, f"a tensor of {mode.largest} elements (> one chunk's {chunk * vocab})"
