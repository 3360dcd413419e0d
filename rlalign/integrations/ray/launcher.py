"""The driver of ``rlalign train ... launcher=ray``.

It starts a local Ray cluster (``ray.address`` unset) or joins one, places the trainer as a Ray actor
on the driver's own node (so ``run.dir`` is on the user's disk), and the trainer's
:class:`~rlalign.integrations.ray.pool.RolloutPool` places the rollout workers. The trainer runs the
ordinary loop (``rlalign.train.loop.run_training``): only its engine differs, so metrics, checkpoints
and weights are those of the single-process run, bit for bit (docs/ray.md). While it runs, the driver
follows ``metrics.jsonl`` for the progress bar. A dead actor ends the run with one line naming it and
the last checkpoint, which a dead actor never touches (checkpoints are written atomically).

The local cluster listens on the loopback interface only (:func:`loopback_only`): nothing outside the
machine can reach its GCS, raylet, workers, runtime-env agent or autoscaler monitor, and the dashboard is off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
import uuid
import warnings
from pathlib import Path

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.integrations.ray.errors import (ActorDiedError, RayLaunchError, death_errors, last_checkpoint_note,
                                            short_reason)
from rlalign.train.loop import run_training
from rlalign.train.run.logs import StepReporter


class TrainerActor:
    def __init__(self, threads: int):
        torch.set_num_threads(threads)

    def run(self, cfg) -> str:
        return str(run_training(cfg, console=None))


def run_training_on_ray(cfg, console=None) -> Path:
    """Run (or resume) the job with the trainer and rollout workers as Ray actors; returns the run directory."""
    ray = _import_ray()
    check_gpu_request(cfg.ray, cfg.model.device)
    cfg = with_absolute_paths(cfg)
    started_here = connect(ray, cfg.ray)
    trainer = None
    try:
        check_resources(ray, cfg.ray)
        trainer = ray.remote(TrainerActor).options(
            name=f"rlalign-trainer-{uuid.uuid4().hex[:8]}", num_cpus=cfg.ray.cpus_per_actor,
            num_gpus=cfg.ray.gpus_per_actor, max_restarts=0, scheduling_strategy=_this_node(ray),
        ).remote(max(1, int(cfg.ray.cpus_per_actor)))
        done = trainer.run.remote(cfg)
        _follow(ray, done, cfg, console)
        return Path(ray.get(done))
    except death_errors() as exc:
        raise ActorDiedError(f"the trainer actor died ({short_reason(exc)}); the run "
                             f"stopped; {last_checkpoint_note(cfg.run.dir)}") from None
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, RLAlignError):
            raise exc.cause from None
        raise
    finally:
        if trainer is not None:
            ray.kill(trainer)   # its rollout workers are owned by it and go with it
        if started_here:
            ray.shutdown()


def _import_ray():
    try:
        import ray   # lazy: an optional dependency (the ray extra), needed only for launcher=ray
    except ModuleNotFoundError:
        raise RayLaunchError("launcher=ray needs Ray: pip install 'rlalign[ray]' (or 'ray>=2.60')") from None
    return ray


def connect(ray, section) -> bool:
    """Start a local cluster (bound to loopback) or join ``section.address``; True when this call started Ray
    (and stops it)."""
    if ray.is_initialized():
        return False
    kwargs = dict(include_dashboard=False, logging_level="WARNING", log_to_driver=True)
    local = section.address is None
    if local:
        # Logical CPUs only schedule actors: a small machine still gets one trainer + N workers.
        needed = section.cpus_per_actor * (section.num_rollout_workers + 1)
        kwargs["num_cpus"] = max(os.cpu_count() or 1, int(needed + 0.999))
        kwargs["_node_ip_address"] = LOOPBACK
    else:
        probe(section.address)
        kwargs["address"] = section.address
    try:
        with loopback_only(ray) if local else contextlib.nullcontext():
            ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = section.address or "a local cluster"
        raise RayLaunchError(f"cannot start or reach Ray at {where}: {str(exc).strip().splitlines()[0]} "
                             "(check ray.address, or leave it unset for a local cluster)") from None
    if local:
        _check_loopback(ray)
    return True


# Ray binds its servers (GCS, raylet, core workers, runtime-env agent, autoscaler monitor) to 127.0.0.1 only when
# the node's IP is exactly 127.0.0.1, and otherwise to every interface. ray.init turns a loopback _node_ip_address
# into the machine's address unless Ray believes multi-node clusters are off, which the variable below says (Ray
# reads it when imported, into ray._private.ray_constants.ENABLE_RAY_CLUSTER); Ray's child processes inherit it.
LOOPBACK = "127.0.0.1"
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_only(ray):
    """While the local cluster starts: Ray takes 127.0.0.1 as this node's address (``SINGLE_NODE_ENV=0`` for the
    processes it starts, and its import-time flag for this one); both are restored afterwards."""
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    saved_env, saved_flag = os.environ.get(SINGLE_NODE_ENV), getattr(constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[SINGLE_NODE_ENV] = "0"
    if saved_flag is not None:
        constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop(SINGLE_NODE_ENV, None)
        else:
            os.environ[SINGLE_NODE_ENV] = saved_env
        if saved_flag is not None:
            constants.ENABLE_RAY_CLUSTER = saved_flag


def _check_loopback(ray) -> None:
    """Say so (one warning line) if this Ray version gave the local node another address than loopback."""
    address = ray.util.get_node_ip_address()
    if address != LOOPBACK:
        warnings.warn(f"the local Ray cluster's node address is {address}, not {LOOPBACK}: this Ray version ignores "
                      f"{SINGLE_NODE_ENV}=0, so its servers listen on every interface (docs/ray.md, Security)",
                      RuntimeWarning, stacklevel=3)


def probe(address: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT that does not answer fails in seconds (ray.init itself retries for minutes)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return   # "auto": Ray finds the local cluster's address itself, and says so quickly when there is none
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise RayLaunchError(f"cannot reach the Ray cluster at ray.address={address} ({exc.strerror or exc}); start "
                             "it with `ray start --head` there, fix ray.address, or leave it unset for a local cluster"
                             ) from None


def check_gpu_request(section, device: str) -> None:
    if not device.startswith("cuda"):
        return
    if section.gpus_per_actor == 0:
        raise RayLaunchError("model.device=cuda under launcher=ray needs GPUs for the actors: set ray.gpus_per_actor "
                             "(1 per actor; a fraction shares a GPU, with ray.weight_sync=object_store)")
    if section.gpus_per_actor < 1 and section.weight_sync != "object_store":
        raise RayLaunchError(f"ray.gpus_per_actor={section.gpus_per_actor:g} puts several actors on one GPU, where "
                             "NCCL cannot broadcast between them: set ray.weight_sync=object_store, or 1 GPU per actor")


def check_resources(ray, section) -> None:
    """Refuse up front a cluster that can never hold the actors (Ray would otherwise wait forever)."""
    have = ray.cluster_resources()
    actors = section.num_rollout_workers + 1
    for key, per_actor in (("CPU", section.cpus_per_actor), ("GPU", section.gpus_per_actor)):
        want = per_actor * actors
        if want > have.get(key, 0.0) + 1e-9:
            raise RayLaunchError(
                f"the Ray cluster has {have.get(key, 0.0):g} {key}s but the trainer and {section.num_rollout_workers} "
                f"rollout workers ask for {want:g} (ray.cpus_per_actor / ray.gpus_per_actor x {actors}); lower "
                "ray.num_rollout_workers or the per-actor amount, or add nodes")


def with_absolute_paths(cfg):
    """Actors do not share the driver's working directory: make every local path absolute first."""
    run_dir = Path(cfg.run.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}").expanduser().resolve()
    model = cfg.model.path if cfg.model.path == "default" else str(Path(cfg.model.path).expanduser().resolve())
    task = cfg.task
    for key in ("path", "eval_path"):
        if getattr(task, key):
            task = dataclasses.replace(task, **{key: str(Path(getattr(task, key)).expanduser().resolve())})
    rewards = [{**t, **({"reward_model": str(Path(t["reward_model"]).expanduser().resolve())} if "reward_model" in t
                        else {"name": _absolute_reward(t["name"])})} for t in task.rewards]
    task = dataclasses.replace(task, reward=_absolute_reward(task.reward), rewards=rewards)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(run_dir)),
                               model=dataclasses.replace(cfg.model, path=model), task=task)


def _absolute_reward(spec: str) -> str:
    """A ``file.py:function`` reward with the file's absolute path (other specs as they are)."""
    file_reward, sep, fn = spec.rpartition(":")
    return f"{Path(file_reward).expanduser().resolve()}:{fn}" if sep and file_reward.endswith(".py") else spec


def _this_node(ray):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy   # lazy: ray is optional
    # soft: a Ray-client driver (ray://) is not itself a node; the trainer then goes where Ray puts it.
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)


def _follow(ray, done, cfg, console) -> None:
    """Update the progress bar from metrics.jsonl until the trainer's ``run`` call returns (or fails)."""
    progress = StepReporter(cfg, console, 0)
    path, seen = Path(cfg.run.dir) / "metrics.jsonl", 0
    try:
        while not ray.wait([done], timeout=1.0)[0]:
            seen = _show_new_records(path, seen, progress)
        _show_new_records(path, seen, progress)
    finally:
        progress.close()


def _show_new_records(path: Path, seen: int, progress) -> int:
    if not path.exists():
        return seen
    lines = [line for line in path.read_text().split("\n")[:-1] if line.strip()]   # complete lines only
    for line in lines[seen:]:
        record = json.loads(line)
        if "reward/mean" in record:
            progress.update(record)
    return len(lines)
