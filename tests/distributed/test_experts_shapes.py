"""The tensor-parallel experts in one process (TP=1, the reference every degree reproduces; the degrees
themselves are compared in test_tp.py on 4 gloo processes), over shapes drawn by hypothesis: the forward is
the unsharded experts' bits (ops.moe_experts) and the gradients agree to rounding, for any token count
(0 and 1 included), expert count, top-k up to E, routing skew and dtype."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings, strategies as st

from rlalign.distributed.experts import TensorParallelExperts
from rlalign.distributed.launch import Group
from rlalign.models.moe import StackedExperts
from tests.bitwise import assert_bitwise_equal, assert_close_report

HIDDEN = 32


def _sharded(experts: StackedExperts, group: Group) -> TensorParallelExperts:
    return TensorParallelExperts(experts, group, "experts")


@st.composite
def cases(draw):
    n_experts = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, n_experts))
    tokens = draw(st.integers(0, 40))
    inter = draw(st.sampled_from([16, 48, 64]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    skew = draw(st.booleans())      # every token's first choice the same expert
    seed = draw(st.integers(0, 2**16))
    return n_experts, top_k, tokens, inter, dtype, skew, seed


def _scale(t: torch.Tensor) -> float:
    return (float(t.abs().max()) or 1.0) if t.numel() else 1.0


def _run(experts, x, ids, g):
    x = x.clone().requires_grad_(True)
    y = experts(x, ids)
    if y.requires_grad:
        (y.float() * g).sum().backward()
    grads = {n: p.grad for n, p in experts.named_parameters() if p.grad is not None}
    return y.detach(), (x.grad if x.grad is not None else torch.zeros_like(x)), grads


@settings(max_examples=25, deadline=None)
@given(cases())
def test_tp1_experts_forward_is_the_unsharded_bits_and_gradients_agree(case):
    n_experts, top_k, tokens, inter, dtype, skew, seed = case
    gen = torch.Generator().manual_seed(seed)
    plain = StackedExperts(n_experts, HIDDEN, inter, dtype, "cpu")
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:top_k] for _ in range(tokens)]) if tokens \
        else torch.zeros((0, top_k), dtype=torch.long)
    if skew and tokens:
        ids[:, 0] = ids[0, 0]
        ids[:, 1:] = torch.stack([torch.tensor([e for e in range(n_experts) if e != ids[0, 0]][:top_k - 1],
                                               dtype=torch.long)] * tokens) if top_k > 1 else ids[:, 1:]
    g = torch.randn(tokens, top_k, HIDDEN, generator=gen)
    y_ref, dx_ref, grads_ref = _run(plain, x, ids.long(), g)
    y, dx, grads = _run(_sharded(copy.deepcopy(plain), Group.single()), x, ids.long(), g)
    assert_bitwise_equal(y, y_ref, f"{case} y")
    assert set(grads) == set(grads_ref), case          # no rows at all: no gradient on either side
    tol = 2e-2 if dtype is torch.bfloat16 else 1e-5
    assert_close_report(dx, dx_ref, atol=tol * _scale(dx_ref), rtol=tol, what=f"{case} dx")
    for name, grad in grads.items():
        ref = grads_ref[name]
        assert_close_report(grad, ref, atol=tol * _scale(ref), rtol=tol, what=f"{case} {name}")
