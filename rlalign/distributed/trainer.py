"""Data-parallel training runs: process set-up for ``rlalign train parallel.dp=N``.

``rlalign train parallel.dp=2`` (no torchrun): :func:`launch` spawns 2 processes (gloo on CPU,
NCCL on GPU, one per GPU) that each run the ordinary training loop. Under
``torchrun --nproc-per-node 2 -m rlalign.cli.main train parallel.dp=2`` each process joins the
job torchrun set up. Either way every rank holds identical weights: rollouts and scoring are
replicated, each rank back-propagates its contiguous share of the step's micro-batches, and
:func:`rlalign.distributed.all_reduce_gradients_` sums the gradients (deterministic, rank order).
Rank 0 alone writes metrics, checkpoints and the final policy; the others resume from them.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch.distributed as dist

from rlalign.contract.errors import RLAlignError
from rlalign.distributed.launch import Group, default_backend, init_from_env, spawn


def needs_launch(cfg) -> bool:
    """True when this process must start the data-parallel job (dp > 1, no process group, no torchrun)."""
    return cfg.parallel.dp > 1 and not dist.is_initialized() and "RANK" not in os.environ


def data_parallel_group(cfg) -> Group:
    """The trainer's DP group (joining torchrun's job when needed); Group.single() for dp=1."""
    if cfg.parallel.dp == 1:
        return Group.single()
    if cfg.launcher != "local":
        raise RLAlignError(f"parallel.dp={cfg.parallel.dp} runs with launcher=local (got launcher={cfg.launcher})")
    world = Group.world() if dist.is_initialized() else init_from_env(cfg.model.device)
    if world.size != cfg.parallel.dp:
        raise RLAlignError(f"parallel.dp={cfg.parallel.dp} but the job has {world.size} processes: make them equal")
    return world


def shared_run_dir(cfg, group: Group) -> str:
    """Rank 0's run directory on every rank (a default timestamped name could differ across ranks)."""
    chosen = [cfg.run.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"]
    if group.size > 1:
        dist.broadcast_object_list(chosen, src=0, group=group.pg)
    return chosen[0]


class NoMetrics:
    """The metrics sink of data-parallel ranks > 0 (rank 0 writes metrics.jsonl)."""

    def write(self, record: dict) -> None:
        pass


def _worker(world: Group, cfg):
    from rich.console import Console

    from rlalign.train.loop import run_training
    return str(run_training(cfg, Console(stderr=True) if world.rank == 0 else None))


def launch(cfg) -> Path:
    """Spawn ``parallel.dp`` training processes; returns the run directory when they are done."""
    if cfg.launcher != "local":
        raise RLAlignError(f"parallel.dp={cfg.parallel.dp} runs with launcher=local (got launcher={cfg.launcher})")
    run = dataclasses.replace(cfg.run, dir=cfg.run.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = dataclasses.replace(cfg, run=run)
    return Path(spawn(_worker, cfg.parallel.dp, cfg, backend=default_backend(cfg.model.device))[0])


__all__ = ["NoMetrics", "needs_launch", "data_parallel_group", "shared_run_dir", "launch"]
