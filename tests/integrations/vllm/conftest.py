"""vLLM tests (marker ``vllm``): skipped cleanly unless the ``vllm`` extra is installed.

vLLM engines are process-wide (parallel state, model registry), so every test here runs vLLM in
child processes, one engine start-up per module where possible; this pytest process never imports vllm.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
VLLM_MARKS = [pytest.mark.vllm,
              pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'rlalign[vllm]')")]
FAMILIES = ("qwen3", "qwen2", "llama")


def vllm_env() -> dict:
    """Environment of a child that runs vLLM on CPU: 1 GiB of KV cache, no usage reporting."""
    env = dict(os.environ)
    env.pop("RLALIGN_VLLM", None)   # the plugin is off unless a child turns it on
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_child(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=vllm_env(), timeout=timeout)


def run_cli(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return run_child(["-m", "rlalign.cli.main", *args], timeout)


def tail(proc: subprocess.CompletedProcess, chars: int = 3000) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-chars:]}\nstderr:\n{proc.stderr[-chars:]}"


@pytest.fixture(scope="session")
def vllm_checkpoints(tmp_path_factory):
    """Tiny random-init checkpoints per family; head_dim 32 (vLLM's CPU attention has no head size 16)."""
    from rlalign.models.testing import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("vllm_ckpt")
    for family in FAMILIES:
        make_tiny_checkpoint(root / family, family=family, head_dim=32, num_attention_heads=2, num_key_value_heads=1,
                             norm_jitter=0.1, tie_word_embeddings=family == "qwen2")
    return root
