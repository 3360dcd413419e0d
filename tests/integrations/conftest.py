import pytest


# Qwen3-MoE: layer 0 sparse (8 experts, top-2, renormalised), layer 1 dense
FAMILY_OVERRIDES = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                      norm_topk_prob=True, mlp_only_layers=[1])}


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """Tiny random-init checkpoints per (family, dtype, tied embeddings)."""
    from rlalign.models.testing import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("hf_ckpt")
    out = {}
    for family, dtype, tied in (("qwen3", "float32", False), ("qwen2", "float32", True), ("llama", "float32", False),
                                ("qwen3", "bfloat16", True), ("llama", "bfloat16", False),
                                ("qwen3_moe", "float32", False), ("qwen3_moe", "bfloat16", True)):
        out[(family, dtype, tied)] = make_tiny_checkpoint(root / f"{family}-{dtype}-{int(tied)}", family=family,
                                                          dtype=dtype, norm_jitter=0.1, tie_word_embeddings=tied,
                                                          **FAMILY_OVERRIDES.get(family, {}))
    return out
