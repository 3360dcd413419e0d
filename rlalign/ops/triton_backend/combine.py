"""The MoE combine on the Triton backend: a token's k expert outputs weighted and summed in one pass.

Forward, per token t and hidden column h (spec row ``moe_combine``; the torch backend's arithmetic):

    order the k slots by expert id (equal ids: lower slot first; top-k ids are distinct anyway)
    acc = fp32(y[t, s_0, h]) * w[t, s_0]
    acc = acc + fp32(y[t, s_r, h]) * w[t, s_r]        r = 1 .. k-1, in that order
    out[t, h] = round(acc)                              to y's dtype

Each product is one fp32 multiply and each sum one fp32 add: the kernels are compiled without
floating-point contraction (``enable_fp_fusion=False``), so no multiply-add is fused into an fma and
the bits equal the torch formulation's (separate multiply and add kernels), whatever the tile.

Backward (the gradient is the trainer's only; deterministic, no atomics):

    dy[t, j, h] = round(fp32(g[t, h]) * w[t, j])        elementwise: the torch backend's bits
    dw[t, j]    = sum_h fp32(g[t, h]) * fp32(y[t, j, h])  per token: tl.sum over a block of BH columns,
                                                          blocks added left to right (a fixed order, not
                                                          the torch backend's: each backend agrees with itself)

The torch formulation gathers y into expert order as an fp32 [T, k, H] copy and runs k multiply and add
kernels over it (about 3 ms at 16k tokens of a Qwen3-30B-A3B layer on the H200, as long as the experts'
grouped GEMMs); these kernels read y once and write the output once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BH = 256           # hidden columns per program (forward) / per step (backward)


@triton.jit
def _slot_of_rank(e_ptr, t, K: tl.constexpr, KP: tl.constexpr):
    """rank[j] = how many of token t's slots come before slot j in (expert id, slot) order."""
    j = tl.arange(0, KP)
    e = tl.load(e_ptr + t * K + j, mask=j < K, other=2 ** 62)
    before = (e[None, :] < e[:, None]) | ((e[None, :] == e[:, None]) & (j[None, :] < j[:, None]))
    return tl.sum(before.to(tl.int32), axis=1), j


@triton.jit
def combine_fwd_kernel(y_ptr, w_ptr, e_ptr, out_ptr, H, K: tl.constexpr, KP: tl.constexpr, BH: tl.constexpr,
                       OUT_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = h < H
    rank, j = _slot_of_rank(e_ptr, t, K, KP)
    acc = tl.zeros((BH,), dtype=tl.float32)
    for r in tl.static_range(K):
        slot = tl.sum(tl.where(rank == r, j, 0), axis=0)
        w = tl.load(w_ptr + t * K + slot)
        y = tl.load(y_ptr + (t * K + slot) * H + h, mask=hmask, other=0.0).to(tl.float32)
        if r == 0:
            acc = y * w
        else:
            acc = acc + y * w
    out = acc.to(tl.bfloat16) if OUT_BF16 else acc
    tl.store(out_ptr + t * H + h, out, mask=hmask)


@triton.jit
def combine_bwd_kernel(g_ptr, y_ptr, w_ptr, dy_ptr, dw_ptr, H, K: tl.constexpr, KP: tl.constexpr,
                       BH: tl.constexpr, DY_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, KP)
    jmask = j < K
    w = tl.load(w_ptr + t * K + j, mask=jmask, other=0.0)
    dw = tl.zeros((KP,), dtype=tl.float32)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        hmask = h < H
        m2 = jmask[:, None] & hmask[None, :]
        g = tl.load(g_ptr + t * H + h, mask=hmask, other=0.0).to(tl.float32)
        rows = (t * K + j[:, None]) * H + h[None, :]
        y = tl.load(y_ptr + rows, mask=m2, other=0.0).to(tl.float32)
        dw = dw + tl.sum(g[None, :] * y, axis=1)
        dy = g[None, :] * w[:, None]
        tl.store(dy_ptr + rows, dy.to(tl.bfloat16) if DY_BF16 else dy, mask=m2)
    tl.store(dw_ptr + t * K + j, dw, mask=jmask)


def _kp(k: int) -> int:
    return max(2, triton.next_power_of_2(k))


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, experts):
        tokens, k, hidden = y.shape
        out = torch.empty((tokens, hidden), dtype=y.dtype, device=y.device)
        if out.numel():
            combine_fwd_kernel[(tokens, triton.cdiv(hidden, _BH))](
                y, weights, experts, out, hidden, K=k, KP=_kp(k), BH=_BH, OUT_BF16=y.dtype == torch.bfloat16,
                num_warps=4, enable_fp_fusion=False)
        ctx.save_for_backward(y, weights)
        return out

    @staticmethod
    def backward(ctx, grad):
        y, weights = ctx.saved_tensors
        tokens, k, hidden = y.shape
        g = grad.contiguous().to(y.dtype)
        dy = torch.empty_like(y)
        dw = torch.empty((tokens, k), dtype=torch.float32, device=y.device)
        if y.numel():
            combine_bwd_kernel[(tokens,)](g, y, weights, dy, dw, hidden, K=k, KP=_kp(k), BH=_BH,
                                          DY_BF16=y.dtype == torch.bfloat16, num_warps=4, enable_fp_fusion=False)
        return dy, dw.to(weights.dtype), None


def combine(y: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """out [T, H] = sum over a token's k slots in expert order of fp32(y) * w, rounded to y's dtype (module
    docstring). y [T, k, H] bf16/fp32, weights [T, k] fp32, experts [T, k] integer."""
    return _Combine.apply(y.contiguous(), weights.float().contiguous(), experts.to(torch.int64).contiguous())


__all__ = ["combine", "combine_fwd_kernel", "combine_bwd_kernel"]
