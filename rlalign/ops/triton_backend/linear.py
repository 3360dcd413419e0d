"""Strict linear on the Triton backend: y = x @ W.T (+ bias) through :func:`gemm.gemm`.

Forward: the GEMM of :mod:`.gemm` (fixed 64-column K steps, fp32 accumulator, canonical K
segments merged by the fixed tree when ``k_segments`` is given, bias in fp32, one rounding).
Backward (deterministic, no atomics):

    dX = dY @ W     the same kernel family, reduction over N in 64-steps: a token's input
                    gradient does not depend on the other rows of the call;
    dW = dY^T @ X   reduction over the M tokens in 64-row steps in increasing order, one program
                    per output tile (so deterministic run to run; it is a sum over tokens, so not
                    invariant to how tokens are split into micro-batches);
    db = sum of dY over rows, as the column sums of dY^T @ 1 (fp32, the same fixed M order).
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import fail
from rlalign.ops.torch_backend.linear import segment_count
from rlalign.ops.stacking import stacked_rows
from rlalign.ops.triton_backend.gemm import gemm, gemm_blocks


def _grad_bias(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over rows of g [M, N] in fp32 via the GEMM (reduction over M in fixed 64-steps); w (the layer's
    weight) only labels the launch for the GEMM census."""
    ones = torch.ones((g.shape[0], 1), dtype=g.dtype, device=g.device)
    return gemm(g, ones, a_trans=True, out_dtype=torch.float32, role="db", role_of=w)[:, 0]


class _TritonLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, w, bias, segments):
        ctx.save_for_backward(x2d, w)
        ctx.has_bias = bias is not None
        return gemm(x2d, w, b_trans=True, bias=bias, segments=segments, out_dtype=x2d.dtype, role="fwd", role_of=w)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, w = ctx.saved_tensors
        g = grad_out.contiguous().to(x2d.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = gemm(g, w, out_dtype=x2d.dtype, role="dX", role_of=w)
        if ctx.needs_input_grad[1]:
            grad_w = gemm(g, x2d, a_trans=True, out_dtype=w.dtype, role="dW", role_of=w)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = _grad_bias(g, w).to(w.dtype)
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, k_segments: int | None) -> torch.Tensor:
    """Validated inputs (rlalign.ops.linear): x [..., K], w [N, K], bias [N] or None, one dtype."""
    shape = x.shape
    k = shape[-1]
    if k_segments and k_segments > 8:
        raise fail("linear", f"k_segments={k_segments}: the triton backend supports canonical partitions of at most 8 segments")
    segments = segment_count(k, k_segments) if k_segments and k_segments > 1 else 1
    x2d = x.reshape(-1, k)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)):
        out = _TritonLinear.apply(x2d, w, bias, segments)
    else:
        out = gemm(x2d, w, b_trans=True, bias=bias, segments=segments, out_dtype=x.dtype, role="fwd",
                   role_of=w)
    return out.reshape(*shape[:-1], w.shape[0])


def linear_group(x: torch.Tensor, weights: tuple, biases: tuple, views: bool = False) -> tuple[torch.Tensor, ...]:
    """Validated inputs (rlalign.ops.linear_group). Without grad, weights stacked as one tensor's row blocks (and
    biases likewise, or none) run as one GEMM over the stacked weight: as separate output tensors where the
    dispatcher takes the Gluon kernel for the whole call (gemm_blocks: decode batches on Hopper), or, with
    ``views``, as column views of one output from whichever kernel the dispatcher picks. Anything else is one
    :func:`linear` per weight. Same bits every way: an element is computed as in the separate call (P = 1, fixed
    64-column k-steps; neither N nor the tile enters its operations)."""
    if not (torch.is_grad_enabled() and (x.requires_grad or any(t is not None and t.requires_grad
                                                                  for t in weights + biases))):
        stacked = stacked_rows(weights)
        bias = None if all(b is None for b in biases) else stacked_rows(biases)
        if stacked is not None and (bias is not None or all(b is None for b in biases)):
            k = x.shape[-1]
            widths = tuple(w.shape[0] for w in weights)
            outs = gemm_blocks(x.reshape(-1, k), stacked, widths, bias=bias, role_of=weights[0])
            if outs is None and views:
                out = gemm(x.reshape(-1, k), stacked, b_trans=True, bias=bias, out_dtype=x.dtype, role="fwd",
                           role_of=weights[0])
                cuts = [sum(widths[:i]) for i in range(len(widths) + 1)]
                outs = tuple(out[:, a:z] for a, z in zip(cuts, cuts[1:]))
            if outs is not None:
                return tuple(o.reshape(*x.shape[:-1], o.shape[1]) for o in outs)
    return tuple(linear(x, w, b, None) for w, b in zip(weights, biases))


__all__ = ["linear", "linear_group"]
