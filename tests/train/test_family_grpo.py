"""Two GRPO steps on a tiny random-init checkpoint of each newer family on the CPU, strict: zero rollout/trainer
log-prob mismatches (and zero routing mismatches where the family routes), the family's own weights trained and its
frozen ones bit-identical.

- gpt-oss: sliding windows shorter than the sequences (prompt and completion ~20 characters), sinks, its MoE;
- DeepSeek-V3: MLA with a low-rank q, a dense layer then a routed + shared expert layer with group-limited sigmoid
  routing and a non-zero score-correction bias (fp32, never trained);
- Qwen3-Next: Gated-DeltaNet + gated attention; with sparse layers after both (routed experts and the
  sigmoid-gated shared expert, whose [1, hidden] gate must train)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlalign.configlib import load_config
from rlalign.models.checkpoint import save_model
from rlalign.models.testing import tiny_model
from rlalign.train.config import TrainConfig
from rlalign.train.loop import run_training
from rlalign.train.pretrain import VOCAB, write_char_tokenizer
from rlalign.train.run.metrics import read_metrics
from tests.train.conftest import tiny_overrides

# family: (tiny_model overrides, routes, tensors that must train, tensors that must keep their bits)
FAMILIES = {
    "gpt_oss": (dict(sliding_window=4), True, ("model.layers.0.self_attn.sinks",), ()),
    "deepseek_v3": ({}, True, ("model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.mlp.gate.weight",
                               "model.layers.1.mlp.shared_experts.down_proj.weight"),
                    ("model.layers.1.mlp.gate.e_score_correction_bias",)),
    "qwen3_next": ({}, False, tuple(f"model.layers.0.linear_attn.{n}" for n in
                                    ("A_log", "dt_bias", "conv1d.weight", "in_proj_qkvz.weight", "norm.weight")), ()),
    "qwen3_next_moe": ({}, True, tuple(f"model.layers.{i}.mlp.{n}" for i in (0, 1) for n in
                                       ("shared_expert_gate.weight", "gate.weight", "shared_expert.down_proj.weight",
                                        "experts.0.up_proj.weight")), ()),
}


def assert_family_trains(family: str, tmp_path, device: str = "cpu") -> None:
    """Two strict GRPO steps of the family's tiny checkpoint on ``device``: 0 log-prob (and routing) mismatches, the
    family's own weights trained, its frozen ones bit-identical."""
    overrides, routes, trained, frozen = FAMILIES[family]
    model = tiny_model(family, seed=0, init_std=0.1, vocab_size=len(VOCAB), pad_token_id=None, eos_token_id=None,
                       **overrides)
    model_dir = save_model(model, tmp_path / "model")
    write_char_tokenizer(model_dir)   # the arithmetic task's character tokenizer: the dense reward is often earned
    run_dir = tmp_path / "run"
    keys = tiny_overrides(model_dir, run_dir, steps=2, dense_reward=True) + [f"model.device={device}"]
    steps = [r for r in read_metrics(run_training(load_config(TrainConfig, None, keys))) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["mismatch/count"] == 0 and r["mismatch/tokens"] > 0 for r in steps)
    if routes:
        assert all(r["moe/routing_mismatch"] == 0 and r["moe/routing_tokens"] > 0 for r in steps)
    before = load_file(model_dir / "model.safetensors")
    after = load_file(next(run_dir.glob("**/policy/model.safetensors")))
    for name in trained:
        assert not torch.equal(before[name], after[name]), f"{name} did not train"
    for name in frozen:
        assert before[name].dtype == after[name].dtype == torch.float32 and before[name].abs().max() > 0
        assert torch.equal(before[name].view(torch.int32), after[name].view(torch.int32)), f"{name} changed"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grpo_has_zero_mismatches_and_trains_the_family_weights(family, tmp_path):
    assert_family_trains(family, tmp_path)
