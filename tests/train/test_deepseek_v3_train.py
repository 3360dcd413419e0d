"""GRPO on a tiny random-init DeepSeek-V3 checkpoint (MLA with a low-rank q, a dense layer then a routed + shared
expert layer with group-limited sigmoid routing and a non-zero score-correction bias) on the CPU, strict: zero
rollout/trainer log-prob mismatches and zero routing mismatches over two steps; the weights train, the bias does
not (it stays fp32 and bit-identical)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from rlalign.configlib import load_config
from rlalign.models.checkpoint import save_model
from rlalign.models.testing import tiny_model
from rlalign.train.pretrain import VOCAB, write_char_tokenizer
from rlalign.train.config import TrainConfig
from rlalign.train.loop import run_training
from rlalign.train.run.metrics import read_metrics
from tests.train.conftest import tiny_overrides

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def test_grpo_on_deepseek_v3_has_zero_mismatches(tmp_path):
    model = tiny_model("deepseek_v3", seed=0, init_std=0.1, vocab_size=len(VOCAB), pad_token_id=None,
                       eos_token_id=None)
    model_dir = save_model(model, tmp_path / "model")
    write_char_tokenizer(model_dir)   # the arithmetic task's character tokenizer: the dense reward is often earned
    run_dir = tmp_path / "run"
    cfg = load_config(TrainConfig, None, tiny_overrides(model_dir, run_dir, steps=2, dense_reward=True))
    records = read_metrics(run_training(cfg))
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["mismatch/count"] == 0 and r["mismatch/tokens"] > 0 for r in steps)
    assert all(r["moe/routing_mismatch"] == 0 and r["moe/routing_tokens"] > 0 for r in steps)
    before = load_file(model_dir / "model.safetensors")
    after = load_file(next(run_dir.glob("**/policy/model.safetensors")))
    assert before[BIAS].dtype == after[BIAS].dtype == torch.float32 and before[BIAS].abs().max() > 0
    assert torch.equal(before[BIAS].view(torch.int32), after[BIAS].view(torch.int32))
    for name in ("model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.shared_experts.down_proj.weight"):
        assert not torch.equal(before[name], after[name]), name
