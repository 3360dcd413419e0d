"""Checkpoint files of a run directory: checksummed, streamed, owned.

A checkpoint is one ``torch.save`` file of plain data (tensors, dicts, lists, numbers, strings)
plus its sha256 in ``latest.json`` (``sha256s`` holds the sha256 of every checkpoint the run still
keeps, so any of them can be verified, e.g. by ``rlalign export``). It streams to its temp file:
torch.save writes each tensor from its own memory (a device tensor is copied to the host one at a
time) and the sha256 is taken on the way, so a save needs no in-memory copy of the checkpoint. Loading
verifies the checksum (reading the file in chunks) and then unpickles with ``weights_only=True``: a planted file whose pickle would
import or call anything is refused without running it, even when its checksum matches. The loaded
tensors are mapped from the file (mmap, copy-on-write), not read into memory: whoever keeps one past
the load copies it into memory of its own (:func:`own_optimizer_state`), or the mapping would hold
the file's disk space after the next save deletes it.

Ownership: ``latest.json`` lists the checkpoints the run wrote (``history``); a save deletes only
those, never replaces an existing file, and records the file it is about to put in place (name and
sha256) in ``checkpoints/pending.json`` before renaming it there, so a kill between that rename and
``latest.json`` leaves a file the next start can prove is ours (same sha256) and remove. A file in
``checkpoints/`` that no manifest names is never deleted.

Parts (``parallel.shard=grads``, rlalign.train.sharding): a checkpoint may come with one part file per rank,
``step_N.rankR.pt``, each rank's range of the sharded training state. Each rank streams its part to a temp file; the
writer notes every part's name and sha256 in ``pending.json`` before any is renamed into place
(:func:`note_pending_parts`); the main file then lists them and ``latest.json`` records them under ``parts`` (main
file -> {part: sha256}). They are verified when read (:func:`load_part`), deleted with their main file, and a part a
kill left renamed but unrecorded is proved by its sha256 and removed like an unrecorded checkpoint.

Disk: a save writes the new checkpoint before deleting any the manifest still needs, so with
``run.keep_checkpoints=1`` two checkpoints exist during a save (a kill mid-write leaves the old one
whole); with ``keep >= 2`` the oldest ones go first and a save needs no more than ``keep`` files.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.models.atomic import atomic_write, atomic_write_with

CHECKPOINT_KEEP = 2
MANIFEST_FILE, PENDING_FILE = "latest.json", "pending.json"
CHECKPOINT_NAME = re.compile(r"step_(\d{6,})\.pt")
PART_NAME = re.compile(r"step_(\d{6,})\.rank(\d+)\.pt")


class CheckpointCorrupt(RLAlignError):
    pass


class CheckpointRefused(RLAlignError):
    """A save would replace a file the run did not write; nothing was written."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}.pt"


def checkpoint_step(name: str) -> "int | None":
    """The step of a checkpoint file name (``step_000012.pt`` -> 12), None for any other name."""
    match = CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def part_name(step: int, rank: int) -> str:
    return f"step_{step:06d}.rank{rank}.pt"


def part_step(name: str) -> "int | None":
    """The step of a part file name (``step_000012.rank3.pt`` -> 12), None for any other name."""
    match = PART_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int = CHECKPOINT_KEEP,
                    facts: "dict | None" = None, parts: "dict[str, str] | None" = None) -> Path:
    """Write ``checkpoints/step_{step:06d}.pt`` (streamed, see the module doc) then point
    ``checkpoints/latest.json`` at it. ``facts``: small JSON data about the run that a start must read
    without loading a checkpoint (kept in the manifest under ``facts``).

    ``latest.json`` lists the checkpoint files this run wrote (``history``, oldest first, each with its
    sha256 in ``sha256s``); only those of earlier steps are ever deleted (all but the newest ``keep``;
    before the write, all but the newest ``max(keep - 1, 1)``), so files of another run are never
    touched and the newest recorded checkpoint is never deleted before its successor is recorded. An
    existing file at the new checkpoint's name is never replaced (:class:`CheckpointRefused`). ``parts``: the
    part files of this checkpoint already in place ({name: sha256}, :func:`save_part`), recorded with it and
    deleted with it.
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
    old_parts = dict(previous.get("parts") or {})
    _delete(ckpt_dir, earlier[:-max(keep - 1, 1)], old_parts)   # not needed even if this save is killed
    sha256, nbytes = atomic_write_with(path, lambda f: _stream_state(state, f),
                                       before_rename=lambda result: _record_pending(ckpt_dir, path.name, result[0],
                                                                                    parts))
    history = [f for f in earlier if (ckpt_dir / f).exists()] + [path.name]
    all_parts = {f: old_parts[f] for f in history if f in old_parts} | ({path.name: dict(parts)} if parts else {})
    manifest = {"step": step, "file": path.name, "sha256": sha256, "bytes": nbytes, "history": history,
                "sha256s": {f: sums[f] for f in history if f in sums} | {path.name: sha256},
                **({"parts": all_parts} if all_parts else {}), **({"facts": facts} if facts else {})}
    atomic_write(ckpt_dir / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    (ckpt_dir / PENDING_FILE).unlink(missing_ok=True)
    _delete(ckpt_dir, history[:-keep], all_parts)
    return path


def note_pending_parts(run_dir: Path, parts: dict[str, str]) -> None:
    """The writer's note, before any part is renamed into place: their names and sha256s (``pending.json``), so a
    kill between their renames and ``latest.json`` leaves files the next start can prove are ours and remove."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(ckpt_dir / PENDING_FILE, json.dumps({"parts": parts}).encode())


def part_in_the_way(run_dir: Path, step: int, ranks: int) -> "str | None":
    """A file at the checkpoint or part names a save of ``step`` over ``ranks`` would write (never replaced): one
    line naming it, or None."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    for path in [ckpt_dir / checkpoint_name(step)] + [ckpt_dir / part_name(step, r) for r in range(ranks)]:
        if path.exists() or path.is_symlink():
            return (f"{path} already exists and is not a checkpoint file this save may replace; move it out of "
                    f"{ckpt_dir} and continue with run.resume=true (the last checkpoint is intact)")
    return None


def save_part(run_dir: Path, step: int, rank: int, state: dict[str, Any],
              before_rename) -> tuple[str, str]:
    """Rank ``rank``'s part of checkpoint ``step`` (streamed like a checkpoint); ``before_rename((name, sha256))``
    runs once the temp file is durable, before it is renamed into place (every rank's save waits there for the
    writer's :func:`note_pending_parts`). Returns (name, sha256)."""
    path = Path(run_dir) / "checkpoints" / part_name(step, rank)
    sha256, _ = atomic_write_with(path, lambda f: _stream_state(state, f),
                                  before_rename=lambda result: before_rename((path.name, result[0])))
    return path.name, sha256


def load_part(run_dir: Path, name: str, sha256: str) -> dict[str, Any]:
    """A part file a checkpoint lists, its sha256 checked, unpickled like a checkpoint (tensors mapped)."""
    path = Path(run_dir) / "checkpoints" / name
    if part_step(name) is None or path.is_symlink() or not path.is_file():
        raise CheckpointCorrupt(f"the checkpoint lists {name}, which is missing or not a part file of "
                                f"{path.parent}; restore it, or start the run afresh with run.overwrite=true")
    if file_sha256(path) != sha256:
        raise CheckpointCorrupt(f"checkpoint part {path} is corrupt (sha256 mismatch); restore it, or start the run "
                                "afresh with run.overwrite=true")
    return load_state(path, what="pieces")


def _record_pending(ckpt_dir: Path, name: str, sha256: str, parts: "dict[str, str] | None" = None) -> None:
    atomic_write(ckpt_dir / PENDING_FILE, json.dumps({"file": name, "sha256": sha256,
                                                      **({"parts": parts} if parts else {})}).encode())


def recorded_sha256s(manifest: "dict | None") -> dict[str, str]:
    """{checkpoint file name: sha256} of the checkpoints a manifest records (the newest one alone for a
    manifest written before every kept checkpoint's sha256 was recorded)."""
    if not manifest:
        return {}
    sums = dict(manifest.get("sha256s") or {})
    sums.setdefault(manifest["file"], manifest["sha256"])
    return sums


def unrecorded_pending(ckpt_dir: Path) -> list[Path]:
    """What a save killed after renaming its checkpoint (or its parts) into place but before recording it leaves:
    ``pending.json`` and the files it names, each when it is not recorded in ``latest.json`` and its sha256 is the
    one the save noted (the file is provably the one the save wrote)."""
    pending_path = Path(ckpt_dir) / PENDING_FILE
    if not pending_path.is_file() or pending_path.is_symlink():
        return []
    try:
        pending = json.loads(pending_path.read_text(encoding="utf-8"))
        noted = ({pending["file"]: pending["sha256"]} if "file" in pending else {}) | dict(pending.get("parts") or {})
        if not all(isinstance(n, str) and isinstance(h, str) for n, h in noted.items()):
            raise TypeError("bad names")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return [pending_path]
    try:
        manifest = read_manifest(Path(ckpt_dir) / MANIFEST_FILE, missing_ok=True)
    except CheckpointCorrupt:
        return []   # what is recorded is unknown: touch nothing (the start names the manifest's problem)
    recorded = set((manifest or {}).get("history", [])) | ({manifest["file"]} if manifest else set())
    recorded |= {p for parts in ((manifest or {}).get("parts") or {}).values() for p in parts}
    ours = []
    for name, sha256 in noted.items():
        file = Path(ckpt_dir) / name
        if ((checkpoint_step(name) is not None or part_step(name) is not None) and name not in recorded
                and file.is_file() and not file.is_symlink() and _has_sha256(file, sha256)):
            ours.append(file)
    return ours + [pending_path]


_PROVEN: dict[tuple, bool] = {}


def _has_sha256(file: Path, sha256: str) -> bool:
    """``file_sha256(file) == sha256``, hashed once per version of the file (a start asks up to three times, and a
    checkpoint can be ~100 GB); the key is the file's identity, size and modification time."""
    info = file.stat()
    key = (str(file.resolve()), info.st_ino, info.st_size, info.st_mtime_ns, sha256)
    if key not in _PROVEN:
        _PROVEN[key] = file_sha256(file) == sha256
    return _PROVEN[key]


def _delete(folder: Path, names: list[str], parts: "dict | None" = None) -> None:
    """Delete checkpoint files ``names`` and the parts ``parts`` records for them."""
    for name in names:
        for part in (parts or {}).get(name, {}):
            if part_step(part) is not None:
                (folder / part).unlink(missing_ok=True)
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
        parts = manifest.get("parts") or {}
        if not isinstance(parts, dict) or not all(
                checkpoint_step(main) is not None and isinstance(named, dict)
                and all(isinstance(p, str) and part_step(p) == checkpoint_step(main) for p in named)
                for main, named in parts.items()):
            raise ValueError("'parts' names a file that is not a checkpoint part of this folder")
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


def load_state(path: Path, what: str = "step") -> dict[str, Any]:
    """Unpickle a checkpoint file with ``weights_only=True`` (plain data only, no code runs), its tensors
    mapped from the file (copy-on-write: writing one changes memory, never the file). ``what``: a key it must
    hold (a part file: ``pieces``)."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except pickle.UnpicklingError as exc:
        first = " ".join(str(exc).split())[:200]
        raise CheckpointCorrupt(f"checkpoint {path} holds objects other than tensors and plain data, refused without "
                                f"loading them (it may have been planted to run code): {first}") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointCorrupt(f"checkpoint {path} is not a readable checkpoint ({exc.__class__.__name__}); "
                                "restore it, or start the run afresh with run.overwrite=true") from None
    if not isinstance(state, dict) or what not in state:
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


__all__ = ["CHECKPOINT_KEEP", "MANIFEST_FILE", "PENDING_FILE", "CheckpointCorrupt", "CheckpointRefused",
           "checkpoint_name", "checkpoint_step", "part_name", "part_step", "note_pending_parts", "part_in_the_way",
           "save_part", "load_part", "file_sha256", "load_latest_checkpoint", "load_state",
           "own_optimizer_state", "read_manifest", "recorded_checkpoint_sha256", "recorded_sha256s",
           "save_checkpoint", "unrecorded_pending"]
