"""What a training checkpoint holds, and how a resume puts it back.

A checkpoint (``checkpoints/step_N.pt``, written by :func:`rlalign.train.run.checkpoint_files.save_checkpoint`)
holds: ``model`` (the full weights; under TP gathered), ``optimizer`` (under TP every TP rank's state, a list; with
``parallel.shard=grads`` gathered from the ranks' ranges into the unsharded state dict, so the file is the one an
unsharded run writes and resumes at any ``parallel.dp`` and ``parallel.shard``),
``master`` and ``model_rounded`` with fp32 masters (a weight with a master is stored once, as the master:
:func:`rlalign.train.master.weights_to_store`), ``schedule`` (the learning-rate schedule's state),
``torch_rng``, ``step``, ``data_pos``, ``config`` (every key, as the run used it), ``reward_file`` (a reward file's
fingerprint), ``value`` / ``value_optimizer`` for PPO's value model, and with ``rollout.async_steps`` the samples
generated ahead (``async_rollout``; with ``run.verify_behaviour`` also ``behaviour_weights``, the weights of the
versions that sampled them: :mod:`rlalign.train.offpolicy`). The writer rank saves for every rank.

A resume (:meth:`TrainingState.load_latest`, then :meth:`TrainingState.restore`) checks the stored config against
this run's (:func:`rlalign.train.run.config_file.check_resume`), restacks the MoE experts of checkpoints written
with one parameter per expert, and loads everything back in place: the restored run continues bit for bit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rlalign.distributed.launch import Group
from rlalign.train import parallel as par
from rlalign.train.master import ROUNDED_KEY, MasterWeights, full_masters, weights_to_store
from rlalign.train.sharding import ShardedMaster
from rlalign.train.run.checkpoint_files import load_latest_checkpoint, save_checkpoint
from rlalign.train.run.config_file import check_resume
from rlalign.train.update import PolicyUpdate


@dataclasses.dataclass
class TrainingState:
    """The live objects a checkpoint covers (references, not copies): the policy, its masters, its update's
    optimizers and schedule, and the run's config."""
    cfg: object
    policy: torch.nn.Module
    master: "MasterWeights | ShardedMaster"
    update: PolicyUpdate
    tp: Group | None
    reward_file: dict | None

    def save(self, run_dir: Path, writer: bool, step: int, data_pos: int, extra: "dict | None" = None) -> None:
        """Checkpoint ``step``. Every rank takes part in gathering the state (TP); the writer writes it. ``extra``:
        more keys of plain data (asynchronous steps: the samples generated ahead, rlalign.train.offpolicy)."""
        model = par.policy_weights(self.policy)
        if isinstance(self.master, ShardedMaster):   # gathered to the writer in the unsharded format
            optimizer = self.master.optimizer_state(self.update.optimizer, keep=writer)
            master = self.master.full_masters(keep=writer) if self.master.active else None
        else:
            optimizer = par.optimizer_state(self.update.optimizer, self.tp)
            master = full_masters(self.master, self.policy) if self.master.active else None
        if not writer:
            return
        model, rounded = weights_to_store(model, master) if master is not None else (model, {})
        value, value_optimizer = self.update.value, self.update.value_optimizer
        save_checkpoint(run_dir, step, {
            "model": model, "optimizer": optimizer,
            **({"master": master, ROUNDED_KEY: rounded} if master is not None else {}),
            "schedule": self.update.lr.state_dict(), "torch_rng": torch.get_rng_state(),
            "step": step, "data_pos": data_pos, "config": dataclasses.asdict(self.cfg),
            **({"reward_file": self.reward_file} if self.reward_file else {}),
            **({"value": value.state_dict(), "value_optimizer": value_optimizer.state_dict()}
               if value is not None else {}), **(extra or {})}, keep=self.cfg.run.keep_checkpoints,
            facts={"reward": self.reward_file} if self.reward_file else None)

    def load_latest(self, run_dir: Path) -> dict | None:
        """The newest checkpoint's state in the policy's layout, its config checked against this run's (every
        key); None when the run has none."""
        state = load_latest_checkpoint(run_dir)
        if state is None:
            return None
        check_resume(state["config"], self.cfg, state.get("reward_file"))
        return par.restack_run_state(self.policy, state)   # MoE checkpoints written with per-expert parameters

    def restore(self, state: dict) -> tuple[int, int]:
        """Load ``state`` (from :meth:`load_latest`) into the live objects and the global RNG; returns the
        checkpoint's (step, data position)."""
        rounded = state.get(ROUNDED_KEY) or {}   # weights stored only as masters: set by the masters' load
        par.load_policy_weights(self.policy, state["model"], absent=rounded)
        self.master.load_state_dict(state.get("master"), rounded)
        if isinstance(self.master, ShardedMaster):
            self.master.load_optimizer_state(self.update.optimizer, state["optimizer"])
        else:
            par.load_optimizer_state(self.update.optimizer, state["optimizer"], self.tp)
        self.update.lr.load_state_dict(state["schedule"])
        torch.set_rng_state(state["torch_rng"])
        if self.update.value is not None:
            self.update.value.load_state_dict(state["value"])
            par.load_optimizer_state(self.update.value_optimizer, state["value_optimizer"], None)
        return state["step"], state["data_pos"]


__all__ = ["TrainingState"]
