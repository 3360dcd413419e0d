"""Kill a run with SIGKILL mid-way, resume it, and get the same bits as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import torch

from rlalign.train.run.checkpoint_files import load_latest_checkpoint
from rlalign.train.run.metrics import read_metrics
from tests.train.conftest import tiny_overrides

VOLATILE = ("time/", "tokens_per_s/", "memory/")


def _train(args, **kw):
    return subprocess.Popen([sys.executable, "-m", "rlalign.cli.main", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, **kw)


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def test_sigkill_then_resume_matches_uninterrupted_run(arithmetic_model_dir, tmp_path):
    steps = 5
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full = _train(tiny_overrides(arithmetic_model_dir, full_dir, steps, dense_reward=True))
    assert full.wait(timeout=600) == 0, full.stderr.read()

    cut = _train(tiny_overrides(arithmetic_model_dir, cut_dir, steps, dense_reward=True))
    metrics = cut_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and cut.poll() is None:
        if metrics.exists() and any(json.loads(l).get("step") == 2 for l in metrics.read_text().splitlines() if l):
            break
        time.sleep(0.05)
    assert cut.poll() is None, "the run ended before it could be killed; make it longer"
    os.kill(cut.pid, signal.SIGKILL)
    cut.wait()
    killed_at = load_latest_checkpoint(cut_dir)["step"]
    assert 1 <= killed_at < steps

    resumed = _train(tiny_overrides(arithmetic_model_dir, cut_dir, steps, dense_reward=True) + ["run.resume=true"])
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()

    assert _stable(read_metrics(cut_dir)) == _stable(read_metrics(full_dir))
    nonzero = sum(r["grad_norm"] > 0 for r in read_metrics(full_dir) if "grad_norm" in r)
    assert nonzero >= 3, f"only {nonzero} of {steps} steps updated the weights: the test would prove little"
    a, b = load_latest_checkpoint(full_dir), load_latest_checkpoint(cut_dir)
    assert a["step"] == b["step"] == steps
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for (ka, va), (kb, vb) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items()):
        for key in va:
            assert torch.equal(torch.as_tensor(va[key]), torch.as_tensor(vb[key])), (ka, key)


def test_corrupt_checkpoint_is_named(arithmetic_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    assert _train(tiny_overrides(arithmetic_model_dir, run_dir, 1)).wait(timeout=600) == 0
    ckpt = next((run_dir / "checkpoints").glob("step_*.pt"))
    ckpt.write_bytes(ckpt.read_bytes()[:-10] + b"0123456789")
    p = _train(tiny_overrides(arithmetic_model_dir, run_dir, 2) + ["run.resume=true"])
    assert p.wait(timeout=600) == 2
    err = p.stderr.read().strip().splitlines()[-1]
    assert "is corrupt (sha256 mismatch)" in err and ckpt.name in err
