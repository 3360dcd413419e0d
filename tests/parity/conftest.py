import pytest

import rlalign.integrations  # noqa: F401  (registers the transformers training side used by run_parity)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny random-init checkpoints: {"qwen3": dir, "qwen2": dir, "llama": dir, "qwen3-bf16": dir}."""
    from rlalign.models.testing import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("parity_ckpt")
    out = {f: make_tiny_checkpoint(root / f, family=f, norm_jitter=0.1, num_hidden_layers=3)
           for f in ("qwen3", "qwen2", "llama")}
    out["qwen3-bf16"] = make_tiny_checkpoint(root / "qwen3-bf16", family="qwen3", dtype="bfloat16", norm_jitter=0.1,
                                             num_hidden_layers=3)
    return out
