"""GRPO on a tiny random-init Qwen3-Next checkpoint (Gated-DeltaNet + gated attention) on the CPU, strict: zero
rollout/trainer log-prob mismatches over two steps, and the linear-attention layer's weights get trained."""

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


def test_grpo_on_qwen3_next_has_zero_mismatches(tmp_path):
    model = tiny_model("qwen3_next", seed=0, init_std=0.1, vocab_size=len(VOCAB), pad_token_id=None,
                       eos_token_id=None)
    model_dir = save_model(model, tmp_path / "model")
    write_char_tokenizer(model_dir)   # the arithmetic task's character tokenizer: the dense reward is often earned
    run_dir = tmp_path / "run"
    cfg = load_config(TrainConfig, None, tiny_overrides(model_dir, run_dir, steps=2, dense_reward=True))
    records = read_metrics(run_training(cfg))
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["mismatch/count"] == 0 and r["mismatch/tokens"] > 0 for r in steps)
    before = load_file(model_dir / "model.safetensors")
    after = load_file(next(run_dir.glob("**/policy/model.safetensors")))
    for name in ("A_log", "dt_bias", "conv1d.weight", "in_proj_qkvz.weight", "norm.weight"):
        key = f"model.layers.0.linear_attn.{name}"
        assert not torch.equal(before[key], after[key]), key
