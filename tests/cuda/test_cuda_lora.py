"""CUDA: LoRA adapters in the rollout engine on the Triton backend, decode graphs captured with the adapters'
GEMMs inside: every sampled token's log-prob has the bits of the trainer's packed forward."""

from __future__ import annotations

import pytest
import torch

from rlalign.models.lora import TARGETS
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tests.models.test_lora import adapted
from tests.rollout.test_engine_bitwise import assert_matches_trainer, make_prompts

pytestmark = pytest.mark.cuda   # skipped without CUDA (tests/conftest.py)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_engine_with_adapters_equals_trainer_on_cuda(family, dtype):
    targets = TARGETS if family != "qwen3_moe" else ("q_proj", "k_proj", "v_proj", "o_proj")
    model = adapted(family, rank=1 if family == "llama" else 8, targets=targets, dtype=dtype, device="cuda").eval()
    engine = RolloutEngine(model, RolloutConfig(page_size=16, max_num_seqs=8, decode_graphs="on"))
    completions = engine.generate(make_prompts(5, count=6), SamplingParams(n=2, temperature=1.0, max_new_tokens=12,
                                                                           seed=9))
    assert engine.counters["graph_steps"] > 0
    assert_matches_trainer(model, completions, temperature=1.0)
