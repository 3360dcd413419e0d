import pytest

import rlalign.integrations  # noqa: F401  (registers the transformers training side used by run_parity)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny random-init checkpoints: {"qwen3": dir, "qwen2": dir, "llama": dir, "qwen3-bf16": dir, "qwen3_moe": dir}."""
    from rlalign.models.testing import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("parity_ckpt")
    out = {f: make_tiny_checkpoint(root / f, family=f, norm_jitter=0.1, num_hidden_layers=3)
           for f in ("qwen3", "qwen2", "llama")}
    out["qwen3-bf16"] = make_tiny_checkpoint(root / "qwen3-bf16", family="qwen3", dtype="bfloat16", norm_jitter=0.1,
                                             num_hidden_layers=3)
    # Qwen3-MoE: layers 0 and 2 sparse (8 experts, top-2), layer 1 dense
    out["qwen3_moe"] = make_tiny_checkpoint(root / "qwen3_moe", family="qwen3_moe", norm_jitter=0.1, init_std=0.1,
                                            num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1])
    return out
