"""Run-directory I/O: atomic files, checksummed checkpoints, metrics.jsonl.

Every file the trainer writes whole goes through :func:`atomic_write` (temp file in the same folder,
fsync, rename), so a run killed at any instant leaves either the old or the new file, never a
torn one; the temp files such a kill leaves behind are removed at the next start
(:mod:`rlalign.train.rundir`). Files get the mode an ordinary ``open()`` would give them (0666
less the umask), not the 0600 of a temp file.

A checkpoint is one ``torch.save`` file of plain data (tensors, dicts, lists, numbers, strings)
plus its sha256 in ``latest.json`` (``sha256s`` holds the sha256 of every checkpoint the run still
keeps, so any of them can be verified, e.g. by ``rlalign export``). It streams to its temp file:
torch.save writes each tensor from its own memory (a device tensor is copied to the host one at a
time) and the sha256 is taken on the way, so a save needs no in-memory copy of the checkpoint. Loading verifies the checksum (reading the
file in chunks) and then unpickles with ``weights_only=True``: a planted file whose pickle would
import or call anything is refused without running it, even when its checksum matches. The loaded
tensors are mapped from the file (mmap, copy-on-write), not read into memory: whoever keeps one past
the load copies it into memory of its own (:func:`own_optimizer_state`), or the mapping would hold
the file's disk space after the next save deletes it.

Ownership: ``latest.json`` lists the checkpoints the run wrote (``history``); a save deletes only
those, never replaces an existing file, and records the file it is about to put in place (name and
sha256) in ``checkpoints/pending.json`` before renaming it there, so a kill between that rename and
``latest.json`` leaves a file the next start can prove is ours (same sha256) and remove. A file in
``checkpoints/`` that no manifest names is never deleted.

Disk: a save writes the new checkpoint before deleting any the manifest still needs, so with
``run.keep_checkpoints=1`` two checkpoints exist during a save (a kill mid-write leaves the old one
whole); with ``keep >= 2`` the oldest ones go first and a save needs no more than ``keep`` files.

``metrics.jsonl`` is appended one line per record (flushed and fsynced). Only its last line can
be torn (a kill or a full disk mid-write): readers drop an unparseable last line and report it;
an unparseable line elsewhere is a corrupt file and is named with its line number.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.models.checkpoint import default_file_mode
from rlalign.models.ownership import open_own_file

TEMP_SUFFIX = ".tmp"   # atomic_write's temp files: ".<name>.<random>.tmp"
CHECKPOINT_KEEP = 2
MANIFEST_FILE, PENDING_FILE = "latest.json", "pending.json"
CHECKPOINT_NAME = re.compile(r"step_(\d{6,})\.pt")


class CheckpointCorrupt(RLAlignError):
    pass


class MetricsCorrupt(RLAlignError):
    pass


class CheckpointRefused(RLAlignError):
    """A save would replace a file the run did not write; nothing was written."""


def atomic_write(path: Path, data: bytes) -> None:
    atomic_write_with(path, lambda f: f.write(data))


def atomic_write_with(path: Path, fill: Callable[[BinaryIO], Any],
                      before_rename: "Callable[[Any], None] | None" = None) -> Any:
    """``fill(f)`` writes the file's bytes to ``f``; returns what ``fill`` returns. The file appears at
    ``path`` whole (temp file, fsync, rename) or not at all. ``before_rename(result)`` runs once the temp
    file is durable, just before the rename (a save records what it is about to put in place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), default_file_mode())   # mkstemp creates 0600
            result = fill(f)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(result)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise _naming(exc, path) from None
    _fsync_dir(path.parent)
    return result


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


def checkpoint_step(name: str) -> "int | None":
    """The step of a checkpoint file name (``step_000012.pt`` -> 12), None for any other name."""
    match = CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int = CHECKPOINT_KEEP,
                    facts: "dict | None" = None) -> Path:
    """Write ``checkpoints/step_{step:06d}.pt`` (streamed, see the module doc) then point
    ``checkpoints/latest.json`` at it. ``facts``: small JSON data about the run that a start must read
    without loading a checkpoint (kept in the manifest under ``facts``).

    ``latest.json`` lists the checkpoint files this run wrote (``history``, oldest first, each with its
    sha256 in ``sha256s``); only those of earlier steps are ever deleted (all but the newest ``keep``;
    before the write, all but the newest ``max(keep - 1, 1)``), so files of another run are never
    touched and the newest recorded checkpoint is never deleted before its successor is recorded. An
    existing file at the new checkpoint's name is never replaced (:class:`CheckpointRefused`).
    """
    ckpt_dir = run_dir / "checkpoints"
    path = ckpt_dir / checkpoint_name(step)
    previous = read_manifest(ckpt_dir / MANIFEST_FILE, missing_ok=True) or {}
    if path.exists() or path.is_symlink():
        raise CheckpointRefused(f"{path} already exists and is not a checkpoint this save may replace; move it out "
                                f"of {ckpt_dir} and continue with run.resume=true (the last checkpoint is intact)")
    sums = recorded_sha256s(previous)
    # Files of this run still on disk, oldest first. The manifest lists them before the old ones are
    # deleted, so a kill between the two leaves them recorded and the next save deletes them.
    earlier = [f for f in previous.get("history", []) if checkpoint_step(f) < step and (ckpt_dir / f).exists()]
    _delete(ckpt_dir, earlier[:-max(keep - 1, 1)])   # not needed even if this save is killed
    sha256, nbytes = atomic_write_with(path, lambda f: _stream_state(state, f),
                                       before_rename=lambda result: _record_pending(ckpt_dir, path.name, result[0]))
    history = [f for f in earlier if (ckpt_dir / f).exists()] + [path.name]
    manifest = {"step": step, "file": path.name, "sha256": sha256, "bytes": nbytes, "history": history,
                "sha256s": {f: sums[f] for f in history if f in sums} | {path.name: sha256},
                **({"facts": facts} if facts else {})}
    atomic_write(ckpt_dir / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    (ckpt_dir / PENDING_FILE).unlink(missing_ok=True)
    _delete(ckpt_dir, history[:-keep])
    return path


def _record_pending(ckpt_dir: Path, name: str, sha256: str) -> None:
    atomic_write(ckpt_dir / PENDING_FILE, json.dumps({"file": name, "sha256": sha256}).encode())


def recorded_sha256s(manifest: "dict | None") -> dict[str, str]:
    """{checkpoint file name: sha256} of the checkpoints a manifest records (the newest one alone for a
    manifest written before every kept checkpoint's sha256 was recorded)."""
    if not manifest:
        return {}
    sums = dict(manifest.get("sha256s") or {})
    sums.setdefault(manifest["file"], manifest["sha256"])
    return sums


def unrecorded_pending(ckpt_dir: Path) -> list[Path]:
    """What a save killed after renaming its checkpoint into place but before recording it leaves:
    ``pending.json`` and the file it names, when that file is not recorded in ``latest.json`` and its
    sha256 is the one the save noted (the file is provably the one the save wrote)."""
    pending_path = Path(ckpt_dir) / PENDING_FILE
    if not pending_path.is_file() or pending_path.is_symlink():
        return []
    try:
        pending = json.loads(pending_path.read_text(encoding="utf-8"))
        name, sha256 = pending["file"], pending["sha256"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return [pending_path]
    try:
        manifest = read_manifest(Path(ckpt_dir) / MANIFEST_FILE, missing_ok=True)
    except CheckpointCorrupt:
        return []   # what is recorded is unknown: touch nothing (the start names the manifest's problem)
    recorded = set((manifest or {}).get("history", [])) | ({manifest["file"]} if manifest else set())
    file = Path(ckpt_dir) / str(name)
    ours = (checkpoint_step(str(name)) is not None and name not in recorded and file.is_file()
            and not file.is_symlink() and file_sha256(file) == sha256)
    return [file, pending_path] if ours else [pending_path]


def _delete(folder: Path, names: list[str]) -> None:
    for name in names:
        (folder / name).unlink(missing_ok=True)


class _HashingSink:
    """The file object torch.save writes a checkpoint to: each chunk goes to ``file`` and into the sha256.

    torch.save hands over each tensor's bytes straight from its storage, so nothing the size of the
    checkpoint is built. An OSError of ``file`` (a full disk) is kept and raised by :func:`_stream_state`
    once torch.save returns: raised inside torch's C++ writer it would come out as an unrelated
    RuntimeError (measured: "unexpected pos ...")."""

    def __init__(self, file: BinaryIO):
        self.file, self.sha256, self.nbytes, self.error = file, hashlib.sha256(), 0, None

    def write(self, chunk) -> int:
        view = memoryview(chunk)
        if self.error is None:
            try:
                self.file.write(view)
            except OSError as exc:
                self.error = exc
            self.sha256.update(view)
        self.nbytes += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        if self.error is None:
            try:
                self.file.flush()
            except OSError as exc:
                self.error = exc


def _stream_state(state: dict[str, Any], file: BinaryIO) -> tuple[str, int]:
    sink = _HashingSink(file)
    torch.save(state, sink)
    if sink.error is not None:
        raise sink.error
    return sink.sha256.hexdigest(), sink.nbytes


def read_manifest(manifest_path: Path, missing_ok: bool = False) -> "dict | None":
    """``latest.json``, checked: every file it names (``file``, ``history``, ``sha256s``) is a checkpoint
    name inside its own folder (``step_NNNNNN.pt``, no path), so nothing it says reaches outside it."""
    if missing_ok and not manifest_path.exists() and not manifest_path.is_symlink():
        return None
    try:
        if manifest_path.is_symlink():
            raise ValueError("it is a symbolic link")
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if not isinstance(manifest.get("file"), str) or checkpoint_step(manifest["file"]) is None \
                or not isinstance(manifest["step"], int):
            raise ValueError("bad 'file' or 'step'")
        names = list(manifest.setdefault("history", [])) + list(manifest.setdefault("sha256s", {}))
        if not all(isinstance(n, str) and checkpoint_step(n) is not None for n in names):
            raise ValueError("'history' or 'sha256s' names a file that is not a checkpoint of this folder")
        if not isinstance(manifest["sha256"], str):
            raise ValueError("bad 'sha256'")
    except (ValueError, KeyError, AttributeError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(f"{manifest_path} is unreadable ({exc}); restore it, or start the run afresh "
                                "with run.overwrite=true") from None
    return manifest


def load_latest_checkpoint(run_dir: Path) -> "dict[str, Any] | None":
    """The state of the newest checkpoint, or None when the run has none; checksum and content checked.
    Its tensors are mapped from the file (see the module doc)."""
    manifest_path = Path(run_dir) / "checkpoints" / "latest.json"
    manifest = read_manifest(manifest_path, missing_ok=True)
    if manifest is None:
        return None
    path = manifest_path.parent / manifest["file"]
    if path.is_symlink():
        raise CheckpointCorrupt(f"{manifest_path} names {path.name}, which is a symbolic link (to {os.readlink(path)}); "
                                "rlalign reads a run's checkpoints from its own folder only: put the file itself there")
    if not path.exists():
        raise CheckpointCorrupt(f"{manifest_path} names {path.name}, which is missing; restore it, or start the run "
                                "afresh with run.overwrite=true")
    if file_sha256(path) != manifest["sha256"]:
        raise CheckpointCorrupt(f"checkpoint {path} is corrupt (sha256 mismatch); restore it, or start the run "
                                "afresh with run.overwrite=true")
    return load_state(path)


def recorded_checkpoint_sha256(file: Path) -> "str | None":
    """The sha256 that the ``latest.json`` next to ``file`` records for it, or None (no manifest there, or
    the manifest does not list it)."""
    file = Path(file)
    manifest = read_manifest(file.parent / MANIFEST_FILE, missing_ok=True)
    return recorded_sha256s(manifest).get(file.name)


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """sha256 of a file read in chunks of ``chunk_bytes`` (one buffer, reused)."""
    digest, buf = hashlib.sha256(), bytearray(chunk_bytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def load_state(path: Path) -> dict[str, Any]:
    """Unpickle a checkpoint file with ``weights_only=True`` (plain data only, no code runs), its tensors
    mapped from the file (copy-on-write: writing one changes memory, never the file)."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except pickle.UnpicklingError as exc:
        first = " ".join(str(exc).split())[:200]
        raise CheckpointCorrupt(f"checkpoint {path} holds objects other than tensors and plain data, refused without "
                                f"loading them (it may have been planted to run code): {first}") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointCorrupt(f"checkpoint {path} is not a readable checkpoint ({exc.__class__.__name__}); "
                                "restore it, or start the run afresh with run.overwrite=true") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointCorrupt(f"checkpoint {path} does not hold a training state")
    return state


@torch.no_grad()
def own_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every host tensor of ``optimizer.state`` memory of its own, one tensor at a time, after
    ``optimizer.load_state_dict`` of a loaded checkpoint: torch keeps a loaded tensor that already has
    its parameter's dtype and device, i.e. the file mapping of :func:`load_state`."""
    for per_param in optimizer.state.values():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                per_param[key] = value.clone()


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
            # never through a link, never into a file with another hard link (rlalign.models.ownership)
            with open(self.path, "a", encoding="utf-8", opener=_own_file_opener) as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise _naming(exc, self.path) from None


def _own_file_opener(path: str, flags: int) -> int:
    return open_own_file(Path(path), flags, "metrics file")


def read_metrics(run_dir: Path, notes: "list[str] | None" = None) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``; a torn last line is dropped and described in ``notes``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise RLAlignError(f"{path} does not exist: is {run_dir} a run directory?")
    records, note = parse_metrics(path)
    if note and notes is not None:
        notes.append(note)
    return records
