"""The few primitives every strict torch-backend op is built from.

Invariance by construction: a library call only ever sees shapes fixed by the contract
(:mod:`rlalign.contract.spec`), never a batch-dependent one, and every sum that matters is a
balanced tree of elementwise adds whose order is written here, not chosen by a library.
What is left to the libraries (fixed-shape GEMMs are row/column/item invariant; exp/log are
position invariant) is listed in ``spec.cpu_backend_assumptions`` and checked by ``rlalign doctor``.
"""

from __future__ import annotations

import torch

from rlalign.contract import spec


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad dim 0 of ``x`` up to a multiple of ``multiple``."""
    rows = x.shape[0]
    padded = -(-rows // multiple) * multiple
    if padded == rows:
        return x
    return torch.cat([x, x.new_zeros((padded - rows,) + tuple(x.shape[1:]))], dim=0)


def tile_mm(a: torch.Tensor, w: torch.Tensor, row_block: int = spec.ROW_BLOCK) -> torch.Tensor:
    """``a @ w.T`` in fp32, issued as GEMMs of exactly ``row_block`` rows.

    a: [M, K] fp32, w: [N, K] fp32 -> [M, N] fp32. Each output row is computed by a GEMM of shape
    (row_block x K) x (K x N) whatever M is, so its bits cannot depend on M or on the other rows
    (given the doctor-checked assumption that a fixed-shape GEMM is row-position invariant).
    """
    m = a.shape[0]
    if m == 0:
        return a.new_zeros((0, w.shape[0]))
    a = pad_rows(a, row_block)
    wt = w.t()
    out = torch.empty((a.shape[0], w.shape[0]), dtype=a.dtype, device=a.device)
    for start in range(0, a.shape[0], row_block):
        torch.mm(a[start:start + row_block], wt, out=out[start:start + row_block])
    return out[:m]


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a balanced pairwise tree of elementwise adds.

    Level by level: pair (2i, 2i+1) is added; an odd last element is carried to the next level
    unchanged. The order depends only on the length of the last dim, and every add is an IEEE
    elementwise add, so a row's sum is independent of how many rows there are or where it sits.
    """
    while x.shape[-1] > 1:
        n = x.shape[-1]
        even = n - (n % 2)
        pairs = x[..., 0:even:2] + x[..., 1:even:2]
        x = torch.cat([pairs, x[..., even:]], dim=-1) if n % 2 else pairs
    return x[..., 0]


def tree_merge(parts: list[torch.Tensor]) -> torch.Tensor:
    """Merge a list of partials by the fixed balanced binary tree ((p0+p1)+(p2+p3))+...

    The list length must be a power of two (the canonical partition guarantees it).
    """
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


