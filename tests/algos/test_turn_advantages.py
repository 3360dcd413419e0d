"""Per-turn advantages (``algo.turn_advantage=turn``): each turn's tokens get the advantage of the turn's
return-to-go against the same turn index of the prompt's other episodes -- equal to a float64 reference over turn
counts, rewards, masks and groups; on one-turn episodes bit for bit the per-episode advantages."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.algos import ADVANTAGES, AdvantageInputs, TurnInputs, expand_turns_to_tokens, turn_groups
from rlalign.envs.episodes import Episode
from tests.bitwise import assert_bitwise_equal, assert_close_report

ESTIMATORS = ("grpo", "dr_grpo", "rloo")
# rewards exact in fp32 and in their sums, so the float64 reference and the fp32 estimator see the same returns
REWARDS = st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 1.5, 3.0])

episode_shape = st.tuples(
    st.lists(st.tuples(REWARDS, st.integers(1, 3), st.integers(0, 2)), min_size=1, max_size=4),  # turns
    REWARDS)                                                                                   # final reward
groups = st.lists(st.lists(episode_shape, min_size=1, max_size=4), min_size=1, max_size=3)


def _episodes(shape):
    """Episode records: per turn (reward, generated tokens, observation tokens after it; the last turn has none)."""
    out = []
    for g, members in enumerate(shape):
        for k, (turns, final) in enumerate(members):
            ep = Episode(g, k, [1])
            for t, (reward, gen, obs) in enumerate(turns):
                obs = 0 if t == len(turns) - 1 else obs
                ep.tokens += [2] * (gen + obs)
                ep.generated += [True] * gen + [False] * obs
                ep.turns += [t] * (gen + obs)
                ep.turn_rewards.append(reward)
            ep.final_reward = final
            out.append(ep)
    return out


def _inputs(episodes, mask_bits=None):
    seq_ids = torch.tensor([i for i, e in enumerate(episodes) for _ in e.tokens], dtype=torch.int64)
    mask = torch.tensor([g for e in episodes for g in e.generated], dtype=torch.bool)
    if mask_bits is not None:
        mask &= torch.tensor([mask_bits[i % len(mask_bits)] for i in range(len(mask))], dtype=torch.bool)
    turns = TurnInputs(torch.tensor([g for e in episodes for g in e.returns_to_go()], dtype=torch.float32),
                       torch.tensor([e.num_turns for e in episodes], dtype=torch.int64),
                       torch.tensor([t for e in episodes for t in e.turns], dtype=torch.int64))
    rewards = torch.tensor([e.episode_return for e in episodes], dtype=torch.float32)
    group_ids = torch.tensor([e.prompt_index for e in episodes], dtype=torch.int64)
    return AdvantageInputs(rewards, group_ids, seq_ids, mask, turns=turns)


def _reference(episodes, estimator: str, eps: float = 1e-6) -> list[float]:
    """Per token, float64: turn t's return-to-go sum(r_t..) + final, against the returns of turn t of the episodes
    of the same prompt that reached turn t (GRPO: mean and unbiased std; Dr.GRPO: mean; RLOO: the others' mean);
    0 for a turn whose peers all have its return (a turn no other episode reached included)."""
    def ret(e, t):
        return sum(e.turn_rewards[t:]) + e.final_reward

    out = []
    for e in episodes:
        for t, generated in zip(e.turns, e.generated):
            peers = [ret(o, t) for o in episodes if o.prompt_index == e.prompt_index and o.num_turns > t]
            g, k = ret(e, t), len(peers)
            mean = sum(peers) / k
            if not generated or max(peers) == min(peers):
                out.append(0.0)
            elif estimator == "grpo":
                out.append((g - mean) / (math.sqrt(sum((p - mean) ** 2 for p in peers) / (k - 1)) + eps))
            elif estimator == "dr_grpo":
                out.append(g - mean)
            else:
                out.append(g - (sum(peers) - g) / (k - 1))
    return out


@settings(max_examples=60, deadline=None)
@given(shape=groups, estimator=st.sampled_from(ESTIMATORS))
def test_per_turn_advantages_equal_the_float64_reference(shape, estimator):
    episodes = _episodes(shape)
    x = _inputs(episodes)
    adv, returns = ADVANTAGES[estimator].fn(x, turn_advantage="turn")
    assert returns is None and adv.dtype == torch.float32 and adv.shape == x.mask.shape
    expected = torch.tensor(_reference(episodes, estimator), dtype=torch.float64)
    assert_close_report(adv.double(), expected, atol=1e-5, rtol=1e-5, what=estimator)
    assert not adv[~x.mask].any()   # observation tokens get none


@settings(max_examples=40, deadline=None)
@given(shape=groups, mask_bits=st.lists(st.booleans(), min_size=1, max_size=5))
def test_masked_tokens_get_zero_and_do_not_move_the_baselines(shape, mask_bits):
    """A masked token (an overlong-filtered episode's) gets 0; the turn's baseline still counts its episode, as the
    per-episode advantages count a filtered episode's reward."""
    episodes = _episodes(shape)
    full, masked = _inputs(episodes), _inputs(episodes, mask_bits)
    a = ADVANTAGES["grpo"].fn(full, turn_advantage="turn")[0]
    b = ADVANTAGES["grpo"].fn(masked, turn_advantage="turn")[0]
    assert_bitwise_equal(b, torch.where(masked.mask, a, torch.zeros_like(a)))


@settings(max_examples=40, deadline=None)
@given(rewards=st.lists(st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=5), min_size=1, max_size=3),
       estimator=st.sampled_from(ESTIMATORS))
def test_one_turn_episodes_get_their_per_episode_advantages_bit_for_bit(rewards, estimator):
    episodes = _episodes([[([(r, 2, 0)], 0.0) for r in group] for group in rewards])
    x = _inputs(episodes)
    assert_bitwise_equal(ADVANTAGES[estimator].fn(x, turn_advantage="turn")[0],
                         ADVANTAGES[estimator].fn(x, turn_advantage="episode")[0], what=estimator)


def test_turn_groups_and_expansion_by_hand():
    # group 0: episodes of 2 and 1 turns; group 1: one episode of 3 turns
    groups_of_turns = turn_groups(torch.tensor([0, 0, 1]), torch.tensor([2, 1, 3]))
    assert groups_of_turns.tolist() == [0, 1, 0, 2, 3, 4]
    values = torch.tensor([10.0, 11.0, 20.0, 30.0, 31.0, 32.0])
    out = expand_turns_to_tokens(values, torch.tensor([2, 1, 3]), torch.tensor([0, 0, 1, 0, 2, 1]),
                                 torch.tensor([0, 0, 0, 1, 2, 2]), torch.tensor([True, False, True, True, True, True]))
    assert out.tolist() == [10.0, 0.0, 11.0, 20.0, 32.0, 31.0]
    with pytest.raises(ValueError, match="outside its sequence's turns"):
        expand_turns_to_tokens(values, torch.tensor([2, 1, 3]), torch.tensor([2]), torch.tensor([0]),
                               torch.tensor([True]))


def test_turn_mode_needs_turns_and_no_kl_in_the_returns():
    x = _inputs(_episodes([[([(1.0, 1, 0)], 0.0), ([(0.0, 1, 0)], 0.0)]]))
    with pytest.raises(ValueError, match="needs the episodes' turns"):
        ADVANTAGES["grpo"].fn(AdvantageInputs(x.rewards, x.group_ids, x.seq_ids, x.mask), turn_advantage="turn")
    with pytest.raises(ValueError, match="KL penalty"):
        ADVANTAGES["rloo"].fn(AdvantageInputs(x.rewards, x.group_ids, x.seq_ids, x.mask, kl=torch.zeros(2),
                                              turns=x.turns), turn_advantage="turn")
