"""May the CLI write, replace or delete here? The one owner of that decision.

Every command that writes (``train``'s run directory and its policy folder, ``export``, ``pretrain``,
``checksum``, ``report``, ``parity --report``) asks these functions before it changes anything, and
the answer is the same rule everywhere:

- **Write only where we own the place.** An output folder is one the command creates, an empty one,
  or one that holds only files the command itself writes (``owns`` says which: a model folder's
  config.json / safetensors / checksums.json / tokenizer files, a report's files). Anything else
  there is refused with one line naming it, before any work, and nothing is changed.
- **Replace only on request, and only our files.** An existing non-empty output is refused unless
  the command was asked to overwrite; even then a folder holding a foreign file is refused.
- **Never through a link.** An output that is a symbolic link is refused (the command would write
  where the link points); files opened for writing inside a run directory are opened with
  ``O_NOFOLLOW`` and must be plain files with a single hard link.
- **Never over what we read or where we stand.** An output that is, or contains, an input of the
  command (the checkpoint, its run directory, the base model) or the current directory is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, Iterable

from rlalign.contract.errors import RLAlignError

Owns = Callable[[Path], bool]   # does the command write this entry of its output folder (the entry's path)?


class OutputRefused(RLAlignError):
    """An output the command may not write, replace or delete; nothing was changed."""


def refuse_link(path: Path, what: str) -> None:
    """A symbolic link where a command would write is refused: it would write wherever the link points."""
    path = Path(path)
    if path.is_symlink():
        raise OutputRefused(f"{what} {path} is a symbolic link (to {os.readlink(path)}); rlalign never writes "
                            "through a link: give the real path, or remove the link")


def open_own_file(path: Path, flags: int, what: str, mode: int = 0o666) -> int:
    """``os.open`` of a file the command writes in place (a lock, an appended log): never through a
    symbolic link (``O_NOFOLLOW``) and only a plain file with one hard link (another link would make the
    write land in someone else's file)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if Path(path).is_symlink():
            raise OutputRefused(f"{what} {path} is a symbolic link (to {os.readlink(path)}); rlalign never "
                                "writes through a link: remove it") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        kind = "not a plain file" if not stat.S_ISREG(info.st_mode) else f"has {info.st_nlink} hard links"
        raise OutputRefused(f"{what} {path} is {kind}; rlalign writes only files of its own there: remove it")
    return fd


def foreign_entries(folder: Path, owns: Owns) -> list[str]:
    """Names of the entries of ``folder`` the command did not write: links, and what ``owns`` refuses."""
    return sorted(p.name for p in Path(folder).iterdir() if p.is_symlink() or not owns(p))


def check_output_folder(target: Path, *, what: str, owns: Owns, overwrite: bool,
                        reads: Iterable[Path] = (), hint: str = "") -> None:
    """Refuse ``target`` as a folder the command fills (and replaces, when it exists) unless it is new,
    empty, or (with ``overwrite``) holds only entries ``owns`` accepts. ``reads``: the command's inputs,
    which the output may neither be nor contain. Raises :class:`OutputRefused`; changes nothing."""
    target = Path(target)
    refuse_link(target, what)
    if target.exists() and not target.is_dir():
        raise OutputRefused(f"{what} {target} is a file, not a folder; choose a new folder (nothing was changed)")
    refuse_overlap(target, what, reads)
    if not target.exists() or not any(target.iterdir()):
        return
    foreign = foreign_entries(target, owns)
    if not overwrite:
        raise OutputRefused(f"{what} {target} already exists and is not empty; choose a new folder{hint} "
                            "(nothing was changed)")
    if foreign:
        raise OutputRefused(f"{what} {target} holds files rlalign did not write ({_shown(foreign)}); it replaces "
                            "only a folder of its own: choose a new folder (nothing was changed)")


def prepare_output_folder(target: Path, *, what: str, owns: Owns) -> Path:
    """A folder the command writes fixed-name files into (a report): created when missing; an existing one
    must hold only such files (``owns``). Returns the folder."""
    check_output_folder(target, what=what, owns=owns, overwrite=True)
    Path(target).mkdir(parents=True, exist_ok=True)
    return Path(target)


def refuse_overlap(target: Path, what: str, reads: Iterable[Path] = ()) -> None:
    """The output may not be (or contain) the current directory or one of the command's inputs."""
    resolved = Path(target).resolve()
    cwd = _cwd()
    if cwd is not None and _contains(resolved, cwd):
        where = "is the current directory" if resolved == cwd else "contains the current directory"
        raise OutputRefused(f"{what} {target} {where}; give a new folder (nothing was changed)")
    for source in reads:
        if source is not None and _contains(resolved, Path(source).resolve()):
            where = "is" if resolved == Path(source).resolve() else "contains"
            raise OutputRefused(f"{what} {target} {where} {source}, which this command reads; give a new folder "
                                "(nothing was changed)")


def _cwd() -> "Path | None":
    try:
        return Path.cwd().resolve()
    except OSError:   # the current directory was deleted: nothing to protect there
        return None


def _contains(folder: Path, path: Path) -> bool:
    return path == folder or folder in path.parents


def _shown(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


__all__ = ["OutputRefused", "Owns", "refuse_link", "open_own_file", "foreign_entries", "check_output_folder",
           "prepare_output_folder", "refuse_overlap"]
