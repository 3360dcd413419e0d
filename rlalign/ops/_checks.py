"""Input validation shared by the ops: clear errors that name the op and the problem."""

from __future__ import annotations

import torch

from rlalign.contract.errors import ContractError, fail

STRICT_DTYPES = (torch.float32, torch.bfloat16)


def dtype_ok(op: str, *tensors: torch.Tensor) -> torch.dtype:
    """All tensors share one strict dtype (float32 or bfloat16); returns it."""
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype not in STRICT_DTYPES:
            raise fail(op, f"dtype {t.dtype} is not supported in strict (use torch.bfloat16 or torch.float32)")
        if t.dtype != dtype:
            raise fail(op, f"mixed dtypes {dtype} and {t.dtype}: cast the inputs to one dtype")
    return dtype


def same_device(op: str, *tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise fail(op, f"tensors on different devices ({dev} and {t.device})")


def ndim(op: str, name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != n:
        raise fail(op, f"{name} must have {n} dims, got shape {tuple(t.shape)}")


def finite(op: str, name: str, t: torch.Tensor) -> None:
    """Strict ops refuse NaN/inf inputs: they would poison every reduction they enter."""
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        raise fail(op, f"{name} contains NaN or inf (first at index {bad}, value {t[tuple(bad)].item()})")


def contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise fail(op, f"{name} must be contiguous (call .contiguous() first); got strides {t.stride()}")


def index_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise fail(op, f"{name} must be an int32/int64 tensor, got {t.dtype}")


__all__ = ["ContractError", "dtype_ok", "same_device", "ndim", "finite", "contiguous", "index_dtype"]
