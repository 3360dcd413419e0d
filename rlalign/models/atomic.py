"""Files written whole: a file rlalign writes appears whole or not at all.

Every such file (a run directory's checkpoints, manifest, config and metrics, a model folder's checksums.json, a
parity recording) goes through :func:`atomic_write` (temp file in the same folder, fsync, rename, the folder
fsynced), so a kill at any instant leaves either the old or the new file, never a torn one; the temp files such a
kill leaves in a run directory (``.<name>.<random>.tmp``) are removed at its next start
(:mod:`rlalign.train.run.directory`). Files get the mode an ordinary ``open()`` would give them
(:func:`default_file_mode`: 0666 less the umask), not the 0600 of a temp file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

TEMP_SUFFIX = ".tmp"   # atomic_write's temp files: ".<name>.<random>.tmp"


def process_umask() -> int:
    """The process umask (read from /proc; elsewhere by setting it and restoring it at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def default_file_mode(directory: bool = False) -> int:
    """The mode ``open()`` / ``mkdir()`` give a new file / folder: 0666 / 0777 less the umask."""
    return (0o777 if directory else 0o666) & ~process_umask()


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
        raise naming_the_file(exc, path) from None
    _fsync_dir(path.parent)
    return result


def naming_the_file(exc: BaseException, path: Path) -> BaseException:
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


__all__ = ["TEMP_SUFFIX", "atomic_write", "atomic_write_with", "naming_the_file", "default_file_mode", "process_umask"]
