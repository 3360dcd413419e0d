"""GRPO on CUDA for the model families beyond Llama / Qwen (gpt-oss, DeepSeek-V3, Qwen3-Next dense and MoE): two
strict steps of the arithmetic task on a tiny random-init model, zero rollout/trainer mismatches (and expert-choice
mismatches where the family routes), the family's own weights trained. The CPU twin is
tests/train/test_family_grpo.py. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlalign.models.testing import tiny_model

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_next_moe", "gpt_oss", "deepseek_v3"])
def test_grpo_on_cuda_has_zero_mismatches(triton_backend, family, tmp_path):
    from rlalign.configlib import load_config
    from rlalign.models.checkpoint import save_model
    from rlalign.train.config import TrainConfig
    from rlalign.train.loop import run_training
    from rlalign.train.pretrain import VOCAB as CHARS, write_char_tokenizer
    from rlalign.train.run.metrics import read_metrics
    from tests.train.conftest import tiny_overrides
    from tests.train.test_family_grpo import FAMILIES

    keys, routes, trained, _ = FAMILIES[family]
    model = tiny_model(family, seed=0, init_std=0.1, vocab_size=len(CHARS), pad_token_id=None, eos_token_id=None,
                       **keys)
    model_dir = save_model(model, tmp_path / "model")
    write_char_tokenizer(model_dir)
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(model_dir, run_dir, steps=2, dense_reward=True) + ["model.device=cuda"]
    steps = [r for r in read_metrics(run_training(load_config(TrainConfig, None, overrides))) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["mismatch/count"] == 0 and r["mismatch/tokens"] > 0 for r in steps)
    if routes:
        assert all(r["moe/routing_mismatch"] == 0 and r["moe/routing_tokens"] > 0 for r in steps)
    before = load_file(model_dir / "model.safetensors")
    after = load_file(next(run_dir.glob("**/policy/model.safetensors")))
    for name in trained:
        assert not torch.equal(before[name], after[name]), f"{name} did not train"
