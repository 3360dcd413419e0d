"""What a training checkpoint holds, and how a resume puts it back.

A checkpoint (``checkpoints/step_N.pt``, written by :func:`rlalign.train.run.checkpoint_files.save_checkpoint`)
holds: ``model`` (the full weights; under TP gathered), ``optimizer`` (under TP every TP rank's state, a list),
``master`` and ``model_rounded`` with fp32 masters (a weight with a master is stored once, as the master:
:func:`rlalign.train.master.weights_to_store`), ``schedule`` (the learning-rate schedule's state),
``torch_rng``, ``step``, ``data_pos``, ``config`` (every key, as the run used it), ``reward_file`` (a reward file's
fingerprint), ``value`` / ``value_optimizer`` for PPO's value model, and with ``rollout.async_steps`` the samples
generated ahead (``async_rollout``: :class:`rlalign.train.sources.AsynchronousSource`; with ``run.verify_behaviour``
also ``behaviour_weights``, the weights of the versions that sampled them: :mod:`rlalign.train.offpolicy`). The writer rank saves for every rank.

With ``parallel.shard=grads`` (:mod:`rlalign.train.sharding`) each rank writes its ranges of the masters and AdamW
state to a part file of its own (``step_N.rankR.pt``); the main file then holds every model weight (no
``master``, ``model_rounded`` or ``optimizer``) and ``sharded``: the layout and the parts' sha256s. A resume at
any ``parallel.dp`` reads its ranges from the parts; a ``parallel.shard=none`` run (any ``parallel.dp``) gets them
assembled into the keys above; a sharded run also resumes from an unsharded checkpoint.

A resume (:meth:`TrainingState.load_latest`, then :meth:`TrainingState.restore`) checks the stored config against
this run's (:func:`rlalign.train.run.config_file.check_resume`), restacks the MoE experts of checkpoints written
with one parameter per expert, and loads everything back in place: the restored run continues bit for bit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from rlalign.distributed.launch import Group
from rlalign.train import parallel as par
from rlalign.train.master import ROUNDED_KEY, MasterWeights, full_masters, weights_to_store
from rlalign.train.sharding import ShardedMaster, unsharded_state
from rlalign.train.run.checkpoint_files import (CheckpointRefused, load_latest_checkpoint, load_part,
                                                note_pending_parts, part_in_the_way, save_checkpoint, save_part)
from rlalign.train.run.config_file import check_resume
from rlalign.train.update import PolicyUpdate


SHARDED_KEY = "sharded"    # a parallel.shard=grads checkpoint: its layout and {part file: sha256}
PARTS_KEY = "sharded_parts"   # (in memory only) the parts a sharded run loads its ranges from


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
        if isinstance(self.master, ShardedMaster):   # each rank's ranges in a part file of its own
            parts = self._save_part(run_dir, writer, step)
            if writer:
                self._write(run_dir, step, data_pos, extra, {"model": model, SHARDED_KEY: {
                    **self.master.layout(self.update.optimizer), "parts": parts}}, parts)
            return
        optimizer = par.optimizer_state(self.update.optimizer, self.tp)
        master = full_masters(self.master, self.policy) if self.master.active else None
        if not writer:
            return
        model, rounded = weights_to_store(model, master) if master is not None else (model, {})
        self._write(run_dir, step, data_pos, extra, {
            "model": model, "optimizer": optimizer,
            **({"master": master, ROUNDED_KEY: rounded} if master is not None else {})})

    def _save_part(self, run_dir: Path, writer: bool, step: int) -> dict[str, str]:
        """This rank's part file (parallel.shard=grads); every rank returns {part name: sha256} of all parts. The
        writer notes them all in pending.json before any is renamed into place; none replaces an existing file."""
        group = self.master.group
        problem = [part_in_the_way(run_dir, step, group.size) if writer else None]
        dist.broadcast_object_list(problem, src=dist.get_global_rank(group.pg, 0), group=group.pg)
        if problem[0] is not None:
            raise CheckpointRefused(problem[0])
        named: list = [None] * group.size

        def before_rename(mine: tuple[str, str]) -> None:
            dist.all_gather_object(named, mine, group=group.pg)
            if writer:
                note_pending_parts(run_dir, dict(named))
            dist.barrier(group=group.pg)

        save_part(run_dir, step, group.rank, self.master.part_state(self.update.optimizer), before_rename)
        dist.barrier(group=group.pg)   # every part in place before the main file names them
        return dict(named)

    def _write(self, run_dir: Path, step: int, data_pos: int, extra: "dict | None", weights: dict,
               parts: "dict[str, str] | None" = None) -> None:
        """The writer's main file: ``weights`` (the model / optimizer / master keys) and what every run shares."""
        value, value_optimizer = self.update.value, self.update.value_optimizer
        save_checkpoint(run_dir, step, {
            **weights,
            "schedule": self.update.lr.state_dict(), "torch_rng": torch.get_rng_state(),
            "step": step, "data_pos": data_pos, "config": dataclasses.asdict(self.cfg),
            **({"reward_file": self.reward_file} if self.reward_file else {}),
            **({"value": value.state_dict(), "value_optimizer": value_optimizer.state_dict()}
               if value is not None else {}), **(extra or {})}, keep=self.cfg.run.keep_checkpoints,
            facts={"reward": self.reward_file} if self.reward_file else None, parts=parts)

    def load_latest(self, run_dir: Path) -> dict | None:
        """The newest checkpoint's state in the policy's layout, its config checked against this run's (every
        key); None when the run has none."""
        state = load_latest_checkpoint(run_dir)
        if state is None:
            return None
        check_resume(state["config"], self.cfg, state.get("reward_file"))
        if SHARDED_KEY in state:   # written with parallel.shard=grads
            return with_parts(run_dir, state, sharded=isinstance(self.master, ShardedMaster))
        return par.restack_run_state(self.policy, state)   # MoE checkpoints written with per-expert parameters

    def restore(self, state: dict) -> tuple[int, int]:
        """Load ``state`` (from :meth:`load_latest`) into the live objects and the global RNG; returns the
        checkpoint's (step, data position)."""
        rounded = state.get(ROUNDED_KEY) or {}   # weights stored only as masters: set by the masters' load
        par.load_policy_weights(self.policy, state["model"], absent=rounded)
        if PARTS_KEY in state:   # a sharded checkpoint into a sharded run (any parallel.dp)
            self.master.load_parts(self.update.optimizer, state[SHARDED_KEY], state[PARTS_KEY])
        elif isinstance(self.master, ShardedMaster):   # an unsharded checkpoint into a sharded run
            self.master.load_state_dict(state.get("master"), rounded)
            self.master.load_optimizer_state(self.update.optimizer, state["optimizer"])
        else:
            self.master.load_state_dict(state.get("master"), rounded)
            par.load_optimizer_state(self.update.optimizer, state["optimizer"], self.tp)
        self.update.lr.load_state_dict(state["schedule"])
        torch.set_rng_state(state["torch_rng"])
        if self.update.value is not None:
            self.update.value.load_state_dict(state["value"])
            par.load_optimizer_state(self.update.value_optimizer, state["value_optimizer"], None)
        return state["step"], state["data_pos"]


def with_parts(run_dir: Path, state: dict, sharded: bool) -> dict:
    """A ``parallel.shard=grads`` checkpoint's state with its parts read (each verified by its sha256): for a
    ``sharded`` run the parts themselves (each rank reads its ranges), else assembled into the unsharded keys
    (``master`` with masters, ``optimizer``), the state a ``parallel.shard=none`` run restores at any degree."""
    layout = state[SHARDED_KEY]
    parts = [load_part(run_dir, name, sha256) for name, sha256 in layout["parts"].items()]
    if sharded:
        return {**state, PARTS_KEY: parts}
    shapes = {name: state["model"][name].shape for name in layout["names"]}
    masters, optimizer = unsharded_state(layout, parts, shapes)
    return {**state, "optimizer": optimizer, **({"master": masters} if masters else {})}


__all__ = ["TrainingState", "with_parts", "SHARDED_KEY"]
