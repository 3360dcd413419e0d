"""scripts/gpu_multi.sh rehearsed on the CPU (SMOKE=1, GPUS=2: gloo processes, tiny shapes): its training stage,
strict GRPO at parallel.tp=2 and tp=1 compared bitwise by the compare tool (with the 8B config's training features:
bf16, fp32 masters, the chunked optimizer step, activation checkpointing), its verdicts and its files. The other
stages' tools have their own tests (the TP degrees: test_gpu_script_smoke.py; the collectives:
tests/bench/test_collectives.py; `rlalign parity --tp`: test_parity_cli.py); the whole script with every stage
(PART=all) was rehearsed by hand (docs/distributed.md)."""

import json
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_multi.sh"


def test_gpu_multi_script_rehearsal(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(out), ROOT=str(tmp_path), GPUS="2", SMOKE="1", PART="all",
               TP_S="0", COLL_S="0", PARITY_S="0", TRAIN8B_S="0", TRAIN_STEPS="1", LAYERS="2", DEADLINE="500")
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + (out / "log.txt").read_text()[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["log.txt", "metrics_tp2.jsonl", "summary.txt"]
    assert all((out / f).is_file() for f in files) and len(files) <= 8   # the device returns 8 files
    assert "done, 0 failed checks" in summary and "FAILED" not in summary
    assert "TP degrees 1,2" in summary and "NCCL_NVLS_ENABLE=0" in summary
    compare = summary.split("compare tp1 vs tp2")[1].splitlines()[1]
    assert "0 differences (bitwise identical" in compare, summary
    for run in ("run_tp1", "run_tp2"):
        line = next(l for l in summary.splitlines() if l.strip().startswith(f"{run}:"))
        assert "1 steps" in line and "mismatches 0 (steps with any: none)" in line, line
    metrics = [json.loads(l) for l in (out / "metrics_tp2.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [0, 1] and metrics[1]["mismatch/tokens"] > 0
    assert not list(tmp_path.glob("rlalign-multi-*"))   # its work folder is removed
