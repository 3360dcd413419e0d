"""Strict RMSNorm: fp32, tree-summed squares, one rounding."""

from __future__ import annotations

import torch

from rlalign.ops.torch_backend import clib
from rlalign.reductions import tree_sum


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """y = x / sqrt(mean(x^2) + eps) * weight, all in fp32, rounded once to x.dtype. With ``residual`` (passed
    by ops.rms_norm without autograd): x = x + residual first (one rounding), -> (y, x).

    Written in differentiable torch ops (autograd gives a deterministic backward). The mean is
    a tree sum divided by H; 1/sqrt is torch's sqrt then a division, never rsqrt, whose vector and
    scalar paths need not agree. Without autograd on the CPU the same operations run compiled
    (csrc/norm.c; torch's sqrt in between: the same bits).
    """
    if residual is not None:
        x = x + residual
        return rms_norm(x, weight, eps), x
    out = compiled_rms_norm(x, weight, eps)
    return out if out is not None else rms_norm_formula(x, weight, eps)


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The definition, in differentiable torch ops."""
    xf = x.float()
    ms = tree_sum(xf * xf) / x.shape[-1]
    inv = 1.0 / torch.sqrt(ms + eps)
    return (xf * inv.unsqueeze(-1) * weight.float()).to(x.dtype)


def compiled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """csrc/norm.c's rl_rms_norm when it applies (CPU, no autograd, rows it takes), else None."""
    lib = clib.for_tensors(x, weight)
    if lib is None or x.shape[-1] > clib.MAX_NORM_SIZE:
        return None
    x, weight = x.contiguous(), weight.contiguous()
    h = x.shape[-1]
    rows, bf16 = x.numel() // h, int(x.dtype == torch.bfloat16)
    root = torch.empty(rows)
    # non-finite inputs are refused by the op's own check (ops.rms_norm: before this, or right after it for a
    # residual stream the backend adds itself; NaN / inf only propagate here)
    threads = torch.get_num_threads()
    lib.rl_rms_norm_stats(x.data_ptr(), rows, h, eps, bf16, root.data_ptr(), threads)
    torch.sqrt_(root)
    out = torch.empty_like(x)
    lib.rl_rms_norm_apply(x.data_ptr(), weight.data_ptr(), root.data_ptr(), rows, h, bf16, out.data_ptr(), threads)
    return out
