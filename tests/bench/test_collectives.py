"""benchmarks/collectives.py on gloo (--smoke): every row of a step's collectives runs for a group that is the whole job
and for one that is part of it (ranks 0..1 of 3), and every fixed result equals the local tree merge, on every
rank. Timings are recorded, never compared."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "collectives.py"


def test_collectives_bench_smoke_on_gloo(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--ranks", "2,3", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "collectives.json").read_text())
    assert doc["complete"] is True and doc["environment"]["backend"] == "gloo"
    rows = doc["rows"]
    for size in (2, 3):
        mine = [r for r in rows if r["ranks"] == size]
        merges = sorted((r["dtype"], r["tokens"]) for r in mine if r["kind"] == "tp_merge")
        assert merges == [(d, t) for d in ("bfloat16", "float32") for t in (1, 5)], size
        for kind in ("dp_all_reduce_fixed", "dp_reduce_scatter_fixed"):
            sizes = [r["elements"] for r in mine if r["kind"] == kind]   # whole chunks: cut to a multiple of the ranks
            assert sizes == [n - n % size for n in (1000, 4099)], (size, kind)
    for r in rows:
        assert r["fixed_equals_reference"] is True, r
        assert r["fixed"]["median_s"] > 0 and r["ratio"] > 0 and r["library_differs"] >= 0, r
