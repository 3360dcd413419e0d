"""Rollouts under data parallelism (rlalign/train/dp_rollout.py): each of 2 gloo ranks generates its share of the
prompts and every rank ends with exactly the completions one engine generating all of them returns -- tokens,
log-prob bits, finish flags, MoE routing records -- in the same order. Includes a rank with no prompt at all."""

import pytest
import torch

from rlalign.distributed.launch import Group, spawn
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.train.dp_rollout import generate_sharded
from rlalign.train.samples import StepSamples
from tests.rollout.test_engine_bitwise import make_prompts

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
SAMPLING = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=6, seed=11)


def _engine(family: str) -> RolloutEngine:
    extra = MOE if family == "qwen3_moe" else {}
    model = tiny_model(family, seed=4, init_std=0.2, num_hidden_layers=3, **extra)
    return RolloutEngine(model, RolloutConfig(num_pages=256, record_routing=family == "qwen3_moe"))


def _plain(samples: StepSamples) -> list[tuple]:
    """Per sample, every field as exact data: log-probs by their fp32 bits, routing ids as nested lists with their
    dtype."""
    seqs = samples.tokens.split(samples.sequence_lens.tolist())
    lps = samples.logprobs.split(samples.completion_lens.tolist())
    routing = (samples.routing.split(samples.routing_rows.tolist()) if samples.routing is not None
               else [None] * len(samples))
    return [(int(i), seq[:p].tolist(), seq[p:].tolist(), lp.view(torch.int32).tolist(), bool(t),
             None if r is None else (str(r.dtype), r.tolist()))
            for i, seq, p, lp, t, r in zip(samples.prompt_index, seqs, samples.prompt_lens.tolist(), lps,
                                           samples.truncated, routing)]


def _sharded(world: Group, family: str, n_prompts: int) -> list[tuple]:
    torch.manual_seed(world.rank)   # nothing may depend on a rank's own random state
    return _plain(generate_sharded(_engine(family), make_prompts(5)[:n_prompts], SAMPLING, world))


@pytest.mark.parametrize("family, n_prompts", [("qwen3", 5), ("qwen3", 1), ("qwen3_moe", 4)])
def test_two_ranks_end_with_the_completions_of_one_engine(family, n_prompts):
    prompts = make_prompts(5)[:n_prompts]
    whole = _plain(StepSamples.of_completions(_engine(family).generate(prompts, SAMPLING)))
    assert len(whole) == n_prompts * SAMPLING.n
    if family == "qwen3_moe":
        assert all(routing is not None for *_, routing in whole)
    per_rank = spawn(_sharded, 2, family, n_prompts)
    for rank, got in enumerate(per_rank):
        for i, (a, b) in enumerate(zip(got, whole)):
            assert a == b, f"rank {rank}, completion {i}: {a} != {b}"
        assert len(got) == len(whole)
