"""Multi-turn episodes on the rollout engine: every model-generated token's log-prob equals the trainer's packed
forward of the whole episode (raw bits), the trainer sees exactly the ids the engine sampled and the env inserted,
the episodes do not depend on the engine's settings (page size, prefix caching, KV cache size down to preemption,
chunking), and a turn does not prefill again what the previous one left in the cache."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlalign import ops
from rlalign.contract import use_profile
from rlalign.envs import Env, EpisodeLimits, StepResult, run_episodes
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.rollout.block_manager import pages_for
from rlalign.train.multiturn import episode_samples
from rlalign.train.packing import TrainBatch
from tests.bitwise import assert_bitwise_equal

STOPS = tuple(range(40, 56))   # ~5% stop chance per token: turns of every length


class ScriptedEnv(Env):
    """Ends after ``turns`` turns; otherwise answers with ``obs_len`` ids that depend on the turn's tokens (the
    episode goes on from what the model said). Records what it saw and inserted."""

    def __init__(self, turns: int, obs_lens: list[int]):
        self.turns, self.obs_lens, self.seen, self.inserted = turns, obs_lens, [], []

    def step(self, turn):
        self.seen.append(list(turn.token_ids))
        if turn.index + 1 >= self.turns:
            return StepResult(None, 1.0, True)
        digest = hashlib.blake2b(bytes(str(turn.token_ids), "ascii"), digest_size=32).digest()
        obs = [3 + b for b in digest[:self.obs_lens[turn.index % len(self.obs_lens)]]]
        self.inserted.append(obs)
        return StepResult(obs, 0.25 * turn.index, False)

    def final_reward(self):
        return 0.5


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=3, init_std=0.1)


def play(model, config, prompts, plans, sampling, limits):
    envs = iter([ScriptedEnv(*plan) for plan in plans])
    made = []

    def factory():
        made.append(next(envs))
        return made[-1]

    engine = RolloutEngine(model, config)
    with use_profile("strict"):
        episodes = run_episodes(engine, None, prompts, [None] * len(prompts), factory, sampling, limits)
    return episodes, made, engine


def check_against_trainer(model, episodes, temperature, max_tokens):
    batch = TrainBatch.build(episode_samples(episodes), max_tokens=max_tokens)
    with use_profile("strict"):
        lp, _ = batch.score(model, temperature=ops.logprob_temperature(temperature))
    assert int(batch.generated.sum()) == sum(e.generated.count(True) for e in episodes)
    assert_bitwise_equal(lp[batch.generated], batch.rollout_logprobs[batch.generated],
                         "engine vs trainer log-probs on the generated tokens")
    assert torch.equal(batch.mask, batch.generated)   # observation tokens are out of the loss


def check_tokens_are_the_engines(episodes, envs):
    for ep, env in zip(episodes, envs):
        tokens, generated = [], []
        for i, turn in enumerate(env.seen):
            tokens += turn
            generated += [True] * len(turn)
            if i + 1 < len(env.seen):   # an observation is inserted only before another turn
                tokens += env.inserted[i]
                generated += [False] * len(env.inserted[i])
        assert (ep.tokens, ep.generated) == (tokens, generated)
        assert len(ep.logprobs) == len(ep.tokens)
        assert ep.episode_return == sum(0.25 * i for i in range(ep.num_turns - 1)) + (
            1.0 if ep.finish_reason == "done" else 0.25 * (ep.num_turns - 1)) + 0.5


def assert_same_episodes(got, want):
    for g, w in zip(got, want, strict=True):
        assert (g.tokens, g.generated, g.finish_reason, g.turn_rewards) == (w.tokens, w.generated, w.finish_reason,
                                                                           w.turn_rewards)
        assert_bitwise_equal(torch.tensor(g.logprobs), torch.tensor(w.logprobs), "episode log-probs across configs")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_episodes_match_the_trainer_and_do_not_depend_on_the_engine(model, data):
    rng = random.Random(data.draw(st.integers(0, 2**16), label="seed"))
    n = data.draw(st.integers(1, 3), label="n")
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 20))] for _ in range(data.draw(st.integers(1, 3)))]
    plans = [(data.draw(st.integers(1, 4)), data.draw(st.lists(st.integers(0, 12), min_size=1, max_size=3)))
             for _ in range(len(prompts) * n)]
    limits = EpisodeLimits(data.draw(st.integers(1, 4), label="max_turns"),
                           data.draw(st.integers(1, 60), label="max_episode_tokens"),
                           data.draw(st.integers(1, 8), label="max_turn_tokens"))
    temperature = data.draw(st.sampled_from([1.0, 0.7, 0.0]), label="temperature")
    sampling = SamplingParams(n=n, temperature=temperature, seed=rng.randrange(2**31), stop_token_ids=STOPS)
    page_size = data.draw(st.sampled_from([1, 3, 8, 16]), label="page_size")
    longest = pages_for(max(map(len, prompts)) + limits.max_episode_tokens, page_size)
    config = RolloutConfig(page_size=page_size, max_num_seqs=data.draw(st.integers(1, 8)),
                           max_num_batched_tokens=data.draw(st.sampled_from([8, 13, 64, 512])),
                           max_prefill_chunk=data.draw(st.sampled_from([None, 3, 8])),
                           enable_prefix_caching=data.draw(st.booleans(), label="prefix_caching"),
                           num_pages=data.draw(st.sampled_from([longest, longest + 2, 10 * longest]), label="pages"))
    episodes, envs, engine = play(model, config, prompts, plans, sampling, limits)
    check_tokens_are_the_engines(episodes, envs)
    check_against_trainer(model, episodes, temperature, data.draw(st.sampled_from([16, 64, 4096])))
    reference, _, _ = play(model, RolloutConfig(page_size=16, enable_prefix_caching=False), prompts, plans, sampling,
                           limits)
    assert_same_episodes(episodes, reference)


def fed_at_most(episodes_turns, page_size):
    """The forward tokens a run may take when each turn reuses the full pages its previous turn computed: per
    turn, the context not in those pages plus one decode token per sampled token but the last."""
    total = 0
    for turns in episodes_turns:   # [(context length, sampled tokens)] per turn
        previous = None
        for context, sampled in turns:
            cached = 0 if previous is None else page_size * ((previous - 1) // page_size)
            total += context - cached + sampled - 1
            previous = context + sampled
    return total


def turn_shapes(episode, env):
    """[(context length, sampled tokens)] of each turn of ``episode``, from what its env saw and inserted."""
    shapes, context = [], len(episode.prompt_tokens)
    for i, turn in enumerate(env.seen):
        shapes.append((context, len(turn)))
        context += len(turn) + (len(env.inserted[i]) if i + 1 < len(env.seen) else 0)
    return shapes


@pytest.mark.parametrize("page_size", [3, 16])
def test_a_turn_prefills_only_what_the_cache_does_not_hold(model, page_size):
    prompts = [[5 + i + 7 * k for i in range(11 + k)] for k in range(3)]
    plans = [(4, [5, 0, 9])] * 6
    sampling = SamplingParams(n=2, temperature=1.0, seed=7)
    limits = EpisodeLimits(4, 80, 12)
    pages = 2 * pages_for(6 * 110, page_size)
    episodes, envs, engine = play(model, RolloutConfig(page_size=page_size, num_pages=pages), prompts, plans,
                                  sampling, limits)
    assert engine.scheduler.num_preemptions == 0 and all(e.num_turns == 4 for e in episodes)
    fed = engine.counters["forward_tokens"]
    assert fed <= fed_at_most([turn_shapes(e, env) for e, env in zip(episodes, envs)], page_size)
    assert engine.stats()["prefix_cache_hit_pages"] > 0
    no_cache, _, plain = play(model, RolloutConfig(page_size=page_size, num_pages=pages, enable_prefix_caching=False),
                              prompts, plans, sampling, limits)
    assert_same_episodes(episodes, no_cache)
    assert plain.counters["forward_tokens"] > fed   # without the cache every turn prefills its whole context


def test_preempted_mid_episode_still_bitwise(model):
    prompts = [[9 + i for i in range(14)], [200 + i for i in range(9)]]
    plans = [(4, [6, 3])] * 6
    sampling = SamplingParams(n=3, temperature=1.0, seed=3)
    limits = EpisodeLimits(4, 48, 8)
    episodes, envs, engine = play(model, RolloutConfig(page_size=4, num_pages=pages_for(14 + 48, 4), max_num_seqs=6),
                                  prompts, plans, sampling, limits)
    assert engine.scheduler.num_preemptions > 0
    check_tokens_are_the_engines(episodes, envs)
    check_against_trainer(model, episodes, 1.0, 4096)


def test_moe_episodes_carry_the_routing_of_every_row(tmp_path):
    """A mixture-of-experts policy: the episode's routing record (the last turn's, prefix-cache hits included) lines
    up with the trainer's packed forward of the whole episode and picks the same experts on every row."""
    from rlalign.models.moe import record_routing, sparse_layer_indices
    from rlalign.train.agreement import Agreement

    moe = tiny_model("qwen3_moe", seed=4, init_std=0.2, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
    prompts = [[5 + i for i in range(13)], [40, 41, 42]]
    episodes, _, _ = play(moe, RolloutConfig(page_size=4, num_pages=256, record_routing=True), prompts,
                          [(3, [4, 7])] * 4, SamplingParams(n=2, seed=9), EpisodeLimits(3, 40, 6))
    samples = episode_samples(episodes)
    assert samples.has_routing and samples.routing_rows.tolist() == (samples.sequence_lens - 1).tolist()
    batch = TrainBatch.build(samples, max_tokens=4096)
    with use_profile("strict"), record_routing(keep_logits=False) as routing:
        lp, _ = batch.score(moe, temperature=1.0)
    assert_bitwise_equal(lp[batch.generated], batch.rollout_logprobs[batch.generated], "MoE episodes")
    agreement = Agreement("strict", "stop", sparse_layer_indices(moe.config))
    record = agreement.check_routing(1, routing.expert_ids(), samples)
    assert record["moe/routing_mismatch"] == 0 and record["moe/routing_tokens"] > 0
