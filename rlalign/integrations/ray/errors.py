"""Errors of the Ray launcher, and the note on the run's last checkpoint that a failed run prints."""

from __future__ import annotations

import json
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
