"""The run directory's lifecycle: who may use it, what a fresh run and a resume find there, and
what a run may delete there (rlalign.models.ownership states the rule for every command).

- **One training at a time.** :func:`open_run_dir` takes an exclusive ``flock`` on
  ``RUN_DIR/.lock`` for the life of the process (the kernel drops it when the process ends, even by
  SIGKILL, so a lock left by a dead process is never in the way); the file records pid, host and
  start time, which the refusal message quotes. A second training in the same directory stops at
  once with one line. The lock file is opened with ``O_NOFOLLOW`` and must be a plain file with a
  single link: a planted symbolic or hard link is refused, its target untouched.
- **No links.** A run's own entries (:data:`RUN_FILES`, ``checkpoints/latest.json``) that are
  symbolic links are refused at the start: a run never reads or writes through a link out of its
  directory.
- **A fresh run** (``run.resume=false``) needs a missing or empty directory. A directory holding a
  previous run is refused unless ``run.overwrite=true``, which deletes that run's files and nothing
  else: the top-level files of :data:`RUN_FILES`, the checkpoints its ``latest.json`` records, and
  ``policy/`` when it holds only a saved model's files.
- **A resume** (``run.resume=true``) needs ``checkpoints/latest.json``; without it the run stops
  (it never restarts at step 0 over the old metrics).
- **Never over a checkpoint it did not write.** A file ``checkpoints/step_N.pt`` that the run would
  write (a step after the one it starts from, up to ``run.steps``) and that it did not write (another
  run's checkpoint kept there, or a recorded one after ``latest.json`` was rewound) stops the start
  with one line; one beyond ``run.steps`` is left alone. A ``policy/`` folder holding files other
  than a saved model's is refused too (the run replaces ``policy/`` at its end).
- **Leftovers** of a killed run (the temp files of atomic writes, ``.policy.tmp-*`` / ``.policy.old-*``
  folders, the checkpoint a save put in place but did not record, proven ours by the sha256 in
  ``checkpoints/pending.json``) are removed at the next start, after the lock is held. Nothing else
  is deleted.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from rlalign.contract.errors import RLAlignError
from rlalign.models.checkpoint import is_model_folder_file
from rlalign.models.ownership import OutputRefused, foreign_entries, open_own_file, refuse_overlap
from rlalign.models.atomic import TEMP_SUFFIX
from rlalign.train.run.checkpoint_files import (CheckpointCorrupt, MANIFEST_FILE, PENDING_FILE, checkpoint_step,
                                                part_step, read_manifest, recorded_sha256s, unrecorded_pending)
from rlalign.train.run.metrics import TENSORBOARD_EVENT_PREFIX, TENSORBOARD_FILES, WANDB_ID_FILE

LOCK_NAME = ".lock"
# What a run writes at the top of its directory; run.overwrite=true deletes these (the folders: only their
# files of this run, see the module doc).
RUN_FILES = ("checkpoints", "metrics.jsonl", "policy", "report.png", "report.md", "compare.png", "compare.md",
             "config.yaml")
# The files atomic_write writes in a run directory; their temp files are ".<name>.<random>.tmp".
_ATOMIC_FILES = ("metrics.jsonl", "config.yaml", "report.png", "report.md", "compare.png", "compare.md",
                 MANIFEST_FILE, PENDING_FILE)
_TEMP_NAME = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]+" + re.escape(TEMP_SUFFIX))
_POLICY_LEFTOVER = re.compile(r"\.policy\.(tmp|old)-[a-z0-9_]+")


class RunDirError(RLAlignError):
    pass


@dataclass
class RunDirectory:
    """The locked run directory; the lock lasts until :meth:`release` or until this object is dropped."""
    path: Path
    lock_fd: int
    removed: list[str]          # leftovers cleaned at start (relative paths), for the log
    created: bool = False       # this call made the directory

    def abandon(self) -> None:
        """Release, and remove the directory again if this run made it and wrote nothing but the lock
        (a run that failed during setup leaves no empty run directory behind)."""
        self.release()
        if self.created and [p.name for p in self.path.iterdir()] == [LOCK_NAME]:
            (self.path / LOCK_NAME).unlink(missing_ok=True)
            try:
                self.path.rmdir()
            except OSError:
                pass

    def __del__(self):
        self.release()

    def release(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)   # closing the descriptor drops the flock
            self.lock_fd = -1


def open_run_dir(path: Path, *, resume: bool, overwrite: bool, last_step: "int | None" = None,
                 reads: Iterable[Path] = ()) -> RunDirectory:
    """Create/lock ``path`` and bring it to the state a fresh run or a resume expects. ``last_step``: the
    run's last step (run.steps), the bound of the checkpoints it may write (None: unbounded). ``reads``: the
    files and folders the run reads (model, dataset, reward, config): ``run.overwrite`` may not delete in a run
    directory that is, or contains, one of them or the current directory. Every refusal comes before the first
    change."""
    path = Path(path)
    if overwrite and not resume:
        try:
            refuse_overlap(path, "run.dir", reads)
        except OutputRefused as exc:
            raise RunDirError(f"{exc}; run.overwrite=true would delete in it") from None
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run.dir {path} is a file, not a directory; choose another run.dir")
    if resume and not path.is_dir():
        raise RunDirError(f"run.resume=true but run.dir {path} does not exist; fix run.dir or start a fresh run")
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create run.dir {path}: {exc.strerror}") from None
    fd = _lock(path)
    try:
        _refuse_links(path)
        _refuse_foreign_policy(path)
        if resume:
            manifest = _require_checkpoint(path)
            _refuse_overwriting_checkpoints(path, after=manifest["step"], upto=last_step)
        else:
            _prepare_fresh(path, overwrite, last_step)
        removed = remove_leftovers(path)
    except BaseException:
        os.close(fd)
        raise
    return RunDirectory(path, fd, removed, created)


def _lock(path: Path) -> int:
    lock_path = path / LOCK_NAME
    try:
        fd = open_own_file(lock_path, os.O_RDWR | os.O_CREAT, "lock file")
    except OSError as exc:
        raise RunDirError(f"cannot create the lock file {lock_path}: {exc.strerror} (is run.dir writable?)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirError(f"run.dir {path} is in use by another training ({holder}); wait for it to end or "
                              "choose another run.dir") from None
        raise RunDirError(f"cannot lock run.dir {path}: {exc.strerror}") from None
    info = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode(), 0)
    return fd


def _refuse_links(path: Path) -> None:
    """A run's own entries may not be symbolic links: it would read or write wherever they point."""
    for name in (*RUN_FILES, f"checkpoints/{MANIFEST_FILE}", f"checkpoints/{PENDING_FILE}", TENSORBOARD_FILES.parent,
                 TENSORBOARD_FILES, WANDB_ID_FILE.parent, WANDB_ID_FILE):
        entry = path / name
        if entry.is_symlink():
            raise RunDirError(f"run.dir {path}: {name} is a symbolic link (to {os.readlink(entry)}); a run never reads "
                              "or writes through a link out of its directory: replace it with the real "
                              "file or folder (nothing was changed)")


def _refuse_foreign_policy(path: Path) -> None:
    """``policy/`` is replaced at the end of the run (and deleted by run.overwrite): it may hold only a saved
    model's files."""
    policy = path / "policy"
    if not policy.is_dir():
        return
    foreign = foreign_entries(policy, is_model_folder_file)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise RunDirError(f"run.dir {path}: policy/ holds files rlalign did not write ({shown}); the run replaces "
                          "policy/ when it ends: move them out (nothing was changed)")


def _require_checkpoint(path: Path) -> dict:
    manifest = read_manifest(path / "checkpoints" / MANIFEST_FILE, missing_ok=True)
    if manifest is None:
        raise RunDirError(f"run.resume=true but {path} holds no checkpoint (checkpoints/latest.json); "
                          "start a fresh run without run.resume (add run.overwrite=true to replace its files)")
    return manifest


def _refuse_overwriting_checkpoints(path: Path, after: int, upto: "int | None", ours: "set[str]" = frozenset()) -> None:
    """Refuse a start whose saves would land on a checkpoint file that is not this run's to replace: a step
    in ``(after, upto]`` (``ours``: files about to be deleted as this run's, and the save a kill left
    unrecorded, are not in the way)."""
    ckpt_dir = path / "checkpoints"
    if not ckpt_dir.is_dir():
        return
    leftover = {p.name for p in unrecorded_pending(ckpt_dir)}
    in_the_way = sorted(p.name for p in ckpt_dir.iterdir()
                        if (step := _step_of_file(p.name)) is not None and step > after
                        and (upto is None or step <= upto) and p.name not in ours and p.name not in leftover)
    if in_the_way:
        shown = ", ".join(in_the_way[:5]) + (", ..." if len(in_the_way) > 5 else "")
        whose = (f"after step {after}, the step latest.json records" if after
                 else "that the run being replaced did not record")
        raise RunDirError(f"run.dir {path}: checkpoints/ holds {shown}, {whose}; this run would write over them: "
                          "move them out of checkpoints/ and start again (nothing was changed)")


def _step_of_file(name: str) -> "int | None":
    """The step of a checkpoint or checkpoint part file name, None for any other name."""
    step = checkpoint_step(name)
    return step if step is not None else part_step(name)


def _prepare_fresh(path: Path, overwrite: bool, last_step: "int | None") -> None:
    present = sorted(p.name for p in path.iterdir() if p.name != LOCK_NAME and not _is_leftover(p))
    if not present:
        return
    if not overwrite:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise RunDirError(f"run.dir {path} is not empty ({shown}); continue its run with run.resume=true, replace "
                          "it with run.overwrite=true, or choose another run.dir (nothing was changed)")
    doomed = previous_run_files(path)
    _refuse_overwriting_checkpoints(path, after=0, upto=last_step, ours={p.name for p in doomed})
    for target in doomed:
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    for folder in (path / "checkpoints", path / TENSORBOARD_FILES.parent):
        if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()


def previous_run_files(path: Path) -> list[Path]:
    """What ``run.overwrite=true`` deletes: the previous run's top-level files, its W&B run id and the TensorBoard
    event files it listed (plain files only), the checkpoints its ``latest.json`` records (with latest.json and
    pending.json), and ``policy/`` (already checked to hold only a saved model's files). Any other entry stays."""
    files = [path / name for name in RUN_FILES if name not in ("checkpoints", "policy")] + [path / WANDB_ID_FILE]
    doomed = [f for f in files if f.is_file() and not f.is_symlink()] + _own_event_files(path)
    if (path / "policy").is_dir():
        doomed.append(path / "policy")
    ckpt_dir = path / "checkpoints"
    if ckpt_dir.is_dir():
        try:
            manifest = read_manifest(ckpt_dir / MANIFEST_FILE, missing_ok=True)
        except CheckpointCorrupt:
            manifest = None   # unreadable: it goes, the files it named count as foreign
        recorded = set((manifest or {}).get("history", [])) | set(recorded_sha256s(manifest))
        recorded |= {p for parts in ((manifest or {}).get("parts") or {}).values() for p in parts}
        recorded |= {p.name for p in unrecorded_pending(ckpt_dir)} | {MANIFEST_FILE, PENDING_FILE}
        doomed += [ckpt_dir / name for name in sorted(recorded)
                   if (ckpt_dir / name).is_file() and not (ckpt_dir / name).is_symlink()]
    return doomed


def _own_event_files(path: Path) -> list[Path]:
    """The TensorBoard event files the run's list names (event-file names only, plain files, no links) and the list."""
    listing = path / TENSORBOARD_FILES
    if not listing.is_file() or listing.is_symlink() or listing.parent.is_symlink():
        return []
    names = [n for n in listing.read_text(errors="replace").split()
             if n.startswith(TENSORBOARD_EVENT_PREFIX) and "/" not in n]
    files = [listing.parent / n for n in names]
    return [f for f in files if f.is_file() and not f.is_symlink()] + [listing]


def _is_leftover(p: Path) -> bool:
    """A temp file of an atomic write (``.<name>.<random>.tmp``, ``name`` a file rlalign writes there) or a
    temp/old policy folder of save_model; never a link."""
    if p.is_symlink():
        return False
    temp = _TEMP_NAME.fullmatch(p.name)
    if temp:
        name = temp.group("name")
        return p.is_file() and (name in _ATOMIC_FILES or _step_of_file(name) is not None)
    return p.is_dir() and _POLICY_LEFTOVER.fullmatch(p.name) is not None


def remove_leftovers(path: Path) -> list[str]:
    """Delete what a killed run leaves: temp files, half-written policy folders, and the checkpoint a save
    put in place without recording it (see :func:`rlalign.train.run.checkpoint_files.unrecorded_pending`). Call only while
    holding the lock."""
    removed = []
    for folder in (path, path / "checkpoints"):
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if _is_leftover(p):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                removed.append(str(p.relative_to(path)))
    if (path / "checkpoints").is_dir():
        for p in unrecorded_pending(path / "checkpoints"):
            if p.name != PENDING_FILE:
                removed.append(str(p.relative_to(path)))
            p.unlink(missing_ok=True)
    return removed


__all__ = ["RUN_FILES", "RunDirError", "RunDirectory", "open_run_dir", "previous_run_files", "remove_leftovers"]
