"""DeepSeek-V3 through the rollout engine: the engine's log-probs are the trainer's packed forward's, bit for bit, and
tokens and log-probs do not depend on the engine's configuration (page size, chunked prefill, batch composition,
prefix sharing, the cached form: the compressed latent or the expanded K and zero-padded V) -- fp32 and bf16, MLA with
and without a low-rank q, interleaved and plain rope, a dense layer then routed + shared experts with group-limited routing; the
routing the engine records is the trainer's."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign.contract import use_profile
from rlalign.models import ForwardBatch
from rlalign.models.moe import record_routing
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tests.rollout.test_engine_bitwise import (assert_matches_trainer, assert_random_engine_config_agrees, make_prompts,
                                               random_config)

SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3)
VARIANTS = {"qlora-interleaved-fp32": ("float32", dict()),
            "q_proj-plain-rope-4groups-bf16": ("bfloat16", dict(q_lora_rank=None, rope_interleave=False, n_group=4,
                                                                topk_group=2, num_experts_per_tok=3))}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request):
    dtype, overrides = VARIANTS[request.param]
    return tiny_model("deepseek_v3", seed=1, init_std=0.2, dtype=dtype, **overrides)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(7, count=4)


@pytest.fixture(scope="module")
def reference(model, prompts):
    return RolloutEngine(model, RolloutConfig(num_pages=256, record_routing=True)).generate(prompts, SAMPLING)


def test_engine_logprobs_and_routing_equal_the_trainers(model, reference):
    assert_matches_trainer(model, reference, SAMPLING.logprob_temperature)
    seqs = [c.prompt_tokens + c.tokens for c in reference]
    with use_profile("strict"), torch.no_grad(), record_routing(keep_logits=False) as record:
        model.forward_hidden(ForwardBatch.packed(seqs))
    trainer = record.expert_ids()
    start = 0
    for c, s in zip(reference, seqs):
        # the engine records the experts of every token it ran (the last sampled token is never run)
        assert torch.equal(c.routing.to(trainer.dtype), trainer[start:start + len(s) - 1]), c.prompt_index
        start += len(s)


@pytest.mark.parametrize("seed", range(3))
def test_completions_do_not_depend_on_the_engine_configuration(model, prompts, reference, seed):
    assert_random_engine_config_agrees(model, prompts, reference, SAMPLING, seed)


@pytest.mark.parametrize("seed,settings", [(10, dict(mla_cache="expanded")), (11, dict(mla_cache="expanded")),
                                           (12, dict(decode_graphs="padded", overlap="on"))])
def test_the_cache_form_and_the_static_decode_batches_change_nothing(model, prompts, reference, seed, settings):
    """The reference ran with the default latent cache; random configurations with the expanded cache, or with the
    latent one under the decode graphs' padded static batches (eagerly) and overlapped steps, agree."""
    assert_random_engine_config_agrees(model, prompts, reference, SAMPLING, seed, **settings)


@settings(max_examples=6, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_random_shapes_and_engines_match_the_trainer(data, seed):
    """Random MLA / routing shapes (odd V heads, q_proj or the low-rank q, plain or interleaved rope, dense-only or
    sparse layers), random prompt lengths and engine configurations: the engine's log-probs are the trainer's. K head
    widths (nope + rope) 4 to 24, 6 and 10 among them (without grouped queries, as MLA has none, the strict CPU
    attention's library GEMM is not row invariant there on some machines: the op routes it, tests/ops)."""
    nope, rope = 2 * data.draw(st.integers(1, 8)), data.draw(st.sampled_from([2, 4, 8]))
    n_group, size = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 3))
    topk_group = data.draw(st.integers(1, n_group))
    layers = data.draw(st.integers(1, 3))
    model = tiny_model("deepseek_v3", seed=seed, init_std=0.2, num_hidden_layers=layers,
                       first_k_dense_replace=data.draw(st.integers(0, layers)),
                       q_lora_rank=data.draw(st.sampled_from([None, 8])), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                       head_dim=rope, v_head_dim=data.draw(st.integers(1, nope + rope)),
                       rope_interleave=data.draw(st.booleans()), n_routed_experts=n_group * size, n_group=n_group,
                       topk_group=topk_group, num_experts_per_tok=data.draw(st.integers(1, topk_group * size)))
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 70))] for _ in range(rng.randint(1, 4))]
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=seed)
    config = random_config(rng, max(len(p) for p in prompts) + sampling.max_new_tokens)
    got = RolloutEngine(model, config).generate(prompts, sampling)
    assert_matches_trainer(model, got, sampling.logprob_temperature)
