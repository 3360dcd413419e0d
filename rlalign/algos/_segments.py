"""Packed-batch layout shared by the algorithms, and their input checks.

Conventions of every function in :mod:`rlalign.algos`:

- per-token tensors are 1-D of length ``T``: the tokens of a (micro-)batch, sequences packed
  one after another (a sequence's tokens need not be contiguous; their order in the flat
  tensor is their order in the sequence);
- ``seq_ids`` ``[T]`` int64: the index of each token's sequence into the per-sequence
  tensors, in ``[0, N)``;
- ``mask`` ``[T]`` bool: True for the tokens that count (response tokens), False for prompt,
  padding or filtered tokens;
- per-sequence tensors (rewards, group ids, lengths) are 1-D of length ``N``;
- ``group_ids`` ``[N]`` int64: each sequence's prompt group, in ``[0, G)``.

Sums over a segment (the tokens of one sequence, the sequences of one group) are balanced
pairwise trees (:func:`tree_sum`) over a zero-padded ``[num_segments, max_len]`` view: the sum
of one segment then depends only on its own values, not on the other segments nor on
``max_len`` (padding adds ``+0.0``, which is exact), and its backward is exact copies.
Masking is done with ``torch.where``, never by multiplying by 0/1 (0 * inf would be NaN).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from rlalign.algos import _portable as P
from rlalign.reductions import tree_sum


def fail(fn: str, problem: str) -> ValueError:
    return ValueError(f"rlalign.algos.{fn}: {problem}")


def check_flat(fn: str, **tensors: torch.Tensor) -> int:
    """All given tensors are 1-D with one common length; returns it."""
    length = None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise fail(fn, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise fail(fn, f"{name} must be 1-D (flat packed tokens or sequences), got shape {tuple(t.shape)}")
        if length is None:
            length = t.shape[0]
        elif t.shape[0] != length:
            sizes = ", ".join(f"{k}={v.shape[0]}" for k, v in tensors.items())
            raise fail(fn, f"lengths differ: {sizes}")
    return int(length or 0)


def check_mask(fn: str, mask: torch.Tensor, name: str = "mask") -> None:
    if mask.dtype != torch.bool:
        raise fail(fn, f"{name} must be a bool tensor, got {mask.dtype}")


def check_float(fn: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise fail(fn, f"{name} must be a floating-point tensor, got {t.dtype}")


def check_ids(fn: str, ids: torch.Tensor, num: int | None, name: str = "seq_ids") -> int:
    """``ids`` is an integer tensor with values in ``[0, num)``; returns ``num`` (max + 1 if None)."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise fail(fn, f"{name} must be an int64 tensor, got {ids.dtype}")
    if ids.numel() == 0:
        return int(num or 0)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise fail(fn, f"{name} must be >= 0, found {lo}")
    if num is None:
        return hi + 1
    if hi >= num:
        raise fail(fn, f"{name} must be < {num} (the number of segments), found {hi}")
    return int(num)


def seq_ids_from_lengths(lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``[N]`` lengths of sequences packed back to back -> ``seq_ids`` ``[T]`` (int64):
    ``[0] * lengths[0] + [1] * lengths[1] + ...``."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


class Segments(NamedTuple):
    """Where each element of a flat tensor sits in a padded ``[num, max_len]`` view.

    ``ids[i]`` is element i's segment, ``slot[i]`` its position within the segment (order of
    appearance), ``counts[s]`` the size of segment s.
    """

    ids: torch.Tensor
    slot: torch.Tensor
    counts: torch.Tensor
    num: int
    max_len: int


def segments(ids: torch.Tensor, num: int) -> Segments:
    """Build the layout of ``ids`` (integers in ``[0, num)``); integer ops only, deterministic."""
    ids = ids.long()
    counts = torch.bincount(ids, minlength=num) if ids.numel() else ids.new_zeros(num)
    order = torch.sort(ids, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(ids)
    slot[order] = torch.arange(ids.numel(), device=ids.device) - starts[ids[order]]
    max_len = int(counts.max()) if num else 0
    return Segments(ids, slot, counts, num, max_len)


def to_padded(values: torch.Tensor, seg: Segments, fill: float | bool = 0.0) -> torch.Tensor:
    """Flat ``[T]`` -> ``[num, max_len]``; positions past a segment's end hold ``fill``."""
    padded = values.new_full((seg.num, seg.max_len), fill)
    return padded.index_put((seg.ids, seg.slot), values)


def from_padded(padded: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Inverse of :func:`to_padded`: ``[num, max_len]`` -> flat ``[T]``."""
    return padded[seg.ids, seg.slot]


def seg_sum(values: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Per-segment sum ``[num]`` as a balanced tree over the zero-padded view."""
    if seg.max_len == 0:
        return values.new_zeros(seg.num)
    return tree_sum(to_padded(values, seg, 0.0))


def seg_is_constant(values: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Bool ``[num]``: True where all of a segment's values are equal (max == min), or it is empty."""
    if seg.max_len == 0:
        return torch.ones(seg.num, dtype=torch.bool, device=values.device)
    hi = to_padded(values, seg, -math.inf).amax(dim=1)
    lo = to_padded(values, seg, math.inf).amin(dim=1)
    return ~(hi > lo)


def flat_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum of a 1-D tensor as a balanced tree (0-dim; 0.0 when empty)."""
    if values.numel() == 0:
        return values.new_zeros(())
    return tree_sum(values)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return flat_sum(torch.where(mask, values, torch.zeros_like(values)))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over ``mask``; 0.0 when nothing is selected."""
    count = mask.sum()
    return P.div(masked_sum(values, mask), count.clamp(min=1).to(values.dtype))


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over ``mask``; 0.0 when nothing is selected."""
    if not bool(mask.any()):
        return values.new_zeros(())
    return values[mask].max()


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min over ``mask``; 0.0 when nothing is selected."""
    if not bool(mask.any()):
        return values.new_zeros(())
    return values[mask].min()


def masked_std(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased std) over ``mask``: std = sqrt(sum (x - mean)^2 / (n - 1)); std = 0 for n <= 1."""
    mean = masked_mean(values, mask)
    n = mask.sum().to(values.dtype)
    centred = values - mean
    sq = masked_sum(centred * centred, mask)   # one multiply: the bits of ** 2
    var = torch.where(n > 1, P.div(sq, (n - 1).clamp(min=1)), torch.zeros_like(sq))
    return mean, P.sqrt(var)


def frac(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of the selected elements where ``condition`` holds (0.0 when none selected)."""
    return P.div((condition & mask).sum().double(), mask.sum().clamp(min=1).double())
