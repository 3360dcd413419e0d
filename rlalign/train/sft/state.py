"""What an SFT checkpoint holds, and how a resume puts it back (the RL run's format where the two share a key).

``checkpoints/step_N.pt`` (written by :func:`rlalign.train.run.checkpoint_files.save_checkpoint`: streamed,
sha256-recorded, never over a file the run did not write) holds ``model`` (weights without an fp32 master),
``master`` + ``model_rounded`` (fp32 masters of low-precision weights; :func:`rlalign.train.master.weights_to_store`),
``optimizer``, ``schedule``, ``torch_rng``, ``step``, ``config`` (every key, as the run used it) and ``data``
(the sha256 of each data file). A resume (:func:`restore`) refuses a config that changes a key outside
:data:`~rlalign.train.sft.config.RESUME_FREE` and data files that changed, then loads everything in place: the
restored run continues bit for bit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rlalign.configlib import ConfigError, flatten
from rlalign.train import parallel as par
from rlalign.train.master import ROUNDED_KEY, weights_to_store
from rlalign.train.run.checkpoint_files import load_latest_checkpoint, save_checkpoint
from rlalign.train.sft.config import RESUME_FREE, SFTConfig
from rlalign.train.sft.update import SFTUpdate


def save(run_dir: Path, cfg: SFTConfig, model, update: SFTUpdate, step: int, data_sha256: dict) -> None:
    model_weights = par.policy_weights(model)
    master = update.master.state_dict() if update.master.active else None
    model_weights, rounded = weights_to_store(model_weights, master) if master is not None else (model_weights, {})
    save_checkpoint(run_dir, step, {
        "model": model_weights, **({"master": master, ROUNDED_KEY: rounded} if master is not None else {}),
        "optimizer": update.optimizer.state_dict(), "schedule": update.lr.state_dict(),
        "torch_rng": torch.get_rng_state(), "step": step, "config": dataclasses.asdict(cfg), "data": data_sha256},
        keep=cfg.run.keep_checkpoints)


def check_resume(saved: dict, cfg: SFTConfig, saved_data: dict, data_sha256: dict) -> None:
    """Refuse a resume that would change what the run optimises: a changed key outside RESUME_FREE, or a data
    file whose bytes changed."""
    old, new = flatten(saved), flatten(cfg)
    changed = [f"{k}: {old[k]!r} -> {new[k]!r}" for k in new if k in old and old[k] != new[k] and k not in RESUME_FREE]
    if changed:
        raise ConfigError(f"run.resume=true would change what the run optimises ({', '.join(changed)}); resume "
                          "without changing them (config.yaml in the run directory lists the run's values)")
    moved = [name for name, sha in data_sha256.items() if saved_data.get(name) != sha]
    if moved:
        raise ConfigError(f"run.resume=true: {', '.join(moved)} changed since the checkpoint (sha256 differs); "
                          "the run must read the data it started with")


def restore(run_dir: Path, cfg: SFTConfig, model, update: SFTUpdate, data_sha256: dict) -> int:
    """Load the newest checkpoint into ``model`` and ``update`` and the global RNG; its step (0: none)."""
    state = load_latest_checkpoint(run_dir)
    if state is None:
        return 0
    check_resume(state["config"], cfg, state.get("data", {}), data_sha256)
    rounded = state.get(ROUNDED_KEY) or {}
    par.load_policy_weights(model, state["model"], absent=rounded)
    update.master.load_state_dict(state.get("master"), rounded)
    par.load_optimizer_state(update.optimizer, state["optimizer"], None)
    update.lr.load_state_dict(state["schedule"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


__all__ = ["save", "restore", "check_resume"]
