"""Trainer -> rollout workers weight sync after every optimizer step.

``object_store`` (CPU default): one ``ray.put`` of the state dict (CPU tensors, pickled bit for bit);
every worker reads that one object and copies it into its engine.

``broadcast`` (cuda default): trainer (rank 0) and the N workers (ranks 1..N) form their own process
group at start (a TCPStore on the trainer's node; NCCL on cuda, gloo on cpu), separate from any
default group the trainer uses for its own parallelism. Each update broadcasts every tensor of the
state dict from rank 0 in state-dict order; a broadcast copies bytes, so workers get the same bits.
The sends run on a helper thread while the trainer waits on the workers' receive calls, so a worker
that dies mid-update is reported at once instead of hanging the collective.
"""

from __future__ import annotations

import datetime
import socket
import threading
from typing import Callable

import torch
import torch.distributed as dist

# A collective that waits this long for a peer fails instead of hanging (gloo/NCCL timeout).
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def choose_weight_sync(mode: str, device: str):
    if mode == "auto":
        mode = "broadcast" if device.startswith("cuda") else "object_store"
    if mode == "object_store":
        return ObjectStoreSync()
    return BroadcastSync("nccl" if device.startswith("cuda") else "gloo")


class ObjectStoreSync:
    name = "object_store"

    def start(self, workers, wait: Callable) -> None:
        pass

    def push(self, workers, state_dict, version: int, wait: Callable) -> None:
        import ray   # lazy: ray is optional (the ray extra)
        ref = ray.put({name: t.detach().cpu() for name, t in state_dict.items()})
        wait([w.load_weights.remote(ref, version) for w in workers], "load_weights")


class BroadcastSync:
    def __init__(self, backend: str):
        self.backend = backend
        self.name = f"broadcast ({backend})"
        self.group = None

    def start(self, workers, wait: Callable) -> None:
        import ray   # lazy: ray is optional (the ray extra)
        host, port = ray.util.get_node_ip_address(), _free_port()
        world = len(workers) + 1
        joins = [w.join_weight_group.remote(host, port, rank, world, self.backend)
                 for rank, w in enumerate(workers, start=1)]
        self.group = open_group(host, port, 0, world, self.backend)   # blocks until every worker has joined
        wait(joins, "join_weight_group")

    def push(self, workers, state_dict, version: int, wait: Callable) -> None:
        tensors = [(name, t.detach().contiguous()) for name, t in state_dict.items()]
        meta = [(name, tuple(t.shape), t.dtype) for name, t in tensors]
        receives = [w.receive_weights.remote(meta, version) for w in workers]
        failure: list[BaseException] = []
        sender = threading.Thread(target=self._send, args=([t for _, t in tensors], failure), daemon=True)
        sender.start()
        wait(receives, "receive_weights")   # a dead worker raises here while the sender may still block
        sender.join()
        if failure:
            raise failure[0]

    def _send(self, tensors: list[torch.Tensor], failure: list) -> None:
        try:
            for t in tensors:
                broadcast(self.group, t)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            failure.append(exc)


def open_group(host: str, port: int, rank: int, world: int, backend: str):
    """A process group of its own (not the default one): a TCPStore served by rank 0, then gloo or NCCL."""
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=GROUP_TIMEOUT)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, GROUP_TIMEOUT)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = GROUP_TIMEOUT
    return dist.ProcessGroupNCCL(store, rank, world, options)


def broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def receive_into(group, meta, device) -> dict[str, torch.Tensor]:
    """The worker side of :meth:`BroadcastSync.push`: one buffer per tensor, filled in the same order."""
    out = {}
    for name, shape, dtype in meta:
        buf = torch.empty(shape, dtype=dtype, device=device)
        broadcast(group, buf)
        out[name] = buf
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
