"""Strict elementwise ops: rope and silu_mul (fp32 math, one rounding)."""

from __future__ import annotations

import torch

from rlalign.ops.torch_backend import clib


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
