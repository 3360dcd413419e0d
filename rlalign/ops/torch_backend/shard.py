"""Torch-backend shard entries (see rlalign.ops.shard): the same pieces the full ops compute.

linear_partial is ``linear_fp32`` with a given segment count (tile_mm per segment, tree merge);
the logprob entries reuse the fused op's own block statistics, fold and dlogits code, so a
vocab-parallel merge reproduces ``logprob_entropy`` exactly.
"""

from __future__ import annotations

import torch

from rlalign.contract import spec
from rlalign.ops._registry import register
from rlalign.ops.torch_backend.linear import linear_fp32
from rlalign.ops.torch_backend.primitives import weight_grad
from rlalign.ops.temperature import temperature_divisor
from rlalign.ops.torch_backend.logprob import FoldState, block_stats, grad_scaled_logits, index_chunks, scaled_logits

VB = spec.VOCAB_BLOCK


@register("linear_partial", "torch")
def linear_partial(x, w, segments):
    # linear_fp32 with k_segments=segments cuts K into exactly `segments` parts (segments divides K).
    return linear_fp32(x.float(), w.float(), segments)


@register("linear_weight_grad", "torch")
def linear_weight_grad(grad_out, x, out_dtype):
    # exactly _StrictLinear.backward's dW: one fp32 GEMM over the rows
    return weight_grad(grad_out.float(), x.float()).to(out_dtype)


@register("logprob_shard_stats", "torch")
def logprob_shard_stats(hidden, weight, targets, v0, temperature, with_entropy):
    tokens, width = hidden.shape[0], weight.shape[0]
    blocks = -(-width // VB)
    stats = hidden.new_zeros((3 if with_entropy else 2, blocks, tokens), dtype=torch.float32)
    z_target = hidden.new_zeros(tokens, dtype=torch.float32)
    tau = temperature_divisor(temperature, hidden.device)
    local = targets - v0
    for cols in index_chunks(width, spec.DEFAULT_VOCAB_CHUNK):
        w_f32 = weight[cols].float()
        b0 = cols.start // VB
        for rows in index_chunks(tokens, spec.DEFAULT_TOKEN_CHUNK):
            z = scaled_logits(hidden[rows], w_f32, tau)
            for k, (m_b, s_b, w_b) in enumerate(block_stats(z, with_entropy)):
                stats[0, b0 + k, rows], stats[1, b0 + k, rows] = m_b, s_b
                if with_entropy:
                    stats[2, b0 + k, rows] = w_b
            inside = (local[rows] >= cols.start) & (local[rows] < cols.stop)
            picked = z.gather(1, (local[rows] - cols.start).clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
            z_target[rows] = torch.where(inside, picked, z_target[rows])
    return stats, z_target


@register("logprob_merge_stats", "torch")
def logprob_merge_stats(stats, z_target):
    with_entropy = stats.shape[0] == 3
    tokens = z_target.shape[0]
    state = FoldState(tokens, stats.device, with_entropy)
    rows = slice(0, tokens)
    for b in range(stats.shape[1]):
        state.fold(rows, b == 0, stats[0, b], stats[1, b], stats[2, b] if with_entropy else None)
    state.z_target.copy_(z_target)
    return state.finish()


@register("logprob_shard_dlogits", "torch")
def logprob_shard_dlogits(hidden, weight, targets, v0, lse, mu, temperature, g_lp, g_ent):
    tau = temperature_divisor(temperature, hidden.device)
    z = scaled_logits(hidden, weight.float(), tau)
    return grad_scaled_logits(z, targets - v0, lse, mu, g_lp, g_ent, tau)
