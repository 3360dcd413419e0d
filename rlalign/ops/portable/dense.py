"""Portable dense ops: linear, linear_group, rms_norm, rope (and its tables), silu_mul, rope_write_kv.

Exact formulas (fp32 math; bf16 inputs widened exactly, outputs rounded once to the input dtype):

    linear      y[m, n] = tree_sum_k(x[m, k] * w[n, k])  (+ b[n], one add)       arith.matmul_nt
    rms_norm    ms = tree_sum(x * x) / H;  r = 1 / sqrt(ms + eps);  y = (x * r) * w   (sqrt correctly rounded)
    rope        [x1 * c - x2 * s, x2 * c + x1 * s]  (each product rounded, then the add)
    rope tables angles = float64(position) * inv_freq (float64), sin / cos by arith.sin_cos64 in float64,
                times attention_scaling, rounded once to fp32
    silu_mul    (g / (1 + exp(-g))) * up
"""

from __future__ import annotations

import torch

from rlalign.ops.portable import arith
from rlalign.ops.torch_backend.elementwise import compose_rope_write_kv
from rlalign.reductions import tree_sum


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k_segments: int | None = None):
    """ops.linear in the portable profile (``k_segments`` changes nothing: the tree over K is one order for every
    partition, and tensor parallelism is refused by the profile)."""
    lead = x.shape[:-1]
    y = arith.matmul_nt(x.reshape(-1, x.shape[-1]).float(), weight.float())
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*lead, weight.shape[0]).to(x.dtype)


def linear_group(x: torch.Tensor, weights, biases, views: bool = False):
    """ops.linear_group: one :func:`linear` per weight (the same bits as separate calls)."""
    return tuple(linear(x, w, b) for w, b in zip(weights, biases))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """ops.rms_norm; with ``residual``: h = x + residual (one rounding to x.dtype) first, -> (y, h)."""
    if residual is not None:
        h = x + residual
        return rms_norm(h, weight, eps), h
    xf = x.float()
    ms = arith.div(tree_sum(xf * xf), float(x.shape[-1]))
    inv = arith.div(torch.ones_like(ms), arith.sqrt(ms + float(eps)))
    return ((xf * inv.unsqueeze(-1)) * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] with tables [T, D/2] (fp32)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """cos / sin tables [T, D/2] fp32 for ``positions`` (see the module doc), on positions' device."""
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(device=positions.device, dtype=torch.float64)
    sin, cos = arith.sin_cos64(angles)
    if attention_scaling != 1.0:
        sin, cos = sin * float(attention_scaling), cos * float(attention_scaling)
    return cos.float(), sin.float()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, one rounding to gate's dtype."""
    return (arith.silu(gate.float()) * up.float()).to(gate.dtype)


def rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, check_k, qk_norm=None):
    """ops.rope_write_kv: (q / k rms_norm first with ``qk_norm``) rope of q and k, the K check, the cache rows."""
    return compose_rope_write_kv(rms_norm, rope, q, k, v, cos, sin, k_cache, v_cache, slots, check_k, qk_norm)
