import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Thousands of tiny GEMMs: one thread is much faster on a busy 2-core machine (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
