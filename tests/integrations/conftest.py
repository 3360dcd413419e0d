import pytest


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """Tiny random-init checkpoints per (family, dtype, tied embeddings)."""
    from rlalign.models.testing import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("hf_ckpt")
    out = {}
    for family, dtype, tied in (("qwen3", "float32", False), ("qwen2", "float32", True), ("llama", "float32", False),
                                ("qwen3", "bfloat16", True), ("llama", "bfloat16", False)):
        out[(family, dtype, tied)] = make_tiny_checkpoint(root / f"{family}-{dtype}-{int(tied)}", family=family,
                                                          dtype=dtype, norm_jitter=0.1, tie_word_embeddings=tied)
    return out
