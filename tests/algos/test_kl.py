"""KL estimators: hand values, exact unbiasedness on a discrete distribution, loss/reward helpers."""

import math

import pytest
import torch

from rlalign.algos import kl_estimate, kl_k1, kl_k2, kl_k3, kl_loss, kl_reward_penalty
from tests.bitwise import assert_close_report

D = torch.float64


def close(actual, expected, tol=1e-12):
    assert_close_report(actual.detach(), torch.as_tensor(expected, dtype=D), atol=tol, rtol=0)


def test_estimators_hand_values():
    lp, ref = torch.tensor([math.log(0.5)], dtype=D), torch.tensor([math.log(0.25)], dtype=D)
    close(kl_k1(lp, ref), [math.log(2)])
    close(kl_k2(lp, ref), [0.5 * math.log(2) ** 2])
    # log_r = ref - lp = -log 2: exp(log_r) - log_r - 1 = 0.5 + log 2 - 1
    close(kl_k3(lp, ref), [0.5 + math.log(2) - 1])
    close(kl_estimate(lp, ref, "k3"), [0.5 + math.log(2) - 1])


def test_k1_k3_unbiased_for_kl_exactly():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=D)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=D)
    exact = float((p * (p / q).log()).sum())  # KL(p || q)
    for fn in (kl_k1, kl_k3):
        close((p * fn(p.log(), q.log())).sum(), exact)
    assert float((p * kl_k2(p.log(), q.log())).sum()) != pytest.approx(exact)  # k2 is biased


def test_clamp():
    lp, ref = torch.tensor([-20.0, 0.0], dtype=D), torch.tensor([0.0, 0.0], dtype=D)
    close(kl_estimate(lp, ref, "k3", clamp=10.0), [10.0, 0.0])
    close(kl_estimate(lp, ref, "k1", clamp=5.0), [-5.0, 0.0])


def test_kl_loss_masked_and_gradient():
    lp = torch.tensor([math.log(0.5), -3.0], dtype=D, requires_grad=True)
    ref = torch.tensor([math.log(0.25), -1.0], dtype=D, requires_grad=True)
    m = torch.tensor([True, False])
    loss = kl_loss(lp, ref, m, "k3")
    close(loss, [0.5 + math.log(2) - 1, 0.0])
    loss.sum().backward()
    # d k3 / d lp = 1 - exp(ref - lp) = 1 - 0.5
    close(lp.grad, [0.5, 0.0])
    assert ref.grad is None  # the reference is a constant


def test_kl_reward_penalty():
    kl = torch.tensor([0.2, 0.4, 1.0], dtype=D, requires_grad=True)
    pen = kl_reward_penalty(kl, torch.tensor([True, True, False]), 0.5)
    close(pen, [-0.1, -0.2, 0.0])
    assert not pen.requires_grad


def test_errors():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="unknown estimator 'k4'"):
        kl_estimate(x, x, "k4")
    with pytest.raises(ValueError, match="shapes differ"):
        kl_estimate(x, torch.zeros(3), "k1")
