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


def stack_rows(*linears: Linear) -> None:
    """Lay the weights of ``linears`` (and their biases, when all have one) back to back in one tensor each, values
    kept: each parameter becomes a view of its rows (``p.data`` rebound, so the Parameter objects, their names,
    checkpoints, optimizer state and TP plans are unchanged). :func:`project` then runs them as one
    ``ops.linear_group`` call -- one GEMM on the CUDA decode path, with each output's bits unchanged. Idempotent;
    anything that reallocates a parameter later (``p.data = ...``, a TP shard) only undoes the stacking (the
    projections then run one by one, with the same bits); :meth:`CausalLM._apply` restacks after ``.to()``."""
    for attr in ("weight", "bias"):
        params = [getattr(lin, attr) for lin in linears]
        if any(p is None for p in params) or ops.stacked_rows(params) is not None:
            continue
        with torch.no_grad():
            stacked = torch.cat([p.detach() for p in params])
            start = 0
            for p in params:
                p.data = stacked[start:start + p.shape[0]]
                start += p.shape[0]


def project(x: torch.Tensor, *projections, views: bool = False) -> tuple[torch.Tensor, ...]:
    """``tuple(proj(x) for proj in projections)`` for projections of one input (q/k/v, gate/up). rlalign's plain
    :class:`Linear` modules (no canonical K partition) go through one ``ops.linear_group`` call: the same bits, one
    GEMM where their weights are stacked (:func:`stack_rows`) and no gradient is taken; ``views``: the caller takes
    row-strided outputs (ops.linear_group). Other modules (tensor-parallel layers, the transformers patch's): one
    call each."""
    if all(type(p) is Linear and p.k_segments is None for p in projections):
        return ops.linear_group(x, [p.weight for p in projections], [p.bias for p in projections], views=views)
    return tuple(p(x) for p in projections)


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


__all__ = ["Linear", "RMSNorm", "Embedding", "stack_rows", "project"]
