"""CUDA: partial rollouts (a weight update with samples in flight, their K/V recomputed under the new weights), with
CUDA-graph decode on and off, bf16 and fp32: every token's logprob equals a packed trainer forward under the weights
of the version that sampled it, bit for bit. The CPU twin is tests/rollout/test_partial_rollouts.py. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tests.rollout.test_partial_rollouts import PROMPTS, assert_each_token_is_its_versions

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("after", [1, 4])
def test_each_token_is_its_versions_on_cuda(graphs, dtype, after):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    old = tiny_model("qwen3", seed=3, init_std=0.1, dtype=dtype, device="cuda")
    new = tiny_model("qwen3", seed=4, init_std=0.1, dtype=dtype, device="cuda")
    engine = RolloutEngine(tiny_model("qwen3", seed=3, init_std=0.1, dtype=dtype, device="cuda"),
                           RolloutConfig(num_pages=128, decode_graphs=graphs, decode_graph_max_batch=16))
    engine.plan_weight_update(after, lambda: (new.state_dict(), 1))
    got = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=9, seed=7))
    assert engine.weights_version == 1
    assert any(len(set(c.versions())) == 2 for c in got), "no sample spans the update"
    assert_each_token_is_its_versions(got, {0: old, 1: new})
