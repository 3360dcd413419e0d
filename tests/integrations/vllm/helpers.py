"""Helpers of the vLLM tests (marker ``vllm``): skipped cleanly unless the ``vllm`` extra is installed.

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
FAMILIES = ("qwen3", "qwen2", "llama", "qwen3_moe")


def vllm_env() -> dict:
    """Environment of a child that runs vLLM on CPU: 1 GiB of KV cache, no usage reporting, one torch thread
    (as the suite's own fixture: on a busy 2-core machine a second OpenMP thread mostly waits)."""
    env = dict(os.environ)
    env.pop("RLALIGN_VLLM", None)   # the plugin is off unless a child turns it on
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_child(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=vllm_env(), timeout=timeout)


def run_cli(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return run_child(["-m", "rlalign.cli.main", *args], timeout)


def tail(proc: subprocess.CompletedProcess, chars: int = 3000) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-chars:]}\nstderr:\n{proc.stderr[-chars:]}"
