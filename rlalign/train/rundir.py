"""The run directory's lifecycle: who may use it, what a fresh run and a resume find there.

- **One training at a time.** :func:`open_run_dir` takes an exclusive ``flock`` on
  ``RUN_DIR/.lock`` for the life of the process (the kernel drops it when the process ends, even by
  SIGKILL, so a lock left by a dead process is never in the way); the file records pid, host and
  start time, which the refusal message quotes. A second training in the same directory stops at
  once with one line.
- **A fresh run** (``run.resume=false``) needs a missing or empty directory. A directory holding a
  previous run is refused unless ``run.overwrite=true``, which deletes that run's files
  (:data:`RUN_FILES`) and nothing else.
- **A resume** (``run.resume=true``) needs ``checkpoints/latest.json``; without it the run stops
  (it never restarts at step 0 over the old metrics).
- **Leftovers** of a killed run (temp files of atomic writes, ``.policy.tmp-*`` / ``.policy.old-*``
  folders, checkpoint files newer than ``latest.json``) are removed at the next start, after the lock
  is held.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from rlalign.contract.errors import RLAlignError
from rlalign.train.runio import TEMP_SUFFIX

LOCK_NAME = ".lock"
# What a run writes at the top of its directory; run.overwrite=true deletes exactly these.
RUN_FILES = ("checkpoints", "metrics.jsonl", "policy", "report.png", "report.md", "config.yaml")


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


def open_run_dir(path: Path, *, resume: bool, overwrite: bool) -> RunDirectory:
    """Create/lock ``path`` and bring it to the state a fresh run or a resume expects."""
    path = Path(path)
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
        if resume:
            if not (path / "checkpoints" / "latest.json").is_file():
                raise RunDirError(f"run.resume=true but {path} holds no checkpoint (checkpoints/latest.json); "
                                  "start a fresh run without run.resume (add run.overwrite=true to replace its files)")
        else:
            _prepare_fresh(path, overwrite)
        removed = remove_leftovers(path)
    except BaseException:
        os.close(fd)
        raise
    return RunDirectory(path, fd, removed, created)


def _lock(path: Path) -> int:
    lock_path = path / LOCK_NAME
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
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


def _prepare_fresh(path: Path, overwrite: bool) -> None:
    present = sorted(p.name for p in path.iterdir() if p.name != LOCK_NAME and not _is_leftover(p))
    if not present:
        return
    if not overwrite:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise RunDirError(f"run.dir {path} is not empty ({shown}); continue its run with run.resume=true, replace "
                          "it with run.overwrite=true, or choose another run.dir (nothing was changed)")
    for name in RUN_FILES:
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()


def _is_leftover(p: Path) -> bool:
    name = p.name
    return (name.startswith(".") and name.endswith(TEMP_SUFFIX)) or name.startswith((".policy.tmp-", ".policy.old-"))


def remove_leftovers(path: Path) -> list[str]:
    """Delete what a killed run leaves: temp files, half-written policy folders, checkpoints newer than
    ``latest.json`` (written, never recorded). Call only while holding the lock."""
    removed = []
    for folder in (path, path / "checkpoints"):
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if _is_leftover(p):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                removed.append(str(p.relative_to(path)))
    removed += _unrecorded_checkpoints(path / "checkpoints")
    return removed


def _unrecorded_checkpoints(ckpt_dir: Path) -> list[str]:
    manifest = ckpt_dir / "latest.json"
    if not manifest.is_file():
        return []
    try:
        recorded = json.loads(manifest.read_text(encoding="utf-8"))
        last_step = int(recorded["step"])
    except (ValueError, KeyError, TypeError):
        return []   # load_latest_checkpoint names the problem
    out = []
    for p in ckpt_dir.glob("step_*.pt"):
        step = p.stem.removeprefix("step_")
        if step.isdigit() and int(step) > last_step:
            p.unlink()
            out.append(f"checkpoints/{p.name}")
    return out


__all__ = ["RUN_FILES", "RunDirError", "RunDirectory", "open_run_dir", "remove_leftovers"]
