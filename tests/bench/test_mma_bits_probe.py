"""benchmarks/mma_bits_probe.py compiles what it claims to compare (sm_90a on the CPU, tests/sm90.py's stand-in driver):
the 64- and 128-row launches to wgmma, the 16- and 32-row ones to mma.sync, each product's full K in k16 steps."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "mma_bits_probe.py"


def test_probe_launches_compile_to_the_instructions_it_compares():
    proc = subprocess.run([sys.executable, str(PROBE), "--ptx"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "sm_90" in proc.stderr and "not supported" in proc.stderr:
        pytest.skip(f"this Triton cannot compile for sm_90a here: {proc.stderr[-400:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {(m[0], int(m[1]), int(m[2])): (int(m[3]), int(m[4]))
           for m in re.findall(r"(qk|pv) (\d+) rows / (\d+) warps: wgmma (\d+), mma.sync (\d+)", proc.stdout)}
    # qk: K = 128 -> 8 k16 steps (x 8 n8 tiles for mma.sync); pv: K = 64 -> 4 k16 steps (x 16 n8 tiles)
    assert got == {("qk", 64, 4): (8, 0), ("pv", 64, 4): (4, 0), ("qk", 128, 8): (8, 0), ("pv", 128, 8): (4, 0),
                   ("qk", 16, 1): (0, 64), ("pv", 16, 1): (0, 64), ("qk", 32, 2): (0, 64), ("pv", 32, 2): (0, 64)}, \
        proc.stdout


def test_probe_refuses_a_trial_count_below_one():
    proc = subprocess.run([sys.executable, str(PROBE), "--trials", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--trials must be >= 1, got 0" in proc.stderr
