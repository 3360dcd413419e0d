"""Host <-> device copies of a decode step that do not make the host wait for the device.

On CUDA a ``tensor.cpu()`` or a copy from pageable host memory waits for everything queued on the stream;
with overlapped scheduling (docs/rollout.md) the host must queue step t+1 before it waits for step t. So a
step's results go to the host through :class:`Readback` (pinned memory, ``non_blocking``, an event to wait
on later), and the decode graphs' static inputs are filled from pinned staging buffers
(:class:`Uploader`). On the CPU both are plain copies (the device is the host).

A step's sampled tokens, their fp32 logprobs and its device verdicts travel in ONE int64 tensor
(:func:`pack_results`): the logprobs' bits as int32 widened to int64 (exact both ways), the verdicts as 0/1.
"""

from __future__ import annotations

import numpy as np
import torch

from rlalign.contract.errors import fail


class Readback:
    """A device tensor's copy to the host, started now, waited for in :meth:`wait`."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            # a copy: a decode graph's static output is overwritten by the next run
            self.host, self.event = tensor.clone(), None

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def pack_results(tokens: torch.Tensor, logprobs: torch.Tensor, verdicts: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [2n + m]: tokens, the logprobs' fp32 bits, then ``verdicts`` (bool [m], True = check passed)."""
    parts = [tokens.to(torch.int64), logprobs.view(torch.int32).to(torch.int64)]
    if verdicts is not None:
        parts.append(verdicts.to(torch.int64))
    return torch.cat(parts)


def unpack_results(host: torch.Tensor, n: int, verdict_messages: list[tuple[str, str]] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int64 [n], logprobs fp32 [n]) of :func:`pack_results`; raises the first failed verdict's
    ContractError (``verdict_messages``: (op, message) per verdict, in order)."""
    values = host.numpy()
    if verdict_messages:
        passed = values[2 * n:]
        bad = np.flatnonzero(passed == 0)
        if bad.size:
            op, message = verdict_messages[int(bad[0])]
            raise fail(op, f"{message} (detected on the device after the decode graph's replay)")
    return values[:n], values[n:2 * n].astype(np.int32).view(np.float32)


class Uploader:
    """Copies host arrays into device buffers without waiting for the device.

    CUDA: through pinned staging buffers, ``non_blocking``; two sets used in turn, each guarded by an event
    recorded after its copies (a set is refilled only once the copies that read it last have run: by
    then the step before has completed anyway, so the wait is free). CPU: plain copies."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._sets: list[dict[int, torch.Tensor]] = [{}, {}]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def copy(self, pairs: list[tuple[torch.Tensor, np.ndarray]]) -> None:
        """``dst.copy_(src)`` for each (device tensor ``dst``, numpy ``src`` of dst's shape)."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(torch.from_numpy(np.ascontiguousarray(src)))
            return
        turn = self._turn
        self._turn ^= 1
        if self._events[turn] is not None:
            self._events[turn].synchronize()
        staging = self._sets[turn]
        for i, (dst, src) in enumerate(pairs):
            flat = torch.from_numpy(np.ascontiguousarray(src)).reshape(-1)
            buf = staging.get(i)
            if buf is None or buf.dtype != flat.dtype or buf.numel() < flat.numel():
                buf = staging[i] = torch.empty(max(flat.numel(), 1), dtype=flat.dtype, pin_memory=True)
            view = buf[:flat.numel()]
            view.copy_(flat)
            dst.copy_(view.view(src.shape), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[turn] = event


__all__ = ["Readback", "Uploader", "pack_results", "unpack_results"]
