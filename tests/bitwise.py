"""Bitwise comparison helpers: on a failure, say where the first differing element is."""

from __future__ import annotations

import torch


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtypes differ: {a.dtype} vs {b.dtype}"
    ai, bi = _bits(a), _bits(b)
    diff = (ai != bi).nonzero()
    if diff.numel() == 0:
        return "identical"
    idx = tuple(diff[0].tolist())
    return (f"{diff.shape[0]} of {a.numel()} elements differ; first at index {idx}: "
            f"{a[idx].item()!r} vs {b[idx].item()!r}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}.get(t.dtype)
    return t.view(view) if view is not None else t


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """torch.equal on raw bits (so -0.0 != +0.0 and NaN payloads count); verbose on failure."""
    if a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)):
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
