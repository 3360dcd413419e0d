"""MoE routing recorded by the rollout engine (RolloutConfig.record_routing, Completion.routing).

Every sample's record equals the routing of a direct packed forward of its prompt + completion (all rows
but the last sampled token's), bit for bit, across random engine configurations: page sizes, prefill
chunks, token budgets, prefix sharing (forked samples), prefix caching, forced preemption and padded
decode batches (the CUDA graphs' code path without capture). Dense models carry no record and refuse one.
"""

from __future__ import annotations

import random

import pytest
import torch

from rlalign.contract import use_profile
from rlalign.models.batch import ForwardBatch
from rlalign.models.moe import record_routing, sparse_layer_indices
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.rollout.block_manager import pages_for
from rlalign.rollout.errors import RolloutConfigError
from tests.bitwise import assert_bitwise_equal
from tests.rollout.test_engine_bitwise import MAX_NEW, SAMPLINGS, make_prompts, random_config

# sparse layers 0 and 2 (layer 1 is a dense MLP): the record's layer axis must skip it
MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           norm_topk_prob=True, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def moe_model():
    return tiny_model("qwen3_moe", seed=4, init_std=0.2, **MOE)


@pytest.fixture(scope="module")
def moe_prompts():
    # a shared first page between prompts 0 and 1 gives prefix-cache hits
    prompts = make_prompts(7)
    return [prompts[0], prompts[0][:9] + [5, 6, 7], *prompts[1:]]


def direct_routing(model, completion) -> torch.Tensor:
    """The expert ids [rows, sparse layers, k] of one direct forward of prompt + completion, last row dropped."""
    with use_profile("strict"), torch.no_grad(), record_routing(keep_logits=False) as record:
        model.forward_hidden(ForwardBatch.packed([completion.prompt_tokens + completion.tokens], device=model.device))
    return record.expert_ids()[:-1].cpu()


def assert_routing_is_the_forwards(model, completions) -> None:
    for c in completions:
        want = direct_routing(model, c)
        assert c.routing is not None and c.routing.dtype == torch.int16
        assert c.routing.shape == (len(c.prompt_tokens) + len(c.tokens) - 1, 2, 2), c.routing.shape
        assert_bitwise_equal(c.routing, want.to(torch.int16),
                             f"prompt {c.prompt_index} sample {c.sample_index}: engine vs direct-forward routing")


def test_sparse_layers_and_record_layout(moe_model):
    assert sparse_layer_indices(moe_model.config) == [0, 2]
    with torch.no_grad(), record_routing(keep_logits=False) as record:
        moe_model.forward_hidden(ForwardBatch.packed([[3, 4, 5], [6, 7]]))
    ids = record.expert_ids()
    assert record.layer_indices == [0, 2] and ids.shape == (5, 2, 2) and ids.dtype == torch.int16
    assert all(logits is None for forwards in record.layers.values() for logits, _ in forwards)
    with torch.no_grad(), record_routing() as full:
        moe_model.forward_hidden(ForwardBatch.packed([[3, 4, 5], [6, 7]]))
    assert torch.equal(full.expert_ids().to(torch.int16), ids)
    with record_routing() as empty:
        pass
    assert empty.expert_ids() is None


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_default_engine_records_every_fed_row(moe_model, moe_prompts, name):
    engine = RolloutEngine(moe_model, RolloutConfig(num_pages=256, record_routing=True))
    completions = engine.generate(moe_prompts, SAMPLINGS[name])
    assert_routing_is_the_forwards(moe_model, completions)


@pytest.mark.parametrize("seed", range(6))
def test_records_do_not_depend_on_the_engine_configuration(moe_model, moe_prompts, seed):
    """Chunked prefill, prefix caching / sharing, preemption and padded decode batches give the same records."""
    rng = random.Random(300 + seed)
    sampling = SAMPLINGS[list(SAMPLINGS)[seed % len(SAMPLINGS)]]
    config = random_config(rng, max(len(p) for p in moe_prompts) + MAX_NEW)
    config.record_routing = True
    if seed % 2:
        config.decode_graphs = "padded"
        config.decode_graph_max_batch = rng.choice([3, 8, 64])   # 3: larger decode steps run eagerly
    engine = RolloutEngine(moe_model, config)
    completions = engine.generate(moe_prompts, sampling)
    assert_routing_is_the_forwards(moe_model, completions)
    if seed % 2:
        assert engine.counters["graph_steps"] > 0


def test_preemption_prefix_hits_and_forks_carry_the_routing(moe_model, moe_prompts):
    """The smallest cache (one sequence's pages: preemptions), prefix caching and shared prompts at once."""
    longest = max(len(p) for p in moe_prompts) + MAX_NEW
    config = RolloutConfig(page_size=4, num_pages=pages_for(longest, 4), max_prefill_chunk=3, share_prefix=True,
                           enable_prefix_caching=True, record_routing=True, decode_graphs="padded")
    engine = RolloutEngine(moe_model, config)
    completions = engine.generate(moe_prompts, SAMPLINGS["t1"])
    assert engine.stats()["preemptions"] > 0 and engine.stats()["prefix_cache_hit_pages"] > 0
    assert_routing_is_the_forwards(moe_model, completions)


def test_an_aborted_sample_carries_the_rows_computed_so_far(moe_model):
    engine = RolloutEngine(moe_model, RolloutConfig(num_pages=64, page_size=4, max_prefill_chunk=3,
                                                    record_routing=True))
    engine.add_request([5, 6, 7, 8, 9, 10, 11], SamplingParams(max_new_tokens=8), request_id="r")
    engine.step()
    engine.step()   # 6 of the 7 prompt rows computed (chunks of 3), nothing sampled yet
    (out,) = engine.abort("r")
    routing = out.completion.routing
    assert out.completion.tokens == [] and routing.shape == (6, 2, 2)
    with torch.no_grad(), record_routing(keep_logits=False) as record:
        moe_model.forward_hidden(ForwardBatch.packed([[5, 6, 7, 8, 9, 10]]))
    assert_bitwise_equal(routing, record.expert_ids(), "aborted sample's routing")


def test_dense_models_carry_no_record_and_refuse_one():
    dense = tiny_model("qwen3", seed=0)
    engine = RolloutEngine(dense, RolloutConfig(num_pages=16))
    assert engine.routing is None
    (completion,) = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=2))
    assert completion.routing is None
    with pytest.raises(RolloutConfigError, match="record_routing=True needs a mixture-of-experts model"):
        RolloutEngine(dense, RolloutConfig(num_pages=16, record_routing=True))


def test_moe_engine_records_only_when_asked(moe_model):
    engine = RolloutEngine(moe_model, RolloutConfig(num_pages=16))
    assert engine.routing is None
    assert engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=2))[0].routing is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_cuda_graph_replays_record_the_replayed_steps_routing():
    """Captured decode graphs: the expert ids are static outputs of the graph, refreshed by every replay."""
    model = tiny_model("qwen3_moe", seed=4, init_std=0.2, dtype="bfloat16", device="cuda", **MOE)
    prompts, sampling = make_prompts(9, count=12), SamplingParams(n=3, max_new_tokens=12, seed=2)
    engine = RolloutEngine(model, RolloutConfig(num_pages=512, decode_graphs="on", decode_graph_max_batch=48,
                                                record_routing=True))
    got = engine.generate(prompts, sampling)
    assert engine.counters["graph_steps"] > 0
    assert_routing_is_the_forwards(model, got)
    eager = RolloutEngine(model, RolloutConfig(num_pages=512, decode_graphs="off", record_routing=True))
    for g, e in zip(got, eager.generate(prompts, sampling)):
        assert_bitwise_equal(g.routing, e.routing, f"prompt {g.prompt_index} sample {g.sample_index}: graphs vs eager")
