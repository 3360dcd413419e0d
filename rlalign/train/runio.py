"""Run-directory I/O: atomic files, checksummed checkpoints, metrics.jsonl.

Every file the trainer writes whole goes through :func:`atomic_write` (temp file in the same folder,
fsync, rename), so a run killed at any instant leaves either the old or the new file, never a
torn one; the temp files such a kill leaves behind are removed at the next start
(:mod:`rlalign.train.rundir`). Files get the mode an ordinary ``open()`` would give them (0666
less the umask), not the 0600 of a temp file.

A checkpoint is one ``torch.save`` file of plain data (tensors, dicts, lists, numbers, strings)
plus its sha256 in ``latest.json``. Loading verifies the checksum and then unpickles with
``weights_only=True``: a planted file whose pickle would import or call anything is refused
without running it, even when its checksum matches.

``metrics.jsonl`` is appended one line per record (flushed and fsynced). Only its last line can
be torn (a kill or a full disk mid-write): readers drop an unparseable last line and report it;
an unparseable line elsewhere is a corrupt file and is named with its line number.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.models.checkpoint import default_file_mode

TEMP_SUFFIX = ".tmp"   # atomic_write's temp files: ".<name>.<random>.tmp"
CHECKPOINT_KEEP = 2


class CheckpointCorrupt(RLAlignError):
    pass


class MetricsCorrupt(RLAlignError):
    pass


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), default_file_mode())   # mkstemp creates 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise _naming(exc, path) from None
    _fsync_dir(path.parent)


def _naming(exc: BaseException, path: Path) -> BaseException:
    """An OSError from write()/fsync() carries no file name: add it, so the user sees which file (and disk)."""
    if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
        return OSError(exc.errno, exc.strerror, str(path))
    return exc


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- checkpoints ----------------------------------------------------------------------------------

def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}.pt"


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int = CHECKPOINT_KEEP) -> Path:
    """Write ``checkpoints/step_{step:06d}.pt`` then point ``checkpoints/latest.json`` at it.

    ``latest.json`` lists the checkpoint files this run wrote (``history``, oldest first); only
    those are ever deleted (all but the newest ``keep``), so files of another run are never touched.
    """
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    ckpt_dir = run_dir / "checkpoints"
    path = ckpt_dir / checkpoint_name(step)
    atomic_write(path, data)
    previous = _read_manifest(ckpt_dir / "latest.json", missing_ok=True) or {}
    # Files of this run still on disk, oldest first; the manifest lists them before the old ones are
    # deleted, so a kill between the two leaves them recorded and the next save deletes them.
    history = [f for f in previous.get("history", []) if f != path.name and (ckpt_dir / f).exists()] + [path.name]
    manifest = {"step": step, "file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "history": history}
    atomic_write(ckpt_dir / "latest.json", json.dumps(manifest, indent=1).encode())
    for old in history[:-keep]:
        (ckpt_dir / old).unlink(missing_ok=True)
    return path


def _read_manifest(manifest_path: Path, missing_ok: bool = False) -> "dict | None":
    if missing_ok and not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if not isinstance(manifest.get("file"), str) or "/" in manifest["file"] or not isinstance(manifest["step"], int):
            raise ValueError("bad 'file' or 'step'")
        manifest["sha256"]
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        raise CheckpointCorrupt(f"{manifest_path} is unreadable ({exc}); restore it, or start the run afresh "
                                "with run.overwrite=true") from None
    return manifest


def load_latest_checkpoint(run_dir: Path) -> "dict[str, Any] | None":
    """The state of the newest checkpoint, or None when the run has none; checksum and content checked."""
    manifest_path = Path(run_dir) / "checkpoints" / "latest.json"
    manifest = _read_manifest(manifest_path, missing_ok=True)
    if manifest is None:
        return None
    path = manifest_path.parent / manifest["file"]
    if not path.exists():
        raise CheckpointCorrupt(f"{manifest_path} names {path.name}, which is missing; restore it, or start the run "
                                "afresh with run.overwrite=true")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise CheckpointCorrupt(f"checkpoint {path} is corrupt (sha256 mismatch); restore it, or start the run "
                                "afresh with run.overwrite=true")
    return load_state(data, path)


def load_state(data: bytes, where: Path) -> dict[str, Any]:
    """Unpickle a checkpoint with ``weights_only=True``: plain data only, no code runs."""
    try:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        first = " ".join(str(exc).split())[:200]
        raise CheckpointCorrupt(f"checkpoint {where} holds objects other than tensors and plain data, refused without "
                                f"loading them (it may have been planted to run code): {first}") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointCorrupt(f"checkpoint {where} is not a readable checkpoint ({exc.__class__.__name__}); "
                                "restore it, or start the run afresh with run.overwrite=true") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointCorrupt(f"checkpoint {where} does not hold a training state")
    return state


# ---- metrics.jsonl ----------------------------------------------------------------------------------

def _finite(value: Any) -> Any:
    """JSON has no inf/NaN: such a float is written as null (the report treats null as missing)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def parse_metrics(path: Path) -> tuple[list[dict[str, Any]], "str | None"]:
    """(records, note): ``note`` describes a torn last line that was dropped, else None."""
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    records, note = [], None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last = all(not rest.strip() for rest in lines[number:])
        try:
            record = json.loads(line.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError:
            if last:   # a cut-off append: the run was killed (or the disk filled) while writing it
                note = (f"{path}: dropped a torn last line ({number}: {len(line)} bytes, "
                        f"{line[:40].decode('utf-8', 'replace')!r}...)")
                break
            raise MetricsCorrupt(f"{path}:{number} is not a JSON object and is not the last line: the file is "
                                 "corrupt; restore it or delete that line") from None
        records.append(record)
    return records, note


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` (flushed and fsynced each line).

    A fresh run starts the file empty. A resumed run keeps the records of the steps its checkpoint
    covers and drops the rest (the steps it will redo) and a torn last line; ``note`` says so."""

    def __init__(self, run_dir: Path, resume_after_step: "int | None" = None):
        self.path = run_dir / "metrics.jsonl"
        self.note = None
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_after_step is not None and self.path.exists():
            records, self.note = parse_metrics(self.path)
            kept = [json.dumps(r, sort_keys=True) for r in records if r.get("step", -1) <= resume_after_step]
            atomic_write(self.path, ("\n".join(kept) + "\n" if kept else "").encode())
        elif resume_after_step is None and self.path.exists():
            self.path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _finite(v) for k, v in record.items()}, sort_keys=True, allow_nan=False) + "\n"
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise _naming(exc, self.path) from None


def read_metrics(run_dir: Path, notes: "list[str] | None" = None) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``; a torn last line is dropped and described in ``notes``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise RLAlignError(f"{path} does not exist: is {run_dir} a run directory?")
    records, note = parse_metrics(path)
    if note and notes is not None:
        notes.append(note)
    return records
