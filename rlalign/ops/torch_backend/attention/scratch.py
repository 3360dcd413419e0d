"""Per-thread scratch buffers (CPU): the big temporaries of an attention call are reused instead of allocated.

Speed only: a buffer's contents are undefined unless the caller asks for a known fill, and no bit depends on
which buffer a call gets.
"""

from __future__ import annotations

import threading

import torch

_scratch = threading.local()


class _Scratch:
    """One per-thread scratch buffer: the storage, its views by shape, and what is known of its
    contents: ``fill`` = (trailing shape, value, r, n) when view[:n, r:] holds ``value``."""

    def __init__(self, numel: int, device: torch.device):
        self.buf = torch.empty(numel, dtype=torch.float32, device=device)
        self.views: dict = {}
        self.fill = None


def scratch_buffer(name: str, shape: tuple, device: torch.device, fill: tuple | None = None) -> torch.Tensor:
    """A contiguous fp32 [shape] view of a per-thread scratch buffer, contents undefined; with
    ``fill`` = (value, r), rows r.. of dim 1 hold ``value`` (the caller then writes only rows < r, so
    the next call with the same trailing shape and value finds them still there and skips the fill).
    Fresh off the CPU (the caching allocator is cheap there). One name is one buffer: a caller
    never holds two views of one name at once."""
    if device.type != "cpu":
        out = torch.empty(shape, dtype=torch.float32, device=device)
        if fill is not None:
            out[:, fill[1]:] = fill[0]
        return out
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    # a buffer made under torch.inference_mode is an inference tensor: no in-place writes outside it
    name = (name, torch.is_inference_mode_enabled())
    entry = bufs.get(name)
    view = None if entry is None else entry.views.get(shape)
    if view is None:
        numel = 1
        for s in shape:
            numel *= s
        if entry is None or entry.buf.numel() < numel:
            entry = bufs[name] = _Scratch(numel, device)
        if len(entry.views) >= 32:
            entry.views.clear()
        view = entry.views[shape] = entry.buf[:numel].view(shape)
    if fill is None:
        entry.fill = None
        return view
    value, r = fill
    known = entry.fill
    if known is not None and known[0] == shape[1:] and known[1] == value and r >= known[2] and shape[0] <= known[3]:
        entry.fill = (shape[1:], value, r, known[3])
    else:
        view[:, r:] = value
        entry.fill = (shape[1:], value, r, shape[0])
    return view
