"""Partial rollouts: a weight update with samples in flight (``plan_weight_update`` inside generate(), and
``update_weights(in_flight="recompute")`` between step() calls). Every token's logprob equals a trainer forward
under the weights of the version that sampled it, over its whole prefix, bit for bit; where a sample is cut depends
on its own tokens only, never on the engine's configuration."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutEngine, RolloutError, SamplingParams
from tests.bitwise import assert_bitwise_equal
from tests.rollout.test_engine_bitwise import STOPS, assert_same_completions, random_config, trainer_logprobs

PROMPTS = [[5, 9, 33, 7, 81], [100, 3], [17] * 11, [250]]
MAX_NEW = 9


@pytest.fixture(scope="module")
def old():
    return tiny_model("qwen3", seed=3, init_std=0.1)


@pytest.fixture(scope="module")
def new():
    return tiny_model("qwen3", seed=4, init_std=0.1)


def assert_each_token_is_its_versions(completions, models: dict, temperature: float = 1.0) -> None:
    """Each token's logprob is, bit for bit, a packed trainer forward under ``models[its version]``."""
    ref = {v: trainer_logprobs(m, completions, temperature) for v, m in models.items()}
    for i, c in enumerate(completions):
        versions = c.versions()
        want = torch.stack([ref[v][i][j] for j, v in enumerate(versions)]) if versions else torch.zeros(0)
        assert_bitwise_equal(torch.tensor(c.logprobs, dtype=torch.float32), want,
                             f"prompt {c.prompt_index} sample {c.sample_index} (versions {versions})")


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), after=st.integers(1, MAX_NEW))
def test_a_planned_update_cuts_every_sample_at_its_own_token_count(old, new, seed, after):
    """Random engine configurations (preemption, chunked prefill, prefix sharing and caching) and cut points: the
    first ``after`` tokens of each sample by version 0, the rest by version 5, each token's logprob the trainer's
    under its version; the same bits under every configuration; and an update to the same weights changes nothing
    but the recorded versions (the recompute of the K/V is the decode's, bit for bit)."""
    sampling = SamplingParams(n=2, max_new_tokens=MAX_NEW, seed=seed, stop_token_ids=STOPS)
    config = random_config(random.Random(seed), max(map(len, PROMPTS)) + MAX_NEW)
    runs = []
    for cfg in (config, random_config(random.Random(seed + 1), max(map(len, PROMPTS)) + MAX_NEW)):
        engine = RolloutEngine(tiny_model("qwen3", seed=3, init_std=0.1), cfg)
        fetched = []
        engine.plan_weight_update(after, lambda: fetched.append(1) or (new.state_dict(), 5))
        runs.append(engine.generate(PROMPTS, sampling))
        assert fetched == [1] and engine.weights_version == 5
    got = runs[0]
    assert_same_completions(runs[1], got)
    for c in got:
        assert c.weights_version == 0
        assert c.versions() == [0] * min(after, len(c.tokens)) + [5] * (len(c.tokens) - after)
        assert (c.token_versions is None) == (len(c.tokens) <= after)
    assert_each_token_is_its_versions(got, {0: old, 5: new})
    same = RolloutEngine(tiny_model("qwen3", seed=3, init_std=0.1), config)
    same.plan_weight_update(after, lambda: (old.state_dict(), 1))
    assert_same_completions(same.generate(PROMPTS, sampling), RolloutEngine(old, config).generate(PROMPTS, sampling))


def test_a_planned_update_lands_at_the_end_when_every_sample_ends_first(old, new):
    engine = RolloutEngine(tiny_model("qwen3", seed=3, init_std=0.1), random_config(random.Random(0), 40))
    engine.plan_weight_update(MAX_NEW + 1, lambda: (new.state_dict(), 2))
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, seed=1))
    assert engine.weights_version == 2 and all(c.versions() == [0] * len(c.tokens) for c in out)
    assert_each_token_is_its_versions(engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=1)), {2: new})
    with pytest.raises(RolloutError, match="after_tokens"):
        engine.plan_weight_update(0, lambda: (new.state_dict(), 3))


def test_a_failed_fetch_aborts_the_generation_and_leaves_the_engine_idle(old):
    engine = RolloutEngine(tiny_model("qwen3", seed=3, init_std=0.1), random_config(random.Random(1), 40))

    def fetch():
        raise KeyboardInterrupt

    engine.plan_weight_update(2, fetch)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert not engine.has_unfinished() and engine.weights_version == 0 and not engine.scheduler.parked
    assert_same_completions(engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=2)),
                            RolloutEngine(old, random_config(random.Random(1), 40)).generate(
                                PROMPTS, SamplingParams(max_new_tokens=3, seed=2)))


def test_update_weights_recompute_between_steps(old, new):
    """The step() API: ``update_weights(in_flight="recompute")`` after some steps (a step possibly still in flight);
    the samples continue under the new weights and every token is its version's."""
    engine = RolloutEngine(tiny_model("qwen3", seed=3, init_std=0.1), random_config(random.Random(2), 40))
    sampling = SamplingParams(n=2, max_new_tokens=MAX_NEW, seed=4, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, sampling, prompt_index=i)
    done, streamed = [], 0
    for _ in range(4):
        streamed += len(engine.step())
    assert engine.update_weights(new.state_dict(), version=1, in_flight="recompute") == 1
    while engine.has_unfinished():
        outs = engine.step()
        streamed += len(outs)
        done += [o.completion for o in outs if o.completion is not None]
    assert streamed == len(PROMPTS) * 2 * MAX_NEW and len(done) == len(PROMPTS) * 2
    assert any(c.token_versions is not None and 0 in c.token_versions and 1 in c.token_versions for c in done)
    assert_each_token_is_its_versions(done, {0: old, 1: new})
