"""Process groups: a small handle (:class:`Group`), set-up under torchrun, and local spawning.

gloo on CPU, NCCL on GPU (one process per GPU). ``spawn(fn, n)`` starts n local processes
(no torchrun needed) that rendezvous through a file in a fresh temp directory, runs
``fn(group, *args)`` in each and returns every rank's return value, in rank order.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlalign.contract.errors import RLAlignError


@dataclasses.dataclass(frozen=True)
class Group:
    """A process group and this process's place in it (pg None: the trivial group of one)."""
    pg: Any
    rank: int
    size: int

    @staticmethod
    def single() -> "Group":
        return Group(None, 0, 1)

    @staticmethod
    def world() -> "Group":
        return Group(dist.group.WORLD, dist.get_rank(), dist.get_world_size())


def default_backend(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_from_env(device: str = "cpu") -> Group:
    """Join the job torchrun set up (RANK / WORLD_SIZE / MASTER_ADDR in the environment)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RLAlignError("no torchrun environment (RANK/WORLD_SIZE unset): launch with "
                           "`torchrun --nproc-per-node N -m rlalign.cli.main ...`")
    if str(device).startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    if not dist.is_initialized():
        dist.init_process_group(default_backend(device))
    return Group.world()


def split(world: Group, tp: int) -> tuple[Group, Group]:
    """(tp group, dp group): TP groups are runs of ``tp`` consecutive ranks, DP groups take one rank
    of each. Every rank creates every group, in the same order (torch.distributed requires it)."""
    if world.size % tp:
        raise RLAlignError(f"world size {world.size} is not divisible by tp={tp}")
    if world.size == 1:
        return Group.single(), Group.single()
    tp_group = dp_group = None
    for start in range(0, world.size, tp):
        ranks = list(range(start, start + tp))
        pg = dist.new_group(ranks)
        if world.rank in ranks:
            tp_group = Group(pg, ranks.index(world.rank), tp)
    for offset in range(tp):
        ranks = list(range(offset, world.size, tp))
        pg = dist.new_group(ranks)
        if world.rank in ranks:
            dp_group = Group(pg, ranks.index(world.rank), len(ranks))
    return tp_group, dp_group


def _worker(rank: int, size: int, backend: str, rendezvous: str, out_dir: str, fn: Callable, args: tuple) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)   # N processes share the machine's cores
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    try:
        result = fn(Group.world(), *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    except RLAlignError as exc:   # bad input: the parent reports the one-line message, no traceback
        (Path(out_dir) / f"rank{rank}.error").write_text(str(exc))
        os._exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _exit_now()


def _exit_now() -> None:
    """Leave without the interpreter's teardown. Every rank's result is on disk and the barrier passed, so
    nothing is left to do; the teardown of the communication library's threads can abort a process
    ("terminate called without an active exception", seen at random with gloo on a loaded 2-core
    machine), and that must not turn a finished job into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable, nprocs: int, *args, backend: str = "gloo") -> list:
    """Run ``fn(world_group, *args)`` in ``nprocs`` fresh processes; returns their results by rank.
    ``fn`` must be importable (a module-level function); results must be picklable (CPU tensors)."""
    if backend == "nccl" and torch.cuda.device_count() < nprocs:
        raise RLAlignError(f"{nprocs} NCCL processes need {nprocs} GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="rlalign-dist-") as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        try:
            mp.start_processes(_worker, args=(nprocs, backend, rendezvous, tmp, fn, args), nprocs=nprocs,
                               start_method="spawn", join=True)
        except mp.ProcessExitedException:
            errors = sorted(Path(tmp).glob("rank*.error"))
            if errors:
                raise RLAlignError(f"{errors[0].stem}: {errors[0].read_text()}") from None
            raise
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]


__all__ = ["Group", "default_backend", "init_from_env", "split", "spawn"]
