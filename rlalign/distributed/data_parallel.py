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

import dataclasses
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


# ---- sharded training state (parallel.shard=grads) ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FlatShards:
    """The trainable parameters flattened one after another (row-major, in the given order) into one index space
    of ``total`` elements, cut into ``ranks`` contiguous ranges by :func:`shard_range` (sizes differ by at most
    one, the earlier ranks the larger). Rank r owns range r; a parameter may lie across several ranks' ranges.
    A function of the sizes and the rank count alone: every rank computes the same cut."""
    numels: tuple[int, ...]
    ranks: int

    @property
    def offsets(self) -> list[int]:
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += n
        return out

    @property
    def total(self) -> int:
        return sum(self.numels)

    def range(self, rank: int) -> tuple[int, int]:
        return shard_range(self.total, self.ranks, rank)

    def segments(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(rank, lo, hi): the non-empty parts of the global range [start, stop) by owning rank, in rank order."""
        out = []
        for r in range(self.ranks):
            lo, hi = self.range(r)
            lo, hi = max(lo, start), min(hi, stop)
            if lo < hi:
                out.append((r, lo, hi))
        return out

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(parameter index, lo, hi): rank ``rank``'s part of each parameter it owns elements of, in parameter
        coordinates (flat, row-major), in parameter order."""
        lo, hi = self.range(rank)
        spans = [(i, max(lo, off) - off, min(hi, off + n) - off)
                 for i, (off, n) in enumerate(zip(self.offsets, self.numels))]
        return [(i, a, b) for i, a, b in spans if a < b]


def _global(group: Group, rank: int) -> int:
    return dist.get_global_rank(group.pg, rank)


@torch.no_grad()
def reduce_scatter_gradients(params: list, shards: FlatShards, group: Group,
                             bucket_elements: int = DEFAULT_BUCKET_ELEMENTS) -> list[torch.Tensor]:
    """This rank's share of the sum of ``params``' gradients over ``group``: one fp32 tensor per piece of
    ``shards.pieces(group.rank)``. Per element the bits of :func:`all_reduce_gradients_`'s sum before its rounding
    (the fixed tree of the ranks' fp32 values in rank order, :func:`tree_reduce`): the buckets are the same
    consecutive parameters, an all-to-all (uneven splits, bytes only) brings every rank's copy of this rank's
    range of the bucket here, and only that range is merged. A missing gradient counts as zeros."""
    params = list(params)
    offsets, (lo, hi) = shards.offsets, shards.range(group.rank)
    mine = torch.empty(hi - lo, dtype=torch.float32, device=params[0].device if params else None)
    index = 0
    for bucket in _buckets(params, bucket_elements):
        start = offsets[index]
        stop = start + sum(p.numel() for p in bucket)
        index += len(bucket)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in bucket])
        sends = [hi_r - lo_r for lo_r, hi_r in (_clip(shards.range(r), start, stop) for r in range(group.size))]
        a, b = _clip((lo, hi), start, stop)
        received = flat.new_empty((b - a) * group.size)
        if group.size == 1:
            received.copy_(flat)
        else:
            dist.all_to_all_single(received, flat, output_split_sizes=[b - a] * group.size, input_split_sizes=sends,
                                   group=group.pg)
        del flat
        if b > a:
            mine[a - lo:b - lo] = tree_reduce(list(received.view(group.size, b - a).unbind(0)))
    out, at = [], 0
    for i, a, b in shards.pieces(group.rank):
        out.append(mine[at:at + b - a])
        at += b - a
    return out


def _clip(span: tuple[int, int], start: int, stop: int) -> tuple[int, int]:
    lo, hi = max(span[0], start), min(span[1], stop)
    return (lo, hi) if lo < hi else (lo, lo)


@torch.no_grad()
def broadcast_segments_(flat: torch.Tensor, segments: list[tuple[int, int, int]], group: Group, base: int = 0) -> None:
    """Every rank's ``flat`` ends with each segment's values from the rank that owns it: ``segments`` are (rank,
    lo, hi) in a global index space, ``flat[lo - base:hi - base]`` is the part each one covers. One broadcast per
    segment (bytes only, no arithmetic): an exact copy on every rank."""
    if group.size == 1:
        return
    for r, lo, hi in segments:
        dist.broadcast(flat[lo - base:hi - base], src=_global(group, r), group=group.pg)


__all__ = ["all_reduce_gradients_", "DEFAULT_BUCKET_ELEMENTS", "sum_scalars", "shard_for_rank", "shard_range",
           "comm_device", "FlatShards", "reduce_scatter_gradients", "broadcast_segments_"]
