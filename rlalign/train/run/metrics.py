"""``metrics.jsonl``: one JSON object per record, appended (flushed and fsynced) by :class:`MetricsWriter`.

Only its last line can be torn (a kill or a full disk mid-write): readers drop an unparseable last line and
report it; an unparseable line elsewhere is a corrupt file and is named with its line number. JSON has no
inf/NaN: such a value is written as null. The file is opened never through a link and never when it has another
hard link (:mod:`rlalign.models.ownership`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rlalign.contract.errors import RLAlignError
from rlalign.models.ownership import open_own_file
from rlalign.models.atomic import atomic_write, naming_the_file

# the W&B run id a run's trackers keep (rlalign.train.run.trackers.wandb_run_id): a file rlalign writes, so
# run.overwrite deletes it with the previous run's files and the new run gets a W&B run of its own
WANDB_ID_FILE = Path("wandb") / "rlalign-run-id"
# the TensorBoard event files a run wrote, one name per line (rlalign.train.run.trackers.TensorBoardTracker):
# run.overwrite deletes exactly these (and this list), so a new run's curves never mix with the old run's
TENSORBOARD_FILES = Path("tensorboard") / "rlalign-event-files"
TENSORBOARD_EVENT_PREFIX = "events.out.tfevents."


class MetricsCorrupt(RLAlignError):
    pass


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
            raise naming_the_file(exc, self.path) from None


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


class NoMetrics:
    """The metrics sink of the ranks that do not write (the writer writes metrics.jsonl)."""

    def write(self, record: dict) -> None:
        pass


__all__ = ["MetricsCorrupt", "MetricsWriter", "NoMetrics", "parse_metrics", "read_metrics"]
