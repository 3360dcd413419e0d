"""benchmarks/offload_step_memory.py runs end to end on a tiny model and reports both paths (no memory asserted)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_offload_step_memory_bench_reports_every_path():
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "offload_step_memory.py"), "--tensors", "2",
                          "--mib", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["rise_mib"]) == {"all_at_once", "per_parameter", "chunked"}
    assert all(isinstance(v, (int, float)) and v >= 0 for v in result["rise_mib"].values()), result
    assert result["tensors"] == 2 and result["mib_per_tensor_fp32"] == 2
