"""GRPO on CUDA for the model families beyond Llama / Qwen (gpt-oss, DeepSeek-V3, Qwen3-Next dense and MoE): two
strict steps of the arithmetic task on a tiny random-init model, zero rollout/trainer mismatches (and expert-choice
mismatches where the family routes), the family's own weights trained, its frozen ones bit-identical. The CPU twin
is tests/train/test_family_grpo.py. Skipped without CUDA."""

from __future__ import annotations

import pytest

from tests.train.test_family_grpo import FAMILIES, assert_family_trains

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grpo_on_cuda_has_zero_mismatches(triton_backend, family, tmp_path):
    assert_family_trains(family, tmp_path, "cuda")
