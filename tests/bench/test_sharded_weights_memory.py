"""benchmarks/sharded_weights_memory.py runs end to end (2 gloo processes, a tiny model, parallel.shard=params) and
reports what a rank holds: its half of the weights between steps, more during the step (no resident set asserted)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sharded_weights_memory_bench_reports_a_ranks_share():
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sharded_weights_memory.py"), "--dp", "2",
                          "--layers", "2", "--hidden", "64", "--vocab", "512", "--tokens", "8", "--modes", "params",
                          "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    r = result["per_rank_max"]["params"]
    whole = 2 * result["parameters"]   # bf16
    assert r["weights_between_steps"] == -(-result["parameters"] // 2) * 2
    assert r["weights_between_steps"] < r["weights_peak"] < whole + r["weights_between_steps"]
    assert r["rss_peak"] > 0 and r["state_bytes"] > 0
