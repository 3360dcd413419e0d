"""Deterministic collectives: every sum across ranks is an all-gather followed by the same local
fixed-tree merge on every rank.

Why this is deterministic on gloo and NCCL alike: an all-gather only moves bytes (no arithmetic),
so every rank holds the same per-rank tensors in rank order; the merge is then a fixed balanced
tree of IEEE fp32 elementwise adds written here, run identically on every rank. Nothing depends
on the library's reduction algorithm (ring vs tree, chunking, NCCL_ALGO/PROTO, number of
channels), which is what makes stock all_reduce non-reproducible across settings and degrees.

The tree is the canonical one of rlalign.ops (pairs (0,1), (2,3), ... level by level, an odd last
element carried up unchanged), so for a power-of-two group it is exactly the top of the
canonical K-partition tree: rank r's subtree merged with its neighbours' in rank order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlalign.distributed.launch import Group


def gather_ranks(t: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """All-gather a same-shape tensor: [rank 0's, rank 1's, ...] on every rank (exact copies)."""
    if group.size == 1:
        return [t]
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(group.size)]
    dist.all_gather(out, t, group=group.pg)
    return out


def gather_ranks_varlen(t: torch.Tensor, group: Group, dim: int = 0) -> list[torch.Tensor]:
    """All-gather tensors that differ in size along ``dim`` only (padded to the largest, then cut)."""
    if group.size == 1:
        return [t]
    sizes = [int(s) for s in gather_ranks(torch.tensor([t.shape[dim]], device=t.device), group)]
    pad = max(sizes) - t.shape[dim]
    if pad:
        shape = list(t.shape)
        shape[dim] = pad
        t = torch.cat([t, t.new_zeros(shape)], dim=dim)
    return [p.narrow(dim, 0, n) for p, n in zip(gather_ranks(t, group), sizes)]


def tree_reduce(parts: list[torch.Tensor]) -> torch.Tensor:
    """Balanced pairwise tree over a list, level by level; an odd last element is carried up."""
    while len(parts) > 1:
        merged = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
        parts = merged + ([parts[-1]] if len(parts) % 2 else [])
    return parts[0]


def merge_ranks(partial: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of every rank's fp32 ``partial`` by the fixed tree in rank order; the same bits on every rank."""
    if partial.dtype != torch.float32:
        raise TypeError(f"merge_ranks: partials must be float32 (got {partial.dtype}); round once after the merge")
    return tree_reduce(gather_ranks(partial, group))


def all_reduce_fixed(flat: torch.Tensor, group: Group) -> torch.Tensor:
    """Deterministic all-reduce (sum) of a 1-D fp32 tensor, bandwidth like a reduce-scatter + all-gather.

    The tensor is cut into ``size`` equal chunks (zero padded); an all-to-all brings every rank's copy
    of chunk r to rank r, which merges them by :func:`tree_reduce` in rank order; an all-gather
    returns the merged chunks. Per element this is exactly ``merge_ranks`` (same tree, same order).
    """
    if flat.dtype != torch.float32 or flat.dim() != 1:
        raise TypeError("all_reduce_fixed: expects a 1-D float32 tensor")
    n, size = flat.numel(), group.size
    if size == 1:
        return flat.clone()
    chunk = -(-n // size)
    padded = torch.cat([flat, flat.new_zeros(chunk * size - n)]) if chunk * size != n else flat.contiguous()
    received = torch.empty_like(padded)
    dist.all_to_all_single(received, padded, group=group.pg)
    mine = tree_reduce(list(received.view(size, chunk).unbind(0)))
    return torch.cat(gather_ranks(mine, group))[:n]


__all__ = ["gather_ranks", "gather_ranks_varlen", "tree_reduce", "merge_ranks", "all_reduce_fixed"]
