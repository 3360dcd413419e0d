"""The Triton sampler split per row into fixed vocabulary chunks (a chunk kernel on a (rows, chunks) grid, then a
fold kernel per row): under the interpreter its tokens and flags equal the one-chunk-per-row walk for every input and
its tokens / errors the torch backend's (tests/ops/sample_chunks_worker.py, in a subprocess: ~30 s on one core), and
both kernels compile for sm_90a with no spills. The CUDA tier compares it with the torch backend at 244 x 151,936
(tests/cuda/test_cuda_sample.py)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.workers import run_worker

WORKER = ["-m", "tests.ops.sample_chunks_worker"]


def test_chunked_sampler_under_the_interpreter():
    pytest.importorskip("triton")
    results = run_worker(WORKER + ["--interpret", "10"], interpret=True, timeout=900)
    assert results["fixed_cases"] >= 15


def test_chunked_sampler_compiles_for_sm90_without_spills():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: tests/cuda/test_cuda_sample.py runs the kernels")
    kernels = run_worker(WORKER + ["--sm90"], interpret=False, timeout=600)["kernels"]
    by_name = {}
    for k in kernels:
        by_name.setdefault(k["kernel"], []).append(k)
    assert sorted(by_name) == ["sample_chunk_kernel", "sample_fold_kernel"], sorted(by_name)
    assert [k["grid"] for k in by_name["sample_chunk_kernel"]] == [[244, 10]] * 2   # 151,936 / 16,384 -> 10 chunks
    assert {k["args"]["HAS_KEEP"] for k in kernels} == {"True", "False"}
    if any(k["ptxas"] is None for k in kernels):
        pytest.skip("Triton's ptxas could not be run here")
    for k in kernels:
        lines = k["ptxas"].splitlines()
        spills = [ln for ln in lines if re.search(r"[1-9]\d* bytes (spill|stack)", ln)]
        assert not spills, f"{k['kernel']} {k['args']}: {spills}"
        assert re.search(r"Used \d+ registers", k["ptxas"]), k["ptxas"]
