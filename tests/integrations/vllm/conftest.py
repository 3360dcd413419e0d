"""Fixtures of the vLLM tests (helpers in helpers.py)."""

import pytest

from tests.integrations.vllm.helpers import FAMILIES


@pytest.fixture(scope="session")
def vllm_checkpoints(tmp_path_factory):
    """Tiny random-init checkpoints per family; head_dim 32 (vLLM's CPU attention has no head size 16)."""
    from rlalign.models.testing import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("vllm_ckpt")
    for family in FAMILIES:
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                   mlp_only_layers=[1]) if family == "qwen3_moe" else {}
        make_tiny_checkpoint(root / family, family=family, head_dim=32, num_attention_heads=2, num_key_value_heads=1,
                             norm_jitter=0.1, tie_word_embeddings=family == "qwen2", **moe)
    return root
