"""Qwen3-Next (Gated-DeltaNet + gated attention) through the rollout engine: the engine's log-probs are the
trainer's packed forward's, bit for bit, and tokens and log-probs do not depend on the engine's configuration --
page sizes that split the 64-token chunks or hold several of them, chunked prefill ending inside and on chunk
boundaries, prefix sharing of samples (copy-on-write of the linear-attention stores), the prefix cache and
preemption (a KV budget of the minimum). Prompts of 1, C-1, C and C+6 tokens; completions cross the boundaries.
Sparse layers (fp32 and bf16): the routing the engine records is the trainer's too."""

from __future__ import annotations

import random

import pytest
import torch

from rlalign.contract import spec, use_profile
from rlalign.models import ForwardBatch
from rlalign.models.moe import record_routing
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.rollout.block_manager import pages_for
from tests.rollout.test_engine_bitwise import assert_matches_trainer, assert_same_completions

C = spec.GDN_CHUNK
SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_next", seed=1, init_std=0.2)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (1, C - 1, C, C + 6)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return RolloutEngine(model, RolloutConfig(num_pages=256)).generate(prompts, SAMPLING)


def test_engine_logprobs_equal_the_trainers(model, reference):
    assert_matches_trainer(model, reference, SAMPLING.logprob_temperature)
    assert max(len(c.prompt_tokens) + len(c.tokens) for c in reference) > C


@pytest.mark.parametrize("page_size, chunk, share, prefix_cache, spare", [
    (3, 17, True, True, 0), (128, 8, False, True, 2), (16, None, True, False, 6)])
def test_completions_do_not_depend_on_the_engine_configuration(model, prompts, reference, page_size, chunk, share,
                                                               prefix_cache, spare):
    longest = max(len(p) for p in prompts) + SAMPLING.max_new_tokens
    config = RolloutConfig(page_size=page_size, max_num_seqs=5, max_num_batched_tokens=64, max_prefill_chunk=chunk,
                           share_prefix=share, enable_prefix_caching=prefix_cache,
                           num_pages=pages_for(longest, page_size) + spare)
    got = RolloutEngine(model, config).generate(prompts, SAMPLING)
    assert_same_completions(got, reference)


# ---- sparse layers (routed experts + the gated shared expert) ----------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sparse_engine_logprobs_and_routing_equal_the_trainers(prompts, dtype):
    """The engine's log-probs and the routing it records are the trainer's packed forward's, bit for bit, and do not
    depend on the engine's configuration (small pages, chunked prefill ending inside a chunk, no sharing)."""
    model = tiny_model("qwen3_next_moe", seed=2, init_std=0.2, dtype=dtype, mlp_only_layers=[1])
    reference = RolloutEngine(model, RolloutConfig(num_pages=256, record_routing=True)).generate(prompts, SAMPLING)
    assert_matches_trainer(model, reference, SAMPLING.logprob_temperature)
    seqs = [c.prompt_tokens + c.tokens for c in reference]
    with use_profile("strict"), torch.no_grad(), record_routing(keep_logits=False) as record:
        model.forward_hidden(ForwardBatch.packed(seqs))
    trainer, start = record.expert_ids(), 0
    assert record.layer_indices == [0] and trainer.shape[1:] == (1, 2)
    for c, s in zip(reference, seqs):
        # the engine records the experts of every token it ran (the last sampled token is never run)
        assert torch.equal(c.routing.to(trainer.dtype), trainer[start:start + len(s) - 1]), c.prompt_index
        start += len(s)
    longest = max(len(p) for p in prompts) + SAMPLING.max_new_tokens
    config = RolloutConfig(page_size=5, max_num_seqs=3, max_num_batched_tokens=48, max_prefill_chunk=23,
                           share_prefix=False, num_pages=pages_for(longest, 5) * 3, record_routing=True)
    got = RolloutEngine(model, config).generate(prompts, SAMPLING)
    assert_same_completions(got, reference)
    for a, b in zip(got, reference):
        assert torch.equal(a.routing, b.routing), a.prompt_index
