"""A checkpoint save streams to disk and a load maps the file: neither builds a copy of the checkpoint in
memory (the 8B run's state is 92 GiB of a 128 GiB host). Measured two ways: the rise of the process's
peak resident set in a subprocess (every allocation, torch's included) and tracemalloc (Python buffers such as a
BytesIO), each checked to see the in-memory copy the old code made."""

import io
import json
import os
import subprocess
import sys
import textwrap
import tracemalloc

import pytest
import torch

from rlalign.train.run.checkpoint_files import load_latest_checkpoint, save_checkpoint

MIB = 1 << 20

PEAK_RSS = textwrap.dedent('''
    import io, json, sys
    from pathlib import Path
    import torch
    from rlalign.train.run import checkpoint_files as runio
    from rlalign.models.atomic import atomic_write

    def rss(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    def growth(action):
        """How far the resident set rose above its size before ``action`` (Linux: VmHWM reset first)."""
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = rss("VmRSS:")
        kept = action()
        return rss("VmHWM:") - before, kept

    run, in_memory = Path(sys.argv[1]), sys.argv[2] == "bytesio"
    runio.save_checkpoint(run, 1, {"step": 1, "model": {"w": torch.ones(4)}})   # code paths warmed up
    runio.load_latest_checkpoint(run)
    state = {"step": 2, "model": {f"w{i}": torch.randn(1 << 20) for i in range(32)}}   # 128 MiB

    def bytesio_save():   # the pre-2026-12-01 save: the instrument must see its copy
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write(run / "x.pt", buf.getvalue())

    save, _ = growth(bytesio_save if in_memory else lambda: runio.save_checkpoint(run, 2, state))
    load, loaded = growth(lambda: runio.load_latest_checkpoint(run))
    print(json.dumps({"state": 128 << 20, "save": save, "load": load}))
''')


def _peaks(run, mode):
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, str(run), mode], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_save_and_load_add_far_less_than_the_checkpoint_to_peak_memory(tmp_path):
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    streamed = _peaks(tmp_path / "a", "stream")
    assert streamed["save"] < streamed["state"] / 8, streamed
    assert streamed["load"] < streamed["state"] / 8, streamed
    in_memory = _peaks(tmp_path / "b", "bytesio")
    assert in_memory["save"] >= in_memory["state"] * 3 // 4, f"the measurement misses a BytesIO copy: {in_memory}"


def test_save_and_load_make_no_python_buffer_of_the_checkpoint(tmp_path):
    state = {"step": 1, "model": {f"w{i}": torch.randn(64 * 1024) for i in range(32)}}   # 8 MiB, 256 KiB each
    size = 8 * MIB
    tracemalloc.start()
    try:
        torch.save(state, io.BytesIO())
        assert tracemalloc.get_traced_memory()[1] >= size, "tracemalloc does not see a BytesIO here"
        tracemalloc.reset_peak()
        save_checkpoint(tmp_path, 1, state)
        saved = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        loaded = load_latest_checkpoint(tmp_path)
        read = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert saved < size / 4 and read < size / 4, (saved, read)
    for name, t in state["model"].items():
        assert torch.equal(loaded["model"][name], t), name
