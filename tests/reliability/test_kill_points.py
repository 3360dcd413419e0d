"""SIGKILL at chosen points of the run directory's writes (a subprocess kills itself there): the next
start finds the last complete checkpoint, readable metrics and no leftovers."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rlalign.train.run.directory import open_run_dir
from rlalign.train.run.checkpoint_files import load_latest_checkpoint
from rlalign.train.run.metrics import read_metrics

WRITER = textwrap.dedent('''
    import builtins, os, signal, sys
    from pathlib import Path
    import torch
    from rlalign.train.run import checkpoint_files as runio
    from rlalign.train.run.metrics import MetricsWriter

    run, point = Path(sys.argv[1]), sys.argv[2]
    state = lambda step: {"step": step, "model": {"w": torch.full((4,), float(step))}}
    runio.save_checkpoint(run, 1, state(1), keep=1)
    metrics = MetricsWriter(run)
    metrics.write({"step": 1})
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    real_replace, real_unlink, real_open = os.replace, Path.unlink, builtins.open

    def replace(src, dst):
        if (point == "checkpoint_written" and str(dst).endswith("step_000002.pt")) or \\
                (point == "pending_recorded" and str(dst).endswith("pending.json")) or \\
                (point == "checkpoint_renamed" and str(dst).endswith("latest.json")):
            die()
        real_replace(src, dst)

    def unlink(self, missing_ok=False):
        if point == "manifest_renamed" and self.name == "step_000001.pt":
            die()
        real_unlink(self, missing_ok=missing_ok)

    class Torn:
        def __init__(self, f): self.f = f
        def __enter__(self): return self
        def __exit__(self, *exc): self.f.close()
        def write(self, text):
            self.f.write(text[: len(text) // 2]); self.f.flush(); die()

    def open_(file, mode="r", *args, **kw):
        f = real_open(file, mode, *args, **kw)
        return Torn(f) if point == "metrics_mid_line" and str(file).endswith("metrics.jsonl") and "a" in mode else f

    os.replace, Path.unlink, builtins.open = replace, unlink, open_
    if point == "metrics_mid_line":
        metrics.write({"step": 2, "reward/mean": 0.25})
    else:
        runio.save_checkpoint(run, 2, state(2), keep=1)
    print("not killed")
''')

# pending_recorded: killed while noting (pending.json) the checkpoint about to be renamed into place
EXPECTED_STEP = {"checkpoint_written": 1, "pending_recorded": 1, "checkpoint_renamed": 1, "manifest_renamed": 2,
                 "metrics_mid_line": 1}


@pytest.mark.parametrize("point", sorted(EXPECTED_STEP))
def test_sigkill_at_each_write_point_leaves_a_resumable_run(tmp_path, point):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", WRITER, str(run), point], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == -signal.SIGKILL, (proc.stdout, proc.stderr)
    handle = open_run_dir(run, resume=True, overwrite=False)
    handle.release()
    state = load_latest_checkpoint(run)
    assert state["step"] == EXPECTED_STEP[point]
    assert float(state["model"]["w"][0]) == EXPECTED_STEP[point]
    notes = []
    assert [r["step"] for r in read_metrics(run, notes)] == [1]
    assert bool(notes) == (point == "metrics_mid_line")
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert all(not name.endswith(".tmp") for name in left), left
    if point == "manifest_renamed":   # killed before the old file was deleted: the next save deletes it
        assert "step_000001.pt" in left
        from rlalign.train.run.checkpoint_files import save_checkpoint
        save_checkpoint(run, 3, {"step": 3, "model": {}}, keep=1)
        assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000003.pt"]
    else:
        assert [n for n in left if n.startswith("step_")] == [f"step_{EXPECTED_STEP[point]:06d}.pt"]
