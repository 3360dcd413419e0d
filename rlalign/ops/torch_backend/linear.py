"""Strict linear on the torch backend: fixed row blocks, fp32 accumulation, one rounding."""

from __future__ import annotations

import torch

from rlalign.contract import spec
from rlalign.contract.spec import ROW_BLOCK
from rlalign.ops.torch_backend.primitives import (SMALL_ROWS, compiled_rows, kernel_rows, linear_route, tile_mm,
                                                  tile_mm_segments, tree_merge, weight_grad)


def segment_count(k: int, segments: int) -> int:
    """Largest power of two <= ``segments`` that divides K (the canonical partition)."""
    p = 1
    while p * 2 <= segments and k % (p * 2) == 0:
        p *= 2
    return p


def linear_fp32(x: torch.Tensor, w: torch.Tensor, k_segments: int | None) -> torch.Tensor:
    """x [M, K] fp32, w [N, K] fp32 -> fp32 [M, N], unrounded.

    On the CPU the route is fixed per (K, N, segments) and thread count (primitives.linear_route), never
    per batch: every row runs the compiled kernel where the library's tile is not row invariant for the
    shape (narrow N, odd K) or where the kernel has the tiles' bits and is faster (the canonical K
    partition: 8 segment chains and the tree per output, instead of 8 narrow GEMMs and a merge pass);
    otherwise 64-row tiles, the rows past the last whole block by the kernel when they are few (no zero
    padding multiplied out) and the kernel has the tiles' bits."""
    p = segment_count(x.shape[1], k_segments) if k_segments and k_segments > 1 else 1
    if x.shape[0] and x.device.type == "cpu" and linear_route(x.shape[1], w.shape[0], p) == "kernel":
        return kernel_rows(x, w, p)
    m = x.shape[0]
    full = m - m % ROW_BLOCK
    if full < m:
        tail = compiled_rows(x[full:], w, p, max_rows=SMALL_ROWS)
        if tail is not None:
            return tail if full == 0 else torch.cat([_blocks(x[:full], w, p), tail])
    return _blocks(x, w, p)


def _blocks(x: torch.Tensor, w: torch.Tensor, p: int) -> torch.Tensor:
    if p == 1:
        return tile_mm(x.contiguous(), w.contiguous())
    # Each segment is reduced from zero on its own, then the fixed tree merges the partials;
    # a tensor-parallel rank holding segments [r*P/tp, (r+1)*P/tp) computes exactly one subtree.
    return tree_merge(tile_mm_segments(x, w, p))


def _forward(x2d, w, bias, k_segments):
    out = linear_fp32(x2d.float(), w.float(), k_segments)
    if bias is not None:
        out = out + bias.float()
    return out.to(x2d.dtype)


class _StrictLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, w, bias, k_segments):
        out = _forward(x2d, w, bias, k_segments)
        ctx.save_for_backward(x2d, w)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x2d, w = ctx.saved_tensors
        g = grad_out.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dX = dY @ W: row-blocked like the forward, so each token's input gradient is also
            # independent of the batch it was computed in.
            grad_x = tile_mm(g, w.float().t().contiguous()).to(x2d.dtype)
        if ctx.needs_input_grad[1]:
            # dW = dY^T @ X reduces over tokens: one fp32 GEMM, deterministic run to run for a
            # given shape (not invariant to how tokens are split into micro-batches).
            grad_w = weight_grad(g, x2d.float()).to(w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(w.dtype)
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, k_segments: int | None) -> torch.Tensor:
    shape = x.shape
    x2d = x.reshape(-1, shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)):
        out = _StrictLinear.apply(x2d, w, bias, k_segments)
    else:  # no graph to record (rollout, no_grad): the same forward without the autograd.Function
        out = _forward(x2d, w, bias, k_segments)
    return out.reshape(*shape[:-1], w.shape[0])


def linear_group(x: torch.Tensor, weights: tuple, biases: tuple, views: bool = False) -> tuple[torch.Tensor, ...]:
    """ops.linear_group on the torch backend: one linear per weight (the CPU route is chosen per (K, N), so a
    stacked weight's wider N could take another route and change bits)."""
    return tuple(linear(x, w, b, None) for w, b in zip(weights, biases))


__all__ = ["linear", "linear_group", "linear_fp32", "segment_count", "spec"]
