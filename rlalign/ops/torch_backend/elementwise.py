"""Strict elementwise ops: rope and silu_mul (fp32 math, one rounding); the KV-cache row copy
(``write_kv_rows``, every profile's) and rope_write_kv (rope of q and k, then that copy)."""

from __future__ import annotations

import torch

from rlalign.ops.torch_backend import clib
from rlalign.ops.torch_backend.norm import rms_norm


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [T, H, D]; cos/sin [T, D/2] fp32 (from float64 tables). Without autograd on
    the CPU the same operations run compiled (csrc/elementwise.c, the same bits)."""
    lib = clib.for_tensors(x)
    if lib is not None:
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty_like(x)
        lib.rl_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1], x.shape[2],
                    int(x.dtype == torch.bfloat16), out.data_ptr())
        return out
    return rope_formula(x, cos, sin)


def rope_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The definition, in differentiable torch ops."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return out.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32; silu(g) = g / (1 + exp(-g)) (not torch.sigmoid: see contract). Without
    autograd on the CPU: torch's exp(-g), then the rest compiled (csrc/elementwise.c, the same bits)."""
    lib = clib.for_tensors(gate, up)
    if lib is not None:
        gate, up = gate.contiguous(), up.contiguous()
        e = torch.exp(-gate.float()).contiguous()
        out = torch.empty_like(gate)
        lib.rl_silu_mul(gate.data_ptr(), e.data_ptr(), up.data_ptr(), gate.numel(), int(gate.dtype == torch.bfloat16),
                        out.data_ptr(), torch.get_num_threads())
        return out
    return silu_mul_formula(gate, up)


def silu_mul_formula(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The definition, in differentiable torch ops."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)


def write_kv_rows(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> None:
    """Token t's rows k[t], v[t] [Hkv, D] to cache slot ``slots[t]`` (int64, validated by the caller): exact
    copies. The cache holds values, never a place in an autograd graph."""
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(n_slots, *k_cache.shape[2:]).index_copy_(0, slots, k.detach())
    v_cache.view(n_slots, *v_cache.shape[2:]).index_copy_(0, slots, v.detach())


def rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, check_k, qk_norm=None):
    """ops.rope_write_kv on the torch backend: (with ``qk_norm`` = (q weight, k weight, eps): rms_norm of q
    and of k first) rope of q and of k, ``check_k(rope(k), None)`` (the op's K check, before anything is
    written, as write_kv_cache does), then the rows to their slots."""
    return compose_rope_write_kv(rms_norm, rope, q, k, v, cos, sin, k_cache, v_cache, slots, check_k, qk_norm)


def compose_rope_write_kv(norm_fn, rope_fn, q, k, v, cos, sin, k_cache, v_cache, slots, check_k, qk_norm=None):
    """The order of rope_write_kv, for a profile's own ``norm_fn`` / ``rope_fn``: the q/k norms, rope, the K
    check before anything is written, then the rows to their slots (a copy: the same in every profile)."""
    if qk_norm is not None:
        q, k = norm_fn(q, qk_norm[0], qk_norm[2]), norm_fn(k, qk_norm[1], qk_norm[2])
    q, k = rope_fn(q, cos, sin), rope_fn(k, cos, sin)
    check_k(k, None)
    write_kv_rows(k, v, k_cache, v_cache, slots)
    return q, k
