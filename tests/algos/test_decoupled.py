"""Decoupled PPO (rlalign.algos.decoupled): the loss and its gradient against a float64 reference written from the
objective, the exact behaviour weight (1 where behaviour == proximal, bit for bit) and its TIS / MIS bounds.

Tolerance: the fp32 loss and gradient against the float64 reference within rtol 1e-5, atol 1e-6 (a few fp32 ulps
through one exp, two products and a clamp; log-prob gaps are drawn in [-3, 3])."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.algos import behaviour_correction, behaviour_weights, decoupled_ppo_loss
from rlalign.contract.bits import count_differences
from tests.bitwise import assert_close_report

RTOL, ATOL = 1e-5, 1e-6


def reference(lp, prox, behav, adv, mask, seq_ids, correction, cap, clip_low, clip_high):
    """The objective, float64, token by token: w * max(-A r, -A clamp(r, 1 - lo, 1 + hi)), r = exp(lp - prox),
    w = exp(prox - behav) (none), min(w, cap) (token_tis), 1 if 0.5 <= w <= cap else 0 (token_mis: its lower bound 0.5),
    min(exp(sum over the sequence of log w), cap) (seq_tis)."""
    lp = lp.double().detach().requires_grad_(True)
    prox, behav, adv = prox.double(), behav.double(), adv.double()
    log_w = prox - behav
    w = torch.exp(log_w)
    if correction == "token_tis":
        w = torch.clamp(w, max=cap)
    elif correction == "token_mis":
        w = torch.where((w >= 0.5) & (w <= cap), torch.ones_like(w), torch.zeros_like(w))
    elif correction == "seq_tis":
        seq = torch.zeros(int(seq_ids.max()) + 1 if len(seq_ids) else 0, dtype=torch.float64)
        seq = seq.index_add(0, seq_ids[mask], log_w[mask])
        w = torch.clamp(torch.exp(seq), max=cap)[seq_ids]
    r = torch.exp(lp - prox)
    loss = w * torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - clip_low, 1 + clip_high))
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    loss.sum().backward()
    return loss.detach(), lp.grad


@st.composite
def cases(draw):
    n_seq = draw(st.integers(1, 5))
    lens = [draw(st.integers(0, 7)) for _ in range(n_seq)]
    t = sum(lens)
    seed = draw(st.integers(0, 2**31 - 1))
    return lens, t, seed


@settings(max_examples=60, deadline=None)
@given(cases(), st.sampled_from(["none", "token_tis", "token_mis", "seq_tis"]), st.sampled_from([1.5, 2.0, 5.0]))
def test_decoupled_loss_and_gradient_match_a_float64_reference(case, correction, cap):
    lens, t, seed = case
    gen = torch.Generator().manual_seed(seed)
    behav = -torch.rand(t, generator=gen) * 4
    prox = behav + (torch.rand(t, generator=gen) * 2 - 1) * 1.5      # |prox - behav| <= 1.5
    lp = (prox + (torch.rand(t, generator=gen) * 2 - 1) * 1.5).requires_grad_(True)
    adv = torch.randn(t, generator=gen)
    mask = torch.rand(t, generator=gen) > 0.2
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.int64))
    knobs = {} if correction == "none" else {"mismatch_cap": cap}
    out = decoupled_ppo_loss(lp, prox, behav, adv, mask, seq_ids, correction=correction, clip_low=0.2,
                             clip_high=0.28, **knobs)
    out.loss.sum().backward()
    ref_loss, ref_grad = reference(lp, prox, behav, adv, mask, seq_ids, correction, cap, 0.2, 0.28)
    assert out.loss.dtype == torch.float32
    assert_close_report(out.loss.detach().double(), ref_loss, atol=ATOL, rtol=RTOL, what="loss")
    assert_close_report(lp.grad.double(), ref_grad, atol=ATOL, rtol=RTOL, what="gradient")


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 40), st.integers(0, 2**31 - 1))
def test_behaviour_weight_is_exactly_one_where_behaviour_is_the_proximal_policy(t, seed):
    """A sample the trainer's current weights drew (staleness 0): prox == behav bit for bit, so w == 1.0 exactly and
    the decoupled loss is the plain clipped surrogate's, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    prox = -torch.rand(t, generator=gen) * 5
    mask = torch.rand(t, generator=gen) > 0.3
    w = behaviour_weights(prox, prox.clone(), mask)
    assert count_differences(w.weights, torch.where(mask, 1.0, 0.0)) == 0


def test_bounds_and_stats():
    """w = 4, 0.6, 1 (a masked-out token last): none keeps 4; token_tis truncates at 2; token_mis drops w > 2."""
    prox = torch.tensor([math.log(4.0), math.log(0.6), 0.0, 3.0])
    behav = torch.zeros(4)
    mask = torch.tensor([True, True, True, False])
    seq = torch.tensor([0, 0, 1, 1])
    exact = behaviour_correction("none", prox, behav, mask, seq)
    assert exact.weights.tolist() == pytest.approx([4.0, 0.6, 1.0, 0.0])
    assert float(exact.stats["ratio_max"]) == pytest.approx(4.0) and float(exact.stats["ratio_min"]) == pytest.approx(0.6)
    assert behaviour_correction("token_tis", prox, behav, mask, seq, mismatch_cap=2.0).weights.tolist() == \
        pytest.approx([2.0, 0.6, 1.0, 0.0])
    mis = behaviour_correction("token_mis", prox, behav, mask, seq, mismatch_cap=2.0)
    assert mis.weights.tolist() == [0.0, 1.0, 1.0, 0.0] and mis.mask.tolist() == [False, True, True, False]
