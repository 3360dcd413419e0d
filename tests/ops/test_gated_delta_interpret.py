"""The Triton gated-delta kernels (Gated-DeltaNet on CUDA) under the CPU interpreter, fp32: packed == alone ==
prefill cut anywhere == decode, bit for bit; the forward within 2e-5 and every gradient within 1e-4 of the float64
recurrent rule; the backward bitwise the same run to run (tests/ops/gated_delta_worker.py, in a subprocess); and
both kernels compile for sm_90a (the tiny shape here; ``python -m tests.ops.gated_delta_worker --sm90 128 128``
compiles Qwen3-Next's heads too, minutes of ptxas). The model through the three paths on the GPU, fp32 and
bf16, and a GRPO step: tests/cuda/test_cuda_qwen3_next.py."""

from __future__ import annotations

import re

import pytest
import torch

from tests.ops.test_triton_interpret import SMEM_LIMIT
from tests.workers import run_worker

WORKER = ["-m", "tests.ops.gated_delta_worker"]


def test_gated_delta_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    results = run_worker(WORKER + ["--interpret", "2"], interpret=True, timeout=900)
    assert results["hypothesis_cases"] == 2 and results["comparisons"] >= 15, results
    assert set(results["gradient_errors"]) == {"q", "k", "v", "g", "beta", "state"}


def test_gated_delta_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: tests/cuda/test_cuda_qwen3_next.py runs the kernels")
    kernels = run_worker(WORKER + ["--sm90"], interpret=False, timeout=900)["kernels"]
    assert sorted({k["kernel"] for k in kernels}) == ["delta_bwd_kernel", "delta_fwd_kernel"]
    for k in kernels:
        assert k["smem"] <= SMEM_LIMIT, (k["kernel"], k["smem"])
        if k["ptxas"] is not None:
            assert re.search(r"Used \d+ registers", k["ptxas"]), k["ptxas"]
