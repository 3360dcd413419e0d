"""CUDA: training in the portable profile gives the CPU's bits. The embedded default run (``rlalign train
run.profile=portable``, fp32) stopped after 2 steps on the CPU and on the GPU: the same metrics (every logged value
but timings and memory) and the same final weights, bit for bit (benchmarks/run_fingerprint.py). Skipped without
CUDA; ``python benchmarks/portable_check.py --train-steps 3`` is the same check with timings."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.portable_check import train_run

pytestmark = pytest.mark.cuda


def test_default_portable_run_has_the_same_bits_on_cpu_and_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cpu, _ = train_run(tmp_path / "cpu", "cpu", 2)
    cuda, _ = train_run(tmp_path / "cuda", "cuda", 2)
    if cpu != cuda:   # name the first differing logged value
        rows = {d: [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("cpu", "cuda")}
        for a, b in zip(rows["cpu"], rows["cuda"]):
            for key in sorted(set(a) | set(b)):
                if not key.startswith(("time/", "memory/", "tokens_per_s/")) and a.get(key) != b.get(key):
                    pytest.fail(f"step {a.get('step')}: {key} is {a.get(key)!r} on the CPU, {b.get(key)!r} on CUDA")
    assert cpu == cuda
