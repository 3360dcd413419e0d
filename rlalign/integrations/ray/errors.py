"""Errors of the Ray launcher, and the note on the run's last checkpoint that a failed run prints."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rlalign.contract.errors import RLAlignError


class RayLaunchError(RLAlignError):
    """Ray is missing, the cluster cannot be reached or cannot hold the actors asked for."""


class ActorDiedError(RLAlignError):
    """A rollout worker or the trainer actor died; the run stopped (its last checkpoint is intact)."""


def last_checkpoint_note(run_dir: "str | Path | None") -> str:
    """'the last checkpoint (step N in DIR) is intact; continue with run.resume=true', or that there is none."""
    if run_dir is None:
        return "no checkpoint was written"
    latest = Path(run_dir) / "checkpoints" / "latest.json"
    if not latest.is_file():
        return f"no checkpoint was written in {run_dir}; start again"
    step = json.loads(latest.read_text()).get("step")
    return (f"the last checkpoint (step {step} in {run_dir}/checkpoints) is intact; continue with "
            f"run.dir={run_dir} run.resume=true")


def short_reason(exc) -> str:
    """The first line of a Ray error, without its terminal colour codes."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()
    return text[0].strip().rstrip(".") if text else type(exc).__name__


def death_errors():
    """The Ray errors that mean an actor (its process or node) is gone, not that its code raised."""
    from ray import exceptions as rx   # lazy: ray is optional (the ray extra)
    return (rx.RayActorError, rx.OutOfMemoryError, rx.WorkerCrashedError, rx.NodeDiedError)
