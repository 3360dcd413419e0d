"""The rollout's bitwise test: every sampled token's logprob equals the trainer's packed-forward logprob,
and tokens + logprobs are identical across random engine configurations.

Configurations vary max_num_seqs, page size, token budget, prefill chunk, prefix sharing, prefix
caching, the KV cache size (down to one sequence's worth: forced preemption), the order in which
requests enter and which subset of the prompts is generated.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from rlalign.contract import use_profile
from rlalign.models.batch import ForwardBatch
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.rollout.block_manager import pages_for
from tests.bitwise import assert_bitwise_equal

MAX_NEW = 10
STOPS = tuple(range(40, 50))   # ~3% stop chance per token: some samples end early


def make_prompts(seed: int, count: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(1, 28))] for _ in range(count)]


def trainer_logprobs(model, completions, temperature: float) -> list[torch.Tensor]:
    """Per completion: logprobs of its tokens from ONE packed training forward of every prompt + completion."""
    seqs = [c.prompt_tokens + c.tokens for c in completions]
    targets = []
    for s in seqs:
        targets += s[1:] + [0]
    with use_profile("strict"), torch.no_grad():
        lp, _ = model.logprobs(ForwardBatch.packed(seqs, device=model.device),
                               torch.tensor(targets, device=model.device), temperature=temperature)
    lp = lp.cpu()
    out, offset = [], 0
    for c, s in zip(completions, seqs):
        first = offset + len(c.prompt_tokens) - 1
        out.append(lp[first:first + len(c.tokens)])
        offset += len(s)
    return out


def assert_matches_trainer(model, completions, temperature: float) -> None:
    ref = trainer_logprobs(model, completions, temperature)
    for c, r in zip(completions, ref):
        assert_bitwise_equal(torch.tensor(c.logprobs, dtype=torch.float32), r,
                             f"prompt {c.prompt_index} sample {c.sample_index}: engine vs trainer logprobs")


def assert_same_completions(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        where = f"prompt {w.prompt_index} sample {w.sample_index}"
        assert (g.prompt_index, g.sample_index) == (w.prompt_index, w.sample_index)
        assert g.tokens == w.tokens, f"{where}: tokens differ: {g.tokens} vs {w.tokens}"
        assert_bitwise_equal(torch.tensor(g.logprobs, dtype=torch.float32),
                             torch.tensor(w.logprobs, dtype=torch.float32), f"{where}: logprobs")
        assert g.finish_reason == w.finish_reason


def random_config(rng: random.Random, longest: int) -> RolloutConfig:
    page_size = rng.choice([1, 3, 8, 16, 64])
    minimal = pages_for(longest, page_size)
    return RolloutConfig(
        page_size=page_size, max_num_seqs=rng.randint(1, 20), max_num_batched_tokens=rng.choice([4, 13, 64, 512]),
        max_prefill_chunk=rng.choice([None, 3, 8, 17]), share_prefix=rng.random() < 0.5,
        enable_prefix_caching=rng.random() < 0.5,
        num_pages=rng.choice([minimal, minimal + 2, minimal + 6, 10 * minimal]))



def assert_random_engine_config_agrees(model, prompts, reference, sampling: SamplingParams, seed: int,
                                       **settings) -> None:
    """A seeded random engine configuration (:func:`random_config`, with ``settings`` on top) generates ``reference``
    bit for bit."""
    config = random_config(random.Random(seed), max(len(p) for p in prompts) + sampling.max_new_tokens)
    config = dataclasses.replace(config, **settings)
    assert_same_completions(RolloutEngine(model, config).generate(prompts, sampling), reference)

SAMPLINGS = {
    "t1": SamplingParams(n=3, temperature=1.0, max_new_tokens=MAX_NEW, seed=11, stop_token_ids=STOPS),
    "t07_topk_topp": SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=MAX_NEW, seed=5,
                                    stop_token_ids=STOPS),
    "greedy": SamplingParams(n=2, temperature=0.0, max_new_tokens=MAX_NEW, seed=0, stop_token_ids=STOPS),
}


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Completions from a default engine, per sampling setting."""
    out = {}
    for name, sampling in SAMPLINGS.items():
        engine = RolloutEngine(model, RolloutConfig(num_pages=256))
        out[name] = engine.generate(prompts, sampling)
    return out


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_engine_logprobs_equal_the_trainers(model, reference, name):
    completions = reference[name]
    assert_matches_trainer(model, completions, SAMPLINGS[name].logprob_temperature)
    assert {c.finish_reason for c in completions} <= {"stop", "length"}
    if name == "greedy":   # greedy samples of one prompt are identical
        assert all(a.tokens == b.tokens for a, b in zip(completions[::2], completions[1::2]))


@pytest.mark.parametrize("seed", range(10))
def test_tokens_and_logprobs_do_not_depend_on_the_engine_configuration(model, prompts, reference, seed):
    rng = random.Random(seed)
    name = list(SAMPLINGS)[seed % len(SAMPLINGS)]
    sampling = SAMPLINGS[name]
    chosen = sorted(rng.sample(range(len(prompts)), rng.randint(1, len(prompts))))
    rng.shuffle(chosen)                                     # request order and number of prompts vary
    config = random_config(rng, max(len(p) for p in prompts) + MAX_NEW)
    engine = RolloutEngine(model, config)
    got = engine.generate([prompts[i] for i in chosen], sampling, prompt_indices=chosen)
    want = [c for i in chosen for c in reference[name] if c.prompt_index == i]
    assert_same_completions(got, want)
    stats = engine.stats()
    assert stats["free_pages"] == stats["num_pages"]


def test_forced_preemption_and_streaming_requests_change_nothing(model, prompts, reference):
    """A cache of exactly one longest sequence, requests added while others run, a small token budget."""
    sampling = SAMPLINGS["t1"]
    longest = max(len(p) for p in prompts) + MAX_NEW
    engine = RolloutEngine(model, RolloutConfig(page_size=4, num_pages=pages_for(longest, 4), max_num_seqs=4,
                                                max_num_batched_tokens=12, max_prefill_chunk=6))
    done, pending = {}, list(range(len(prompts)))[::-1]
    while pending or engine.has_unfinished():
        if pending and engine.stats()["steps"] % 3 == 0:
            i = pending.pop()
            engine.add_request(prompts[i], sampling, prompt_index=i)
        for out in engine.step():
            if out.completion is not None:
                done[(out.prompt_index, out.sample_index)] = out.completion
    got = [done[(c.prompt_index, c.sample_index)] for c in reference["t1"]]
    assert_same_completions(got, reference["t1"])
    assert engine.scheduler.num_preemptions > 0
    assert any(c.num_preemptions for c in got)


def test_bfloat16_model_matches_the_trainer_across_configurations():
    model = tiny_model("llama", seed=4, init_std=0.1, dtype="bfloat16")
    prompts = make_prompts(1, count=4)
    sampling = SamplingParams(n=2, temperature=0.9, max_new_tokens=8, seed=2)
    first = RolloutEngine(model, RolloutConfig(num_pages=128)).generate(prompts, sampling)
    assert_matches_trainer(model, first, 0.9)
    config = RolloutConfig(page_size=2, num_pages=pages_for(48, 2), max_num_batched_tokens=5, share_prefix=False)
    second = RolloutEngine(model, config).generate(prompts, sampling)
    assert_same_completions(second, first)
