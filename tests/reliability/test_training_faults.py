"""Fault cases on a real (tiny) training run, through the CLI in subprocesses: two trainings in one run
directory, SIGKILL + a torn metrics line + resume, and a disk that fills up mid-run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from rlalign.train.run.checkpoint_files import load_latest_checkpoint
from rlalign.train.run.metrics import read_metrics
from tests.train.conftest import tiny_overrides


def _train(args):
    return subprocess.Popen([sys.executable, "-m", "rlalign.cli.main", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def _wait_for(predicate, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"condition not reached (exit {proc.poll()}): {proc.stderr.read() if proc.poll() else ''}")


def test_second_training_is_refused_then_kill_torn_line_and_resume(arithmetic_model_dir, tmp_path):
    run = tmp_path / "run"
    first = _train(tiny_overrides(arithmetic_model_dir, run, steps=40))
    try:
        _wait_for(lambda: (run / "checkpoints" / "latest.json").exists(), first)
        second = _train(tiny_overrides(arithmetic_model_dir, run, steps=40) + ["run.overwrite=true"])
        assert second.wait(timeout=300) == 2
        err = second.stderr.read().strip()
        assert err.count("\n") == 0 and f"is in use by another training (pid {first.pid} on " in err, err
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "reward/me')          # what a kill mid-append leaves
    done = load_latest_checkpoint(run)["step"]
    resumed = _train(tiny_overrides(arithmetic_model_dir, run, steps=done + 1) + ["run.resume=true"])
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert "dropped a torn last line" in resumed.stderr.read()
    assert [r["step"] for r in read_metrics(run)] == list(range(done + 2))


def _mount_tmpfs(path, size):
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a small tmpfs")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")


def test_disk_full_mid_run_is_one_line_and_the_run_resumes(arithmetic_model_dir, tmp_path):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "420k")   # one checkpoint (~260 KB) fits, the second does not
    try:
        run = disk / "run"
        full = _train(tiny_overrides(arithmetic_model_dir, run, steps=2))
        assert full.wait(timeout=300) == 2
        err = full.stderr.read().strip().splitlines()
        assert err[-1].startswith("rlalign train: error: No space left on device: "), err[-5:]
        assert "the last checkpoint is intact" in err[-1]
        assert load_latest_checkpoint(run)["step"] == 1
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        resumed = _train(tiny_overrides(arithmetic_model_dir, run, steps=2) + ["run.resume=true"])
        assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
        assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]
        assert not [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")]
        assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 2
    finally:
        subprocess.run(["umount", str(disk)])
