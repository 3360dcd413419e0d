"""Policy losses on hand-computed cases: values, gradients and statistics."""

import math

import pytest
import torch

from rlalign.algos import aggregate_loss, cispo_loss, gspo_loss, ppo_clip_loss
from tests.bitwise import assert_close_report

D = torch.float64


def t(values, grad=False):
    return torch.tensor(values, dtype=D, requires_grad=grad)


def close(actual, expected, tol=1e-12, what=""):
    assert_close_report(actual.detach(), torch.as_tensor(expected, dtype=D), atol=tol, rtol=0, what=what)


# ratios 0.5, 0.9, 1.1, 1.5, 1.5, 0.5 (old log-probs 0), advantages +1 x4, -1 x2
RATIOS = [0.5, 0.9, 1.1, 1.5, 1.5, 0.5]
ADV = [1, 1, 1, 1, -1, -1]


def ppo_inputs():
    lp = t([math.log(r) for r in RATIOS], grad=True)
    return lp, torch.zeros(6, dtype=D), t(ADV), torch.ones(6, dtype=torch.bool)


def test_ppo_clip_higher_values_and_grads():
    lp, old, adv, m = ppo_inputs()
    out = ppo_clip_loss(lp, old, adv, m, clip_low=0.2, clip_high=0.28)
    # max(-A r, -A clamp(r, 0.8, 1.28)):
    # r=.5,A=1: max(-.5,-.8) = -.5 | .9: -.9 | 1.1: -1.1 | 1.5,A=1: max(-1.5,-1.28) = -1.28 (clipped)
    # r=1.5,A=-1: max(1.5,1.28) = 1.5 | r=.5,A=-1: max(.5,.8) = .8 (clipped)
    close(out.loss, [-0.5, -0.9, -1.1, -1.28, 1.5, 0.8])
    out.loss.sum().backward()
    # d(-A r)/d lp = -A r where unclipped, 0 where clipped
    close(lp.grad, [-0.5, -0.9, -1.1, 0, 1.5, 0])
    s = out.stats
    close(s["clip_frac"], 2 / 6)
    close(s["clip_frac_high"], 1 / 6)
    close(s["clip_frac_low"], 1 / 6)
    close(s["dual_clip_frac"], 0)
    close(s["ratio_mean"], 1.0)
    close(s["ratio_max"], 1.5)
    close(s["ratio_min"], 0.5)
    close(s["approx_kl"], sum(r - math.log(r) - 1 for r in RATIOS) / 6)


def test_ppo_dual_clip():
    lp, old, adv, m = ppo_inputs()
    out = ppo_clip_loss(lp, old, adv, m, clip_low=0.2, clip_high=0.28, clip_c=1.4)
    # only token 4 (A=-1, loss 1.5 > 1.4 = -c A) is capped
    close(out.loss, [-0.5, -0.9, -1.1, -1.28, 1.4, 0.8])
    out.loss.sum().backward()
    close(lp.grad, [-0.5, -0.9, -1.1, 0, 0, 0])
    close(out.stats["dual_clip_frac"], 1 / 6)


def test_ppo_mask_and_is_weights():
    lp, old, adv, _ = ppo_inputs()
    m = torch.tensor([True, True, False, False, True, True])
    w = t([2, 1, 5, 5, 0.5, 1])
    out = ppo_clip_loss(lp, old, adv, m, clip_low=0.2, clip_high=0.28, is_weights=w)
    close(out.loss, [-1.0, -0.9, 0, 0, 0.75, 0.8])
    # stats over the 4 masked-in tokens only: clipped = token 5
    close(out.stats["clip_frac"], 1 / 4)
    close(out.stats["ratio_mean"], (0.5 + 0.9 + 1.5 + 0.5) / 4)
    out.loss.sum().backward()
    close(lp.grad, [-1.0, -0.9, 0, 0, 0.75, 0])


def test_ppo_symmetric_default_and_ratio_one():
    lp = t([-1.0, -2.0], grad=True)
    out = ppo_clip_loss(lp, lp.detach().clone(), t([2.0, -3.0]), torch.ones(2, dtype=torch.bool))
    close(out.loss, [-2.0, 3.0])
    out.loss.sum().backward()
    close(lp.grad, [-2.0, 3.0])


def gspo_inputs():
    # seq 0: token log ratios 0.1, 0.3 (mean 0.2); seq 1: -0.2; a masked-out prompt token in front
    lp = t([-5.0, -1.0 + 0.1, -2.0 + 0.3, -1.5 - 0.2], grad=True)
    old = t([-9.0, -1.0, -2.0, -1.5])
    adv = t([0.0, 1.0, 1.0, -1.0])
    m = torch.tensor([False, True, True, True])
    return lp, old, adv, m, torch.tensor([0, 0, 0, 1])


def test_gspo_sequence_ratio_clipped():
    lp, old, adv, m, seq = gspo_inputs()
    out = gspo_loss(lp, old, adv, m, seq, clip_low=0.2, clip_high=0.2)
    s0, s1 = math.exp(0.2), math.exp(-0.2)  # 1.2214 (> 1.2, A > 0: clipped), 0.8187 (inside)
    close(out.loss, [0, -1.2, -1.2, s1])
    out.loss.sum().backward()
    # clipped sequence: no gradient; seq 1: d(-A s)/d lp = s (token form: ratio grad = s * grad lp)
    close(lp.grad, [0, 0, 0, s1])
    close(out.stats["seq_ratio_mean"], (s0 + s1) / 2)
    close(out.stats["seq_clip_frac"], 0.5)
    close(out.stats["clip_frac"], 2 / 3)


def test_gspo_token_form_matches_sequence_objective_gradient():
    lp, old, adv, m, seq = gspo_inputs()
    out = gspo_loss(lp, old, adv, m, seq, clip_low=0.5, clip_high=0.5)
    s0, s1 = math.exp(0.2), math.exp(-0.2)
    close(out.loss, [0, -s0, -s0, s1])
    aggregate_loss(out.loss, m, seq, "seq-mean-token-mean").backward()
    # GSPO: J = -(1/G) sum_i A_i s_i, d/d lp_t = -(1/G) A_i s_i / |y_i|
    close(lp.grad, [0, -s0 / 4, -s0 / 4, s1 / 2])


def test_cispo():
    lp = t([math.log(0.5), math.log(2.0)], grad=True)
    out = cispo_loss(lp, torch.zeros(2, dtype=D), t([1.0, -1.0]), torch.ones(2, dtype=torch.bool),
                     clip_low=1.0, clip_high=0.28)
    # w = sg(clamp(r, 0, 1.28)) = [0.5, 1.28]; L = -w A lp
    close(out.loss, [-0.5 * math.log(0.5), 1.28 * math.log(2.0)])
    out.loss.sum().backward()
    close(lp.grad, [-0.5, 1.28])  # every token keeps a gradient, only the weight is truncated
    close(out.stats["clip_frac"], 0.5)


def test_cispo_lower_bound():
    lp = t([math.log(0.5)], grad=True)
    out = cispo_loss(lp, torch.zeros(1, dtype=D), t([2.0]), torch.ones(1, dtype=torch.bool), clip_low=0.2)
    close(out.loss, [-0.8 * 2.0 * math.log(0.5)])


def test_stats_are_detached_scalars():
    lp, old, adv, m = ppo_inputs()
    for out in (ppo_clip_loss(lp, old, adv, m), cispo_loss(lp, old, adv, m)):
        for name, value in out.stats.items():
            assert value.dim() == 0 and not value.requires_grad, name


def test_empty_mask_gives_zero_loss_and_stats():
    lp, old, adv, _ = ppo_inputs()
    out = ppo_clip_loss(lp, old, adv, torch.zeros(6, dtype=torch.bool))
    assert float(out.loss.detach().abs().sum()) == 0.0
    assert float(out.stats["clip_frac"]) == 0.0 and float(out.stats["ratio_max"]) == 0.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(clip_c=1.0), "clip_c must be > 1"),
    (dict(clip_low=1.5), "clip_low"),
    (dict(clip_high=-0.1), "clip_high"),
])
def test_ppo_bad_arguments(kwargs, message):
    lp, old, adv, m = ppo_inputs()
    with pytest.raises(ValueError, match=message):
        ppo_clip_loss(lp, old, adv, m, **kwargs)


def test_shape_errors():
    lp, old, adv, m = ppo_inputs()
    with pytest.raises(ValueError, match="rlalign.algos.ppo_clip_loss: lengths differ"):
        ppo_clip_loss(lp, old[:5], adv, m)
    with pytest.raises(ValueError, match="mask must be a bool"):
        ppo_clip_loss(lp, old, adv, m.double())
    with pytest.raises(ValueError, match="seq_ids"):
        gspo_loss(lp, old, adv, m, torch.zeros(6))
