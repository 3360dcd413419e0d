"""MoE top-k routing on the Triton backend: one program per token, the torch backend's arithmetic.

Per token, from its fp32 router logits l [E] (spec row ``moe_route``; rlalign.ops.torch_backend.moe):

    m   = max_e l_e                              exact
    u_e = exp(l_e - m)                           libdevice expf, the function torch's CUDA exp calls
    s   = pairwise tree: level by level (2i, 2i+1) are added (E a power of two: no carried element)
    p_e = u_e / s                                IEEE division (div_rn)
    top-k: k times the largest remaining p, equal p -> the lower expert index (a stable descending sort)
    normalize: d = p_sel[0] + p_sel[1] + ... left to right; w_j = p_sel[j] / d (div_rn)

The torch formulation launches ~25 small kernels per layer (amax, exp, seven tree levels, division,
sort, gather, the normaliser): with a sparse block's other work that is host launch time more than GPU
time (benchmarks/gpu_moe.py's route_combine rows). This is one launch. The backward recomputes the torch
formulation from the saved logits and differentiates it (the same forward bits: the CUDA test checks
experts and weights equal), so the router's gradient is exactly what it was.

E must be a power of two (<= 1024: one program holds the row); other router widths use the torch
formulation (the same contract; ``route`` dispatches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlalign.ops.torch_backend.moe import route as torch_route
from rlalign.ops.triton_backend._common import div_ieee, is_interpreter, libm_exp


@triton.jit
def route_kernel(l_ptr, experts_ptr, weights_ptr, E: tl.constexpr, LOG2E: tl.constexpr, K: tl.constexpr,
                 KP: tl.constexpr, NORMALIZE: tl.constexpr, LIBDEVICE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, E)
    logits = tl.load(l_ptr + t * E + idx)
    u = libm_exp(logits - tl.max(logits, axis=0), LIBDEVICE)
    s = u
    for level in tl.static_range(LOG2E):        # (2i, 2i+1) pairs, level by level: one IEEE add each
        s = tl.sum(tl.reshape(s, (E >> (level + 1), 2)), axis=1)
    total = tl.sum(s, axis=0)                    # one element left: the sum is that element
    p = div_ieee(u, total, LIBDEVICE)
    slots = tl.arange(0, KP)
    chosen = tl.zeros((KP,), dtype=tl.int64)
    picked = tl.zeros((KP,), dtype=tl.float32)
    remaining = p
    denom = 0.0
    for r in tl.static_range(K):
        best = tl.max(remaining, axis=0)
        e = tl.min(tl.where(remaining == best, idx, E), axis=0)     # equal p: the lower expert index
        chosen = tl.where(slots == r, e.to(tl.int64), chosen)
        picked = tl.where(slots == r, best, picked)
        remaining = tl.where(idx == e, -1.0, remaining)            # p >= 0: never chosen again
        if r == 0:
            denom = best
        else:
            denom = denom + best
    if NORMALIZE:
        picked = div_ieee(picked, tl.zeros((KP,), dtype=tl.float32) + denom, LIBDEVICE)
    mask = slots < K
    tl.store(experts_ptr + t * K + slots, chosen, mask=mask)
    tl.store(weights_ptr + t * K + slots, picked, mask=mask)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, normalize):
        tokens, n_experts = logits.shape
        experts = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
        weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
        if tokens:
            route_kernel[(tokens,)](logits, experts, weights, E=n_experts, LOG2E=n_experts.bit_length() - 1, K=top_k,
                                    KP=max(2, triton.next_power_of_2(top_k)), NORMALIZE=normalize,
                                    LIBDEVICE=not is_interpreter(), num_warps=4 if n_experts >= 256 else 1,
                                    enable_fp_fusion=False)
        ctx.save_for_backward(logits)
        ctx.top_k, ctx.normalize = top_k, normalize
        ctx.mark_non_differentiable(experts)
        return experts, weights

    @staticmethod
    def backward(ctx, _grad_experts, grad_weights):
        (logits,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            _, weights = torch_route(leaf, ctx.top_k, ctx.normalize)
            (grad_logits,) = torch.autograd.grad(weights, leaf, grad_weights)
        return grad_logits, None, None


def route(logits: torch.Tensor, top_k: int, normalize: bool):
    """(experts [T, k] int64, weights [T, k] fp32) of fp32 logits [T, E]: the kernel when E is a power of two
    up to 1,024, else the torch formulation (the same arithmetic)."""
    n_experts = logits.shape[1]
    if n_experts < 2 or n_experts > 1024 or n_experts & (n_experts - 1):
        return torch_route(logits, top_k, normalize)
    return _Route.apply(logits.contiguous(), top_k, normalize)


__all__ = ["route", "route_kernel"]
