"""Strict RMSNorm: fp32, tree-summed squares, one rounding."""

from __future__ import annotations

import torch

from rlalign.ops.torch_backend.primitives import tree_sum


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, all in fp32, rounded once to x.dtype.

    Written in differentiable torch ops (autograd gives a deterministic backward). The mean is
    a tree sum divided by H; 1/sqrt is sqrt then a division (both correctly rounded), never
    rsqrt, whose vector and scalar paths need not agree.
    """
    xf = x.float()
    ms = tree_sum(xf * xf) / x.shape[-1]
    inv = 1.0 / torch.sqrt(ms + eps)
    return (xf * inv.unsqueeze(-1) * weight.float()).to(x.dtype)
