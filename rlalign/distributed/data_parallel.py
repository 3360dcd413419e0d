"""Data parallelism: each rank accumulates the gradients of its own micro-batches, then one
deterministic all-reduce sums them across ranks.

all_reduce_gradients_ flattens the parameters' gradients (fp32; a missing gradient counts as
zeros, so the layout is the same on every rank) in buckets of consecutive parameters, sums each
bucket's copies across ranks with collectives.all_reduce_fixed (all-to-all, fixed-tree merge in rank
order, all-gather) and writes the sum back, one rounding to the parameter dtype. Every rank ends with
the same bits, and the result is run-to-run identical. The bucket size changes no bit (each element is
the tree of its ranks' values, wherever it sits in a buffer); it bounds the memory of the exchange to a
few fp32 copies of one bucket (or of the largest parameter) instead of the whole model. It equals a single process that accumulates each rank's
micro-batches into a separate buffer and merges the buffers with the same tree
(:func:`tree_reduce`); it is not the bits of one process accumulating all micro-batches in one
buffer (fp32 addition is not associative) -- docs/distributed.md.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from rlalign.distributed.collectives import all_reduce_fixed, gather_ranks, tree_reduce
from rlalign.distributed.launch import Group


# elements per exchange: 1 GiB of fp32 (an 8B model's gradients in ~30 buckets instead of one 32 GB buffer)
DEFAULT_BUCKET_ELEMENTS = 2 ** 28


@torch.no_grad()
def all_reduce_gradients_(params: Iterable[torch.nn.Parameter], group: Group,
                          bucket_elements: int = DEFAULT_BUCKET_ELEMENTS) -> None:
    """Sum ``params``' gradients over ``group`` in place, deterministically (see the module docstring), in
    buckets of at most ``bucket_elements`` elements (a larger parameter is a bucket of its own)."""
    if bucket_elements < 1:
        raise ValueError(f"bucket_elements must be >= 1, got {bucket_elements}")
    params = [p for p in params if p.requires_grad]
    if group.size == 1 or not params:
        return
    for bucket in _buckets(params, bucket_elements):
        _all_reduce_bucket_(bucket, group)


def _buckets(params: list, limit: int):
    """Consecutive parameters, at most ``limit`` elements per bucket; the same buckets on every rank."""
    bucket, size = [], 0
    for p in params:
        if bucket and size + p.numel() > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        yield bucket


def _all_reduce_bucket_(params: list, group: Group) -> None:
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
    summed = all_reduce_fixed(flat, group)
    del flat
    offset = 0
    for p in params:
        n = p.numel()
        value = summed[offset:offset + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = value
        else:
            p.grad.copy_(value)
        offset += n


def sum_scalars(values: dict[str, float], group: Group) -> dict[str, float]:
    """Per-key sum of Python floats over ``group`` (float64, fixed tree in rank order): logging stats."""
    if group.size == 1:
        return dict(values)
    keys = sorted(values)
    mine = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=comm_device(group))
    total = tree_reduce(gather_ranks(mine, group)).tolist()
    return dict(zip(keys, total))


def comm_device(group: Group) -> torch.device:
    # NCCL moves only CUDA tensors; gloo only CPU ones
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group.pg) == "nccl" \
        else torch.device("cpu")


def shard_range(count: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``parts`` contiguous [lo, hi) ranges covering range(count), sizes differing by at
    most one (the earlier parts the larger): how a step's items are split over ranks or workers."""
    per, extra = divmod(count, parts)
    lo = index * per + min(index, extra)
    return lo, lo + per + (index < extra)


def shard_for_rank(items: list, group: Group) -> list:
    """The contiguous share of ``items`` that data-parallel rank ``group.rank`` processes."""
    lo, hi = shard_range(len(items), group.size, group.rank)
    return items[lo:hi]


__all__ = ["all_reduce_gradients_", "DEFAULT_BUCKET_ELEMENTS", "sum_scalars", "shard_for_rank", "shard_range", "comm_device"]
