"""Test helpers over rlalign.contract.bits (the one bit-equality definition): on a failure, say where the first
differing element is."""

from __future__ import annotations

import torch

from rlalign.contract.bits import bits_equal, describe_difference


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """One line: "identical", the shape/dtype mismatch, or the count and the first differing index and values."""
    return describe_difference(a, b)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Raw-bit equality (rlalign.contract.bits: -0.0 != +0.0, NaN payloads count); verbose on failure."""
    if bits_equal(a, b):
        return
    raise AssertionError(f"{what + ': ' if what else ''}not bitwise equal: {first_difference(a, b)}")


def assert_close_report(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str = "") -> None:
    """allclose with a report of the worst element on failure."""
    a, e = actual.double(), expected.double()
    err = (a - e).abs() - (atol + rtol * e.abs())
    if bool((err <= 0).all()):
        return
    idx = tuple((err == err.max()).nonzero()[0].tolist())
    raise AssertionError(f"{what + ': ' if what else ''}outside atol={atol} rtol={rtol}; worst at {idx}: "
                         f"{a[idx].item()!r} vs reference {e[idx].item()!r} ({int((err > 0).sum())} elements out)")
