"""scripts/multi_gpu_check.py rehearsed on the CPU (--smoke --gpus 2: gloo processes, tiny shapes): its training
stage, strict GRPO at parallel.tp=2 and tp=1 compared bitwise by the compare tool (with the 8B config's training
features: bf16, fp32 masters, the chunked optimizer step, activation checkpointing), its verdicts and its files; a
second invocation with the same arguments skips the finished runs; and how a rerun treats a run directory left by an
earlier one (finished: skipped; cut short after a checkpoint: resumed; otherwise started afresh). The other stages'
tools have their own tests (the TP degrees: test_gpu_script_smoke.py; the collectives:
tests/bench/test_collectives.py; `rlalign parity --tp`: test_parity_cli.py)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "multi_gpu_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("multi_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(out, work, *extra):
    return subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--gpus", "2", "--stages", "train", "--steps", "1",
                           "--layers", "2", "--out", str(out), "--work", str(work), *extra],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_multi_gpu_check_rehearsal(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = _check(out, work, "--keep-work")
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + (out / "log.txt").read_text()[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "metrics_tp2.jsonl", "summary.txt"]
    assert "done, 0 failed checks" in summary and "FAILED" not in summary
    assert "TP degrees 1,2" in summary and "NCCL_NVLS_ENABLE=0" in summary and "NVSHMEM_DISABLE_NVLS=1" in summary
    compare = summary.split("compare tp1 vs tp2")[1].splitlines()[1]
    assert "0 differences (bitwise identical" in compare, summary
    for run in ("run_tp1", "run_tp2"):
        line = next(l for l in summary.splitlines() if l.strip().startswith(f"{run}:"))
        assert "1 steps" in line and "mismatches 0 (steps with any: none)" in line, line
    metrics = [json.loads(l) for l in (out / "metrics_tp2.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [0, 1] and metrics[1]["mismatch/tokens"] > 0

    # the same command again: both runs finished, so nothing trains; the verdicts and the comparison are redone
    again = _check(out, work)
    summary = (out / "summary.txt").read_text()
    assert again.returncode == 0, summary
    assert summary.count("finished by an earlier invocation with the same arguments") == 2, summary
    assert "0 differences (bitwise identical" in summary.split("compare tp1 vs tp2")[1].splitlines()[1], summary
    assert not work.exists()   # every check passed: the work folder is removed


def test_a_rerun_skips_finished_runs_resumes_cut_ones_and_restarts_the_rest(tmp_path):
    check = _load_script()
    run_dir, argv = tmp_path / "run_tp2", ["configs/gpu-grpo-200.yaml", "run.steps=20", f"run.dir={tmp_path}/run_tp2"]
    assert check.plan_run(run_dir, argv) == "fresh"                   # never started
    check.record_run(run_dir, argv, done=False)
    assert check.plan_run(run_dir, argv) == "fresh"                   # started, cut before its first checkpoint
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest.json").write_text("{}")
    assert check.plan_run(run_dir, argv) == "resume"                  # cut short after a checkpoint
    assert check.plan_run(run_dir, [*argv[:1], "run.steps=30", argv[2]]) == "fresh"   # other arguments
    check.record_run(run_dir, argv, done=True)
    assert check.plan_run(run_dir, argv) == "done"


@pytest.mark.parametrize("gpus, degrees", [(2, [1, 2]), (4, [1, 2, 4]), (6, [1, 2]), (8, [1, 2, 4, 8])])
def test_the_tp_degrees_are_those_that_divide_the_gpus(gpus, degrees):
    assert _load_script().degrees_for(gpus) == degrees


def test_unknown_stages_are_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--stages", "tp,headline"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--stages 'tp,headline'" in proc.stderr and "Traceback" not in proc.stderr


def test_a_work_folder_of_the_users_is_refused_never_deleted(tmp_path):
    """--work naming a folder with other files is refused (--fresh and a passing run delete the work folder); a folder
    the script created is started over by --fresh."""
    script = _load_script()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    for fresh in (False, True):
        with pytest.raises(SystemExit, match="holds files this script did not write"):
            script.prepare_work(mine, fresh)
    assert (mine / "notes.txt").read_text() == "keep"
    work = tmp_path / "work"
    script.prepare_work(work, fresh=False)
    (work / "run_tp1").mkdir()
    script.prepare_work(work, fresh=True)
    assert [p.name for p in work.iterdir()] == [script.WORK_MARK]
