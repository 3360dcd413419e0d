"""Triton-backend shard entries (see rlalign.ops.shard), built from the backend's own kernels.

linear_partial: the segmented GEMM with an fp32 output (the tree merged in the kernel, no rounding);
linear_weight_grad: the dW GEMM of the linear backward; the logprob entries launch the fused op's
stats / merge / dlogits kernels on a vocab shard (its 256-column tiles start at the shard offset,
a multiple of 1024, so they are the same absolute tiles as in the full op).
"""

from __future__ import annotations

import torch
import triton

from rlalign.ops.triton_backend._common import BLOCK_K, aligned, split_for
from rlalign.ops.triton_backend.gemm import gemm
from rlalign.ops.triton_backend.logprob import (GROUP_M, TOKEN_CHUNK, lp_sources, lp_tile, lp_grad_logits_kernel,
                                                lp_merge_kernel, lp_stats_kernel)


def linear_partial(x, w, segments):
    return gemm(x, w, b_trans=True, segments=segments, out_dtype=torch.float32)


def linear_weight_grad(grad_out, x, out_dtype):
    return gemm(grad_out.contiguous().to(x.dtype), x, a_trans=True, out_dtype=out_dtype)


def logprob_shard_stats(hidden, weight, targets, v0, temperature, with_entropy):
    h, w = aligned(hidden), aligned(weight)
    local = (targets - v0).contiguous()
    t, hdim = h.shape
    bm, bn, warps, stages = lp_tile(h.dtype)
    nt = triton.cdiv(w.shape[0], bn)
    stats = torch.zeros((3 if with_entropy else 2, nt, t), dtype=torch.float32, device=h.device)
    z_target = torch.zeros(t, dtype=torch.float32, device=h.device)
    if w.shape[0] == 0 or t == 0:
        return stats, z_target
    for r0 in range(0, t, TOKEN_CHUNK):
        r1 = min(t, r0 + TOKEN_CHUNK)
        hc = h[r0:r1]
        part = torch.empty((stats.shape[0], nt, r1 - r0), dtype=torch.float32, device=h.device)
        h_src, w_src, tma = lp_sources(hc, w, bm, bn)
        lp_stats_kernel[(triton.cdiv(r1 - r0, bm) * nt,)](
            h_src, w_src, local[r0:r1], part, z_target[r0:r1], r1 - r0, w.shape[0], hdim,
            hc.stride(0), hc.stride(1), w.stride(0), w.stride(1), float(temperature),
            BM=bm, BN=bn, BK=BLOCK_K, USE_TMA=tma, SPLIT=split_for(h.dtype), HAS_TEMP=temperature != 1.0,
            WITH_W=with_entropy, GROUP=GROUP_M, num_warps=warps, num_stages=stages)
        stats[:, :, r0:r1] = part
    return stats, z_target


def logprob_merge_stats(stats, z_target):
    with_entropy = stats.shape[0] == 3
    t = z_target.shape[0]
    lp = torch.empty(t, dtype=torch.float32, device=stats.device)
    lse, ent, mu = torch.empty_like(lp), torch.empty_like(lp), torch.empty_like(lp)
    bt = 256
    lp_merge_kernel[(triton.cdiv(t, bt),)](stats, z_target, lp, ent, lse, mu, t, stats.shape[1],
                                           BT=bt, WITH_W=with_entropy, num_warps=4)
    return lp, (ent if with_entropy else None), lse, (mu if with_entropy else None)


def logprob_shard_dlogits(hidden, weight, targets, v0, lse, mu, temperature, g_lp, g_ent):
    h, w = aligned(hidden), aligned(weight)
    t, hdim = h.shape
    vc = w.shape[0]
    g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
    has_ent = g_ent is not None and mu is not None
    g_ent = g_ent.float().contiguous() if has_ent else g_lp
    bm, bn, warps, stages = lp_tile(h.dtype)
    dz = torch.empty((t, triton.cdiv(max(vc, 1), 64) * 64), dtype=h.dtype, device=h.device)[:, :vc]
    if vc == 0 or t == 0:
        return dz
    h_src, w_src, tma = lp_sources(h, w, bm, bn)
    lp_grad_logits_kernel[(triton.cdiv(t, bm) * triton.cdiv(vc, bn),)](
        h_src, w_src, targets.contiguous(), lse, mu if has_ent else lse, g_lp, g_ent, dz, t, vc, hdim, v0,
        h.stride(0), h.stride(1), w.stride(0), w.stride(1), dz.stride(0), float(temperature),
        BM=bm, BN=bn, BK=BLOCK_K, USE_TMA=tma, SPLIT=split_for(h.dtype), HAS_TEMP=temperature != 1.0,
        HAS_ENT=has_ent, GROUP=GROUP_M, num_warps=warps, num_stages=stages)
    return dz


IMPLEMENTATIONS = {
    "linear_partial": linear_partial,
    "linear_weight_grad": linear_weight_grad,
    "logprob_shard_stats": logprob_shard_stats,
    "logprob_merge_stats": logprob_merge_stats,
    "logprob_shard_dlogits": logprob_shard_dlogits,
}
