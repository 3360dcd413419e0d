"""Run-directory I/O: atomic files, checksummed checkpoints, metrics.jsonl.

Every file the trainer writes goes through :func:`atomic_write` (temp file in the same folder,
fsync, rename), so a run killed at any instant leaves either the old or the new file, never a
torn one. A checkpoint is one ``torch.save`` file plus its sha256 in ``latest.json``; loading
verifies the checksum and names the file when it does not match.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from rlalign.contract.errors import RLAlignError


class CheckpointCorrupt(RLAlignError):
    pass


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``checkpoints/step_{step:06d}.pt`` then point ``checkpoints/latest.json`` at it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    ckpt_dir = run_dir / "checkpoints"
    path = ckpt_dir / f"step_{step:06d}.pt"
    atomic_write(path, data)
    manifest = {"step": step, "file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    atomic_write(ckpt_dir / "latest.json", json.dumps(manifest, indent=1).encode())
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_latest_checkpoint(run_dir: Path) -> "dict[str, Any] | None":
    manifest_path = run_dir / "checkpoints" / "latest.json"
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        path = manifest_path.parent / manifest["file"]
    except (ValueError, KeyError) as exc:
        raise CheckpointCorrupt(f"{manifest_path} is unreadable ({exc}); delete it to start the run afresh") from None
    if not path.exists():
        raise CheckpointCorrupt(f"{manifest_path} names {path.name}, which is missing; delete latest.json to start afresh")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise CheckpointCorrupt(f"checkpoint {path} is corrupt (sha256 mismatch); restore it or delete "
                                f"{manifest_path} to start afresh")
    return torch.load(io.BytesIO(data), weights_only=False)


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` (flushed and fsynced each line)."""

    def __init__(self, run_dir: Path, resume_after_step: "int | None" = None):
        self.path = run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_after_step is not None and self.path.exists():
            # Drop lines of steps the resumed run will redo, so the file stays one line per step.
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", -1) <= resume_after_step]
            atomic_write(self.path, ("\n".join(kept) + "\n" if kept else "").encode())
        elif resume_after_step is None and self.path.exists():
            self.path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise RLAlignError(f"{path} does not exist: is {run_dir} a run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
