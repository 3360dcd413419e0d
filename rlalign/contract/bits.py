"""Bit equality: the one definition every bitwise comparison in rlalign uses.

Two tensors are bit-equal when they have the same shape and dtype and every element has the same
raw bit pattern. Floats are compared as the integers of their bits, so ``-0.0 != +0.0`` and two
NaNs are equal only when their payloads (and signs) are; ``torch.equal`` on the float values is
*not* this (it calls ``-0.0 == +0.0`` and ``NaN != NaN``). Non-float tensors (integers, bool) are
compared by value, which for them is the same thing.

    bits_equal(a, b) -> bool
    differing(a, b) -> bool tensor           # per element: do the bits differ (same shape and dtype required)
    count_differences(a, b) -> int
    first_difference(a, b) -> Difference | None   # index of the first differing element, both values, count
    describe_difference(a, b) -> str         # one line for an error or a test failure
    bit_view(t) -> integer tensor            # the raw bits, for hashing or ordering
"""

from __future__ import annotations

import dataclasses

import torch

from rlalign.contract.errors import ContractError

# a float dtype's bits as the signed integer dtype of the same width
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclasses.dataclass(frozen=True)
class Difference:
    """The first element (row-major order) whose bits differ, its two values, and how many differ."""
    index: tuple[int, ...]
    value_a: float | int | bool
    value_b: float | int | bool
    count: int
    numel: int

    def __str__(self) -> str:
        return (f"{self.count} of {self.numel} elements differ; first at index {self.index}: "
                f"{self.value_a!r} vs {self.value_b!r}")


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (detached, contiguous) viewed as the signed integers of its bits; non-float tensors as they are."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous()
    if not t.is_floating_point():
        return t
    return t.view(_INT_OF_WIDTH[t.element_size()])


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, same dtype, same raw bits in every element."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bit_view(a), bit_view(b))


def differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bool tensor of ``a``'s shape: True where the two elements' bits differ."""
    _check_comparable(a, b)
    return bit_view(a) != bit_view(b)


def count_differences(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements' bits differ (same shape and dtype required)."""
    return int(differing(a, b).sum())


def first_difference(a: torch.Tensor, b: torch.Tensor) -> Difference | None:
    """The first differing element in row-major order (None when bit-equal); same shape and dtype required."""
    diff = differing(a, b)
    where = diff.nonzero()
    if where.shape[0] == 0:
        return None
    index = tuple(where[0].tolist())
    return Difference(index, a.detach()[index].item(), b.detach()[index].item(), int(where.shape[0]), a.numel())


def describe_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """``"identical"``, the shape or dtype mismatch, or :class:`Difference`'s sentence."""
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtypes differ: {a.dtype} vs {b.dtype}"
    first = first_difference(a, b)
    return "identical" if first is None else str(first)


def _check_comparable(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ContractError(f"bitwise comparison needs the same shape and dtype: {tuple(a.shape)} {a.dtype} vs "
                            f"{tuple(b.shape)} {b.dtype}")


__all__ = ["Difference", "bit_view", "bits_equal", "differing", "count_differences", "first_difference",
           "describe_difference"]
