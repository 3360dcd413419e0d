"""Argument checks of the strict ops: dtypes, devices, ranks, layouts, index dtypes -- each failure an error
that names the op and the problem."""

from __future__ import annotations

import torch

from rlalign.contract import spec
from rlalign.contract.errors import fail

STRICT_DTYPES = tuple(getattr(torch, name) for name in spec.STRICT_DTYPES)


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


def contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise fail(op, f"{name} must be contiguous (call .contiguous() first); got strides {t.stride()}")


def index_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise fail(op, f"{name} must be an int32/int64 tensor, got {t.dtype}")
