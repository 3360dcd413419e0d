"""Data parallelism: each rank accumulates the gradients of its own micro-batches, then one
deterministic all-reduce sums them across ranks.

all_reduce_gradients_ flattens every parameter's gradient (fp32; a missing gradient counts as
zeros, so the layout is the same on every rank), sums the ranks' copies with
collectives.all_reduce_fixed (all-to-all, fixed-tree merge in rank order, all-gather) and writes
the sum back, one rounding to the parameter dtype. Every rank ends with the same bits, and the
result is run-to-run identical. It equals a single process that accumulates each rank's
micro-batches into a separate buffer and merges the buffers with the same tree
(:func:`tree_reduce`); it is not the bits of one process accumulating all micro-batches in one
buffer (fp32 addition is not associative) -- docs/distributed.md.
"""

from __future__ import annotations

from typing import Iterable

import torch

from rlalign.distributed.collectives import all_reduce_fixed
from rlalign.distributed.launch import Group


@torch.no_grad()
def all_reduce_gradients_(params: Iterable[torch.nn.Parameter], group: Group) -> None:
    """Sum ``params``' gradients over ``group`` in place, deterministically (see the module docstring)."""
    params = [p for p in params if p.requires_grad]
    if group.size == 1 or not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
    summed = all_reduce_fixed(flat, group)
    offset = 0
    for p in params:
        n = p.numel()
        value = summed[offset:offset + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = value
        else:
            p.grad.copy_(value)
        offset += n


def shard_for_rank(items: list, group: Group) -> list:
    """The contiguous share of ``items`` that data-parallel rank ``group.rank`` processes."""
    per, extra = divmod(len(items), group.size)
    start = group.rank * per + min(group.rank, extra)
    return items[start:start + per + (group.rank < extra)]


__all__ = ["all_reduce_gradients_", "shard_for_rank"]
