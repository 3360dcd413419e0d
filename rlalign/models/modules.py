"""Weight-holding modules of the decoder, each computed through one ``rlalign.ops`` call."""

from __future__ import annotations

import torch
from torch import nn

from rlalign import ops


def _param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class Linear(nn.Module):
    """Holds ``weight`` [out, in] (and ``bias`` [out]); computed through ``ops.linear``
    (``k_segments``: reduce over the canonical K partition, the tensor-parallel invariant)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device, k_segments: int | None = None):
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.k_segments = k_segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, k_segments=self.k_segments)


class RMSNorm(nn.Module):
    """``norm(x)`` -> normed; ``norm(x, residual)`` -> (normed(x + residual), x + residual), the add rounded once."""

    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.weight = _param((size,), dtype, device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual=residual)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, dtype, device):
        super().__init__()
        self.weight = _param((num, dim), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(ids, self.weight)


__all__ = ["Linear", "RMSNorm", "Embedding"]
