"""Where a run's per-step metrics go besides ``metrics.jsonl`` (``run.loggers``).

- ``jsonl``: ``RUN_DIR/metrics.jsonl``, always written (the report and resume read it), our names.
- ``tensorboard``: ``RUN_DIR/tensorboard/`` event files (``torch.utils.tensorboard``; needs the
  ``tensorboard`` package: ``pip install rlalign[trackers]``). View: ``tensorboard --logdir RUN_DIR``.
  A resume from step S purges the killed run's events of steps > S (TensorBoard's ``purge_step``), so
  every step shows once; the event files a run wrote are listed in ``tensorboard/rlalign-event-files``
  and ``run.overwrite`` deletes exactly those.
- ``wandb``: Weights & Biases, files under ``RUN_DIR/wandb/``; ``WANDB_MODE=offline`` runs without a
  network or an account (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads later). The W&B run id is
  random, drawn when the run directory first logs to W&B and kept in ``RUN_DIR/wandb/rlalign-run-id``, so
  a resumed run continues the same W&B run and two runs never share one (two users' ``runs/exp1`` used to,
  when the id was the folder's name); the W&B display name is the folder's name.

``run.metric_names=verl|trl`` renames the metrics these trackers see to the names verl's or TRL's
trainers log (:data:`ALIASES`, table in docs/training.md); names without a counterpart keep ours.
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from pathlib import Path

from rlalign.contract.errors import RLAlignError
from rlalign.models.atomic import atomic_write
from rlalign.train.run.metrics import TENSORBOARD_EVENT_PREFIX, TENSORBOARD_FILES, WANDB_ID_FILE


class TrackerError(RLAlignError):
    pass


ALIASES: dict[str, dict[str, str]] = {
    "verl": {
        "reward/mean": "critic/score/mean", "reward/std": "critic/score/std", "reward/min": "critic/score/min",
        "reward/max": "critic/score/max", "advantage/mean": "critic/advantages/mean",
        "advantage/std": "critic/advantages/std", "completion/mean_len": "response_length/mean",
        "completion/min_len": "response_length/min", "completion/max_len": "response_length/max",
        "completion/truncated_frac": "response_length/clip_ratio", "loss/policy": "actor/pg_loss",
        "loss/kl": "actor/kl_loss", "kl/ref": "actor/kl_loss", "clip_frac": "actor/pg_clipfrac",
        "entropy": "actor/entropy", "grad_norm": "actor/grad_norm", "lr": "actor/lr", "loss/value": "critic/vf_loss",
        "time/rollout_s": "timing_s/gen", "time/train_s": "timing_s/update_actor", "time/eval_s": "timing_s/testing",
        "eval/accuracy": "val-core/acc/mean", "tokens_per_s/rollout": "perf/throughput", "kl/ppo": "actor/ppo_kl", "kl/policy_step": "actor/policy_step_kl",
    },
    "trl": {
        "reward/mean": "reward", "reward/std": "reward_std", "reward/zero_std_frac": "frac_reward_zero_std",
        "completion/mean_len": "completions/mean_length", "completion/min_len": "completions/min_length",
        "completion/max_len": "completions/max_length", "completion/truncated_frac": "completions/clipped_ratio",
        "kl/ref": "kl", "entropy": "entropy", "clip_frac": "clip_ratio/region_mean", "loss/policy": "loss",
        "grad_norm": "grad_norm", "lr": "learning_rate", "eval/accuracy": "eval_reward",
    },
}


def rename(record: dict, metric_names: str) -> dict:
    table = ALIASES.get(metric_names, {})
    out = {}
    for key, value in record.items():
        out.setdefault(table.get(key, key), value)   # loss/kl and kl/ref share verl's name: the first wins
    return out


def _scalars(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardTracker:
    def __init__(self, run_dir: Path, cfg, start_step: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrackerError("run.loggers includes tensorboard but the tensorboard package is not installed: "
                               "pip install tensorboard (or rlalign[trackers])") from None
        log_dir = Path(run_dir) / TENSORBOARD_FILES.parent
        before = _event_files(log_dir)
        # purge_step: TensorBoard hides what earlier files logged at steps >= it (a killed run's steps past
        # the checkpoint this run resumes from)
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step else None)
        _record_event_files(Path(run_dir), sorted(_event_files(log_dir) - before))   # the writer opens its file at once

    def log(self, record: dict, step: int) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, cfg, start_step: int = 0):   # a resume continues the W&B run of the stored id
        try:
            import wandb
        except ImportError:
            raise TrackerError("run.loggers includes wandb but the wandb package is not installed: pip install wandb "
                               "(or rlalign[trackers])") from None
        run_dir = Path(run_dir).resolve()
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rlalign"), dir=str(run_dir),
                                  id=wandb_run_id(run_dir), name=run_dir.name, resume="allow",
                                  config=dataclasses.asdict(cfg))
        except Exception as exc:   # wandb raises its own types (no login, no network, ...)
            raise TrackerError(f"wandb could not start ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                               "log in with `wandb login`, or set WANDB_MODE=offline to log to files") from None

    def log(self, record: dict, step: int) -> None:
        self.run.log(_scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()




def _event_files(log_dir: Path) -> set[str]:
    return {p.name for p in log_dir.glob(TENSORBOARD_EVENT_PREFIX + "*")} if log_dir.is_dir() else set()


def _record_event_files(run_dir: Path, new: list[str]) -> None:
    """Add ``new`` (event files this run's writer opened) to the run's list of its own event files."""
    path = run_dir / TENSORBOARD_FILES
    names = path.read_text().split() if path.is_file() else []
    atomic_write(path, "".join(n + "\n" for n in dict.fromkeys([*names, *new])).encode())


def wandb_run_id(run_dir: Path) -> str:
    """The run directory's W&B run id: the one stored in ``RUN_DIR/wandb/rlalign-run-id`` (a resume continues
    that W&B run), else a new random one (32 hex digits) written there first, atomically."""
    path = Path(run_dir) / WANDB_ID_FILE
    if path.exists():
        stored = path.read_text().strip()
        if stored:
            return stored
    run_id = uuid.uuid4().hex
    atomic_write(path, (run_id + "\n").encode())
    return run_id


# name (rlalign.train.config.LOGGERS, in that order) -> tracker class(run_dir, cfg, start_step); jsonl is
# MetricsWriter's file, always written.
TRACKERS: dict[str, type | None] = {"jsonl": None, "tensorboard": TensorBoardTracker, "wandb": WandbTracker}


class Trackers:
    """The run's trackers besides metrics.jsonl: one ``log`` per metrics record, renamed per ``run.metric_names``."""

    def __init__(self, run_dir: Path, cfg, start_step: int = 0):
        """``start_step``: the step the run resumes after (0: a fresh run)."""
        self.metric_names = cfg.run.metric_names
        self.trackers = []
        for name in dict.fromkeys(cfg.run.loggers):
            cls = TRACKERS[name]
            if cls is not None:
                self.trackers.append(cls(run_dir, cfg, start_step))

    def log(self, record: dict) -> None:
        renamed = rename(record, self.metric_names)
        for tracker in self.trackers:
            tracker.log(renamed, int(record["step"]))

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


__all__ = ["ALIASES", "TRACKERS", "Trackers", "TrackerError", "rename", "wandb_run_id"]
