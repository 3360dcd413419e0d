"""The run directory's lifecycle (rlalign.train.run.directory) and its files (rlalign.train.run.checkpoint_files), without training."""

import errno
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from rlalign.train.run.directory import RunDirError, open_run_dir
from rlalign.models.atomic import atomic_write
from rlalign.train.run.checkpoint_files import CheckpointCorrupt, load_latest_checkpoint, save_checkpoint
from rlalign.train.run.metrics import MetricsCorrupt, MetricsWriter, read_metrics


def _state(step):
    return {"step": step, "model": {"w": torch.full((3,), float(step))}, "config": {"run": {"steps": 3}}}


def test_fresh_run_refuses_a_non_empty_dir_and_overwrite_removes_only_run_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="is not empty .*run.overwrite=true"):
        open_run_dir(run, resume=False, overwrite=False)
    assert (run / "metrics.jsonl").exists()
    open_run_dir(run, resume=False, overwrite=True).release()
    assert not (run / "metrics.jsonl").exists() and (run / "notes.txt").read_text() == "mine"


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        open_run_dir(tmp_path / "absent", resume=True, overwrite=False)
    assert not (tmp_path / "absent").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RunDirError, match="holds no checkpoint"):
        open_run_dir(tmp_path / "run", resume=True, overwrite=False)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_run_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match="is a file"):
        open_run_dir(tmp_path / "f", resume=False, overwrite=False)


def test_cleanup_deletes_only_checkpoints_this_run_wrote(tmp_path):
    """A stale step_000900.pt of someone else sorts after ours by name: it must survive, ours must too."""
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / "step_000900.pt").write_bytes(b"stale")
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _state(step), keep=2)
    names = sorted(p.name for p in ckpt.glob("step_*.pt"))
    assert names == ["step_000002.pt", "step_000003.pt", "step_000900.pt"]
    assert load_latest_checkpoint(tmp_path)["step"] == 3


def test_leftovers_of_a_killed_run_are_removed_at_start(tmp_path):
    """The checkpoint a save renamed into place but did not record is removed: pending.json proves (sha256)
    that the save wrote it. (A kill at each of these points: test_kill_points.py.)"""
    run = tmp_path / "run"
    save_checkpoint(run, 1, _state(1))
    (run / "checkpoints" / ".step_000002.pt.abc123.tmp").write_bytes(b"half")
    (run / "checkpoints" / "step_000002.pt").write_bytes(b"written, never recorded")
    (run / "checkpoints" / "pending.json").write_text(json.dumps(
        {"file": "step_000002.pt", "sha256": hashlib.sha256(b"written, never recorded").hexdigest()}))
    (run / ".metrics.jsonl.x.tmp").write_bytes(b"")
    (run / ".policy.tmp-q1w2").mkdir()
    handle = open_run_dir(run, resume=True, overwrite=False)
    handle.release()
    assert sorted(handle.removed) == sorted([".metrics.jsonl.x.tmp", ".policy.tmp-q1w2",
                                             "checkpoints/.step_000002.pt.abc123.tmp", "checkpoints/step_000002.pt"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest.json", "step_000001.pt"]


HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from rlalign.train.run.directory import open_run_dir
    handle = open_run_dir(Path(sys.argv[1]), resume=False, overwrite=False)   # kept: dropping it unlocks
    print("locked", flush=True)
    time.sleep(600)
""")


def test_second_training_in_the_same_dir_is_refused_and_a_dead_holder_frees_it(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=f"in use by another training \\(pid {holder.pid} on "):
            open_run_dir(run, resume=False, overwrite=True)
    finally:
        holder.kill()   # SIGKILL: the lock file stays, the lock does not
        holder.wait()
    assert (run / ".lock").exists()
    open_run_dir(run, resume=False, overwrite=False).release()


def test_files_keep_the_umask(tmp_path):
    from tests.train.conftest import make_arithmetic_checkpoint
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "a.json", b"{}")
        model_dir = make_arithmetic_checkpoint(tmp_path / "model")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640
    assert model_dir.stat().st_mode & 0o777 == 0o750
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in model_dir.iterdir()}
    assert set(modes.values()) == {"0o640"}, modes


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_a_save_needs_at_most_max_keep_2_checkpoint_files(tmp_path, monkeypatch, keep):
    """keep >= 2: the oldest file goes before the write (the newest recorded one stays); keep = 1: the old
    file stays until the new one is recorded (a kill mid-write must leave a checkpoint)."""
    from rlalign.train.run import checkpoint_files as runio
    real, during = runio._stream_state, []

    def counting(state, file):
        during.append(sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.pt")))
        return real(state, file)

    monkeypatch.setattr(runio, "_stream_state", counting)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, _state(step), keep=keep)
    assert max(len(names) + 1 for names in during) == max(keep, 2)
    assert all(f"step_{step - 1:06d}.pt" in names for step, names in enumerate(during[1:], start=2))
    assert len(list((tmp_path / "checkpoints").glob("step_*.pt"))) == keep
    assert load_latest_checkpoint(tmp_path)["step"] == 5


def test_disk_full_inside_the_streamed_save_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    """torch.save's C++ writer would turn the file's OSError into an unrelated RuntimeError: the sink keeps
    it and raises it after; the temp file is removed and the previous checkpoint still loads."""
    from rlalign.train.run import checkpoint_files as runio
    save_checkpoint(tmp_path, 1, _state(1), keep=1)
    real_stream = runio._stream_state
    monkeypatch.setattr(runio, "_stream_state", lambda state, file: real_stream(state, _Failing(file)))
    with pytest.raises(OSError, match=r"No space left on device: .*step_000002\.pt"):
        save_checkpoint(tmp_path, 2, {**_state(2), "model": {"w": torch.zeros(1 << 16)}}, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest.json", "step_000001.pt"]
    assert load_latest_checkpoint(tmp_path)["step"] == 1


class _Failing:
    """A file whose writes fail with ENOSPC after the first 4 KiB (a disk that fills mid-checkpoint)."""

    def __init__(self, file):
        self.file, self.written = file, 0

    def write(self, data):
        self.written += memoryview(data).nbytes
        if self.written > 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data)

    def flush(self):
        self.file.flush()


# ---- checkpoints: no code from disk ------------------------------------------------------------------

class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_checkpoint_with_matching_sha256_is_refused_without_running_code(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1))
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "checkpoints" / "step_000001.pt"
    torch.save({"step": 1, "model": {}, "payload": _RunsCode(marker)}, ckpt)
    import hashlib
    manifest = json.loads((tmp_path / "checkpoints" / "latest.json").read_text())
    manifest["sha256"] = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    (tmp_path / "checkpoints" / "latest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorrupt, match="refused without loading them"):
        load_latest_checkpoint(tmp_path)
    assert not marker.exists()


def test_manifest_naming_a_path_outside_checkpoints_is_refused(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1))
    manifest = json.loads((tmp_path / "checkpoints" / "latest.json").read_text())
    manifest["file"] = "../../etc/passwd"
    (tmp_path / "checkpoints" / "latest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorrupt, match="unreadable"):
        load_latest_checkpoint(tmp_path)


# ---- metrics.jsonl ------------------------------------------------------------------------------------

def test_torn_last_metrics_line_is_dropped_and_reported(tmp_path):
    w = MetricsWriter(tmp_path)
    for step in range(3):
        w.write({"step": step, "reward/mean": 0.5})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')          # killed (or out of disk) mid-append
    notes = []
    assert [r["step"] for r in read_metrics(tmp_path, notes)] == [0, 1, 2]
    assert len(notes) == 1 and "torn last line (4:" in notes[0]
    resumed = MetricsWriter(tmp_path, resume_after_step=1)
    assert "torn last line" in resumed.note
    resumed.write({"step": 2})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]


def test_corrupt_metrics_line_in_the_middle_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(MetricsCorrupt, match="metrics.jsonl:2 "):
        read_metrics(tmp_path)


def test_non_finite_metrics_are_written_as_null(tmp_path):
    w = MetricsWriter(tmp_path)
    w.write({"step": 1, "reward/mean": float("inf"), "x": float("nan")})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert read_metrics(tmp_path) == [{"step": 1, "reward/mean": None, "x": None}]


def test_disk_full_mid_append_leaves_a_resumable_file(tmp_path, monkeypatch):
    """ENOSPC after part of the line reached the file: the error propagates, the torn tail is dropped on resume."""
    w = MetricsWriter(tmp_path)
    w.write({"step": 0})

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[:7])
            self.f.flush()
            raise OSError(28, "No space left on device")

    import builtins
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda *a, **k: _Ctx(Full(real_open(*a, **k))))
    with pytest.raises(OSError, match="No space"):
        w.write({"step": 1, "reward/mean": 1.0})
    monkeypatch.setattr(builtins, "open", real_open)
    assert [r["step"] for r in MetricsWriter(tmp_path, resume_after_step=0) and read_metrics(tmp_path)] == [0]


class _Ctx:
    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        return self.inner

    def __exit__(self, *exc):
        self.inner.f.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["reward/mean", "loss/policy", "text"]),
                                st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
                                max_size=3), min_size=1, max_size=5), st.data())
def test_any_cut_of_the_last_line_drops_only_that_line(tmp_path_factory, records, data):
    """Whatever byte the last append stops at, the earlier records read back whole."""
    run = tmp_path_factory.mktemp("cut")
    w = MetricsWriter(run)
    for step, record in enumerate(records):
        w.write({"step": step, **record})
    raw = (run / "metrics.jsonl").read_bytes()
    last_start = raw.rstrip(b"\n").rfind(b"\n") + 1
    cut = data.draw(st.integers(last_start, len(raw)))
    (run / "metrics.jsonl").write_bytes(raw[:cut])
    notes = []
    got = [r["step"] for r in read_metrics(run, notes)]
    whole_last = cut >= len(raw) - 1   # only the newline missing: the line is complete JSON
    assert got == list(range(len(records) if whole_last else len(records) - 1))
    assert bool(notes) == (not whole_last and cut > last_start)
