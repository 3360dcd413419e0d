"""scripts/gpu_tp.py --smoke: the lead's 2-GPU script, run on CPU + gloo with a tiny Qwen3 shape."""

import json
import os
import subprocess
import sys
from pathlib import Path

# the CLI in a subprocess: one OpenMP thread, like the spawned ranks (and fast on a busy 2-core machine)
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_tp.py"


def test_gpu_tp_script_smoke(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_tp.json").read_text())
    errors = {k: v["error"] for k, v in doc.items() if isinstance(v, dict) and "error" in v}
    assert not errors
    assert doc["tp2_equals_tp1_bitwise"] is True
    assert doc["tp1_vs_unsharded"]["lp"]["differ"] == 0 and doc["tp1_vs_unsharded"]["ent"]["differ"] == 0
    for key in ("time_tp2_strict", "time_tp2_native", "time_tp1_strict", "time_tp1_native"):
        assert doc[key]["median_s"] > 0
    assert doc["tp2_strict_over_native"] > 0
