"""Advantage estimators on small hand-computed cases (float64, expected numbers worked out by hand)."""

import math

import pytest
import torch

from rlalign.algos import (
    discounted_returns,
    expand_to_tokens,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
    whiten,
)
from tests.bitwise import assert_close_report

D = torch.float64


def t(values, dtype=D):
    return torch.tensor(values, dtype=dtype)


def ids(values):
    return torch.tensor(values, dtype=torch.int64)


def mask(values):
    return torch.tensor(values, dtype=torch.bool)


def close(actual, expected, tol=1e-12, what=""):
    assert_close_report(actual, t(expected), atol=tol, rtol=0, what=what)


# ---- GRPO / Dr.GRPO -------------------------------------------------------------------------

def test_grpo_group_normalised_unbiased_std():
    # group 0: [1,0,0,1], mean 0.5, sum sq dev 1, unbiased var 1/3 -> A = +-0.5 * sqrt(3)
    # group 1: [1,1] constant -> 0
    adv = grpo_advantages(t([1, 0, 0, 1, 1, 1]), ids([0, 0, 0, 0, 1, 1]), eps=0.0)
    h = 0.5 * math.sqrt(3)
    close(adv, [h, -h, -h, h, 0, 0])


def test_grpo_eps_in_denominator():
    adv = grpo_advantages(t([1, 0]), ids([0, 0]), eps=0.5)
    # mean 0.5, unbiased std sqrt(0.5) -> 0.5 / (0.70710678 + 0.5)
    close(adv, [0.5 / (math.sqrt(0.5) + 0.5), -0.5 / (math.sqrt(0.5) + 0.5)])


def test_dr_grpo_no_std_and_non_contiguous_groups():
    r, g = t([3, 1, 2, 5]), ids([1, 0, 1, 0])
    # group 0 = {1, 5}: mean 3; group 1 = {3, 2}: mean 2.5
    close(grpo_advantages(r, g, scale_by_std=False), [0.5, -2, -0.5, 2])
    # with std: group 0 std sqrt(8), group 1 std sqrt(0.5): every |A| = 1/sqrt(2)
    s = 1 / math.sqrt(2)
    close(grpo_advantages(r, g, eps=0.0), [s, -s, -s, s])


def test_grpo_singleton_group_is_zero():
    close(grpo_advantages(t([7.0, 1.0, 2.0]), ids([0, 1, 1]), eps=0.0), [0, -1 / math.sqrt(2), 1 / math.sqrt(2)])


def test_grpo_float32_and_empty_group_labels():
    adv = grpo_advantages(t([1, 0], torch.float32), ids([3, 3]), eps=0.0)  # groups 0..2 unused
    assert adv.dtype == torch.float32
    close(adv, [1 / math.sqrt(2), -1 / math.sqrt(2)], tol=1e-7)


# ---- RLOO ------------------------------------------------------------------------------------

def test_rloo_leave_one_out():
    # [1,0,0,1]: A_0 = 1 - (0+0+1)/3 = 2/3 ...; [2,4,9]: 2-6.5, 4-5.5, 9-3; singleton -> 0
    adv = rloo_advantages(t([1, 0, 0, 1, 2, 4, 9, 5]), ids([0, 0, 0, 0, 1, 1, 1, 2]))
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, -4.5, -1.5, 6, 0])


# ---- per-token rewards and returns --------------------------------------------------------------

SEQ = ids([0, 0, 0, 1, 1, 1])
RESP = mask([False, True, True, False, True, False])


def test_token_rewards_score_on_last_response_token():
    close(token_rewards(t([1, 2]), SEQ, RESP), [0, 0, 1, 0, 2, 0])


def test_token_rewards_with_kl_penalty():
    kl = t([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    # masked-in tokens: 1: -0.5*0.2 = -0.1; 2: -0.15 + 1 = 0.85; 4: -0.25 + 2 = 1.75
    close(token_rewards(t([1, 2]), SEQ, RESP, kl=kl, kl_coef=0.5), [0, -0.1, 0.85, 0, 1.75, 0])


def test_discounted_returns_skip_masked_tokens():
    r = t([0, 1, 2, 3, 100, 4])
    m = mask([True, True, True, True, False, True])
    # seq 0: G2 = 2, G1 = 1 + .5*2 = 2, G0 = 0 + .5*2 = 1; seq 1 (tokens 3, 5): G5 = 4, G3 = 3 + .5*4 = 5
    close(discounted_returns(r, SEQ, m, gamma=0.5), [1, 2, 2, 5, 0, 4])


# ---- REINFORCE++ ----------------------------------------------------------------------------

def test_reinforce_pp_without_baseline():
    seq, m = ids([0, 0, 1, 1, 1]), mask([True] * 5)
    adv, ret = reinforce_pp_advantages(t([1, 0]), seq, m, eps=0.0)
    close(ret, [1, 1, 0, 0, 0])
    # mean 0.4, unbiased var (2*.36 + 3*.16)/4 = 0.3
    s = math.sqrt(0.3)
    close(adv, [0.6 / s, 0.6 / s, -0.4 / s, -0.4 / s, -0.4 / s])


def test_reinforce_pp_kl_folded_into_reward():
    seq, m = ids([0, 0, 1, 1, 1]), mask([True] * 5)
    kl = t([0.2, 0, 0, 0.4, 0])
    adv, ret = reinforce_pp_advantages(t([1, 0]), seq, m, kl=kl, kl_coef=0.5, eps=0.0)
    # token rewards: [-0.1, 1], [0, -0.2, 0]; returns (gamma 1): [0.9, 1], [-0.2, -0.2, 0]
    close(ret, [0.9, 1.0, -0.2, -0.2, 0.0])
    # mean 0.3; deviations .6 .7 -.5 -.5 -.3; sum sq 1.44; unbiased var .36; std .6
    close(adv, [1.0, 7 / 6, -5 / 6, -5 / 6, -0.5])


def test_reinforce_pp_with_group_baseline():
    seq, m = ids([0, 0, 1, 2, 3]), mask([True] * 5)
    adv, ret = reinforce_pp_advantages(t([1, 0, 1, 1]), seq, m, group_ids=ids([0, 0, 1, 1]), eps=0.0)
    # baseline: [.5, -.5, 0, 0]; returns [.5, .5, -.5, 0, 0]; mean .1; sum sq dev .7; var .175
    close(ret, [0.5, 0.5, -0.5, 0, 0])
    s = math.sqrt(0.175)
    close(adv, [0.4 / s, 0.4 / s, -0.6 / s, -0.1 / s, -0.1 / s])


# ---- GAE --------------------------------------------------------------------------------------

def test_gae_gamma_lambda_one():
    seq, m = ids([0, 0, 0, 1, 1]), mask([False, True, True, True, True])
    r, v = t([0, 0, 1, 0, 2]), t([9, 0.5, 0.5, 1, 1])
    adv, ret = gae_advantages(r, v, seq, m, gamma=1.0, lam=1.0)
    # seq 0: delta2 = 1 - .5 = .5, delta1 = 0 + .5 - .5 = 0 -> A = [.5, .5]; returns A + V = [1, 1]
    # seq 1: delta4 = 2 - 1 = 1, delta3 = 0 + 1 - 1 = 0 -> A = [1, 1]; returns [2, 2]
    close(adv, [0, 0.5, 0.5, 1, 1])
    close(ret, [0, 1, 1, 2, 2])


def test_gae_gamma_lambda():
    seq, m = ids([0, 0, 0, 1, 1]), mask([False, True, True, True, True])
    r, v = t([0, 0, 1, 0, 2]), t([9, 0.5, 0.5, 1, 1])
    adv, ret = gae_advantages(r, v, seq, m, gamma=0.9, lam=0.8)
    # seq 0: delta2 = .5, delta1 = .9*.5 - .5 = -.05; A2 = .5, A1 = -.05 + .72*.5 = .31
    # seq 1: delta4 = 1, delta3 = .9 - 1 = -.1; A4 = 1, A3 = -.1 + .72 = .62
    close(adv, [0, 0.31, 0.5, 0.62, 1.0])
    close(ret, [0, 0.81, 1.0, 1.62, 2.0])


def test_gae_skips_masked_token_inside_sequence():
    adv, ret = gae_advantages(t([0, 5, 1]), t([0.5, 7, 0.5]), ids([0, 0, 0]), mask([True, False, True]),
                              gamma=0.9, lam=0.8)
    close(adv, [0.31, 0, 0.5])
    close(ret, [0.81, 0, 1.0])


def test_gae_interleaved_equals_contiguous():
    gen = torch.Generator().manual_seed(0)
    r, v = torch.rand(8, generator=gen, dtype=D), torch.rand(8, generator=gen, dtype=D)
    seq = ids([0, 1, 0, 1, 1, 0, 0, 1])
    m = mask([True] * 8)
    adv, _ = gae_advantages(r, v, seq, m, gamma=0.95, lam=0.9)
    order = torch.sort(seq, stable=True).indices
    adv_sorted, _ = gae_advantages(r[order], v[order], seq[order], m, gamma=0.95, lam=0.9)
    assert torch.equal(adv[order], adv_sorted)


# ---- helpers and errors -----------------------------------------------------------------------

def test_whiten_and_expand():
    close(whiten(t([1, 2, 3, 50]), mask([True, True, True, False]), eps=0.0), [-1, 0, 1, 0])
    close(expand_to_tokens(t([1.5, -2]), ids([0, 0, 1]), mask([False, True, True])), [0, 1.5, -2])


def test_outputs_have_no_grad():
    r = t([1.0, 0.0]).requires_grad_()
    assert not grpo_advantages(r, ids([0, 0])).requires_grad


@pytest.mark.parametrize("call, message", [
    (lambda: grpo_advantages(t([1, 2, 3]), ids([0, 0])), "lengths differ"),
    (lambda: grpo_advantages(t([1, 2]), t([0, 0])), "int64"),
    (lambda: grpo_advantages(t([1, 2]), ids([0, -1])), ">= 0"),
    (lambda: grpo_advantages(t([1, 2]), ids([0, 3]), num_groups=2), "< 2"),
    (lambda: token_rewards(t([1.0]), ids([0, 0]), torch.ones(2)), "bool"),
    (lambda: gae_advantages(t([1.0]), t([1.0, 2.0]), ids([0]), mask([True])), "lengths differ"),
])
def test_errors_name_function_and_problem(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert str(info.value).startswith("rlalign.algos.")
