"""benchmarks/gemm_census.py on CUDA: the census of the strict step, every distinct launch timed (ours and cuBLAS) through
the entry the trainer called, with the replay checked to launch the census's kernel and config."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gemm_census", ROOT / "benchmarks" / "gemm_census.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("tokens", [200, 1100])   # the K partition's split (M <= 256) and its one-kernel tree
def test_tiny_census_times_every_row(triton_backend, tokens, tmp_path, capsys):
    code = _bench().main(["--quick", "--device", "cuda", "--tokens", str(tokens), "--budget-s", "600",
                          "--out", str(tmp_path)])
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "gemm_census.json").read_text())
    assert code == 0, out[-4000:]
    rows = result["rows"]
    assert sum(r["count"] for r in rows) == result["launches"] == 2 * 7 * 3 + 4
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["ours_ms"] > 0 and r["cublas_ms"] > 0 and r["ratio"] > 0
        assert r["ms_lost"] == pytest.approx(r["count"] * (r["ours_ms"] - r["cublas_ms"]))
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert result["step_gemm_ms"] == pytest.approx(sum(r["total_ms"] for r in rows))
    lost = [r["ms_lost"] for r in rows]
    assert lost == sorted(lost, reverse=True)
    assert "ms lost" in out
