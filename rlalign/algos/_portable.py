"""The elementwise math of the losses, advantages and statistics whose bits a device may change, chosen by the
profile: in the ``portable`` profile (the current one) the portable profile's own (rlalign/ops/portable: a
polynomial exp, a correctly rounded sqrt, IEEE division by a tensor, never by a scalar, which CUDA turns into a
multiply by a rounded reciprocal), the same bits on the CPU and a CUDA GPU; otherwise torch's, exactly as before.
"""

from __future__ import annotations

import torch

from rlalign.contract.profiles import Profile, current_profile
from rlalign.ops.portable import arith, grad


def portable() -> bool:
    return current_profile() is Profile.PORTABLE


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x, differentiable; portable: the shared polynomial (float64 inputs computed in fp32 and widened)."""
    if not portable():
        return torch.exp(x)
    return grad.exp(x) if x.dtype == torch.float32 else grad.exp(x.float()).to(x.dtype)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Square root (no gradient needed by the callers); portable: correctly rounded (fp32)."""
    if not portable():
        return torch.sqrt(x)
    return arith.sqrt(x) if x.dtype == torch.float32 else arith.sqrt(x.float()).to(x.dtype)


def div(x: torch.Tensor, d: "torch.Tensor | float") -> torch.Tensor:
    """x / d; portable: d as a tensor of ndim >= 1 on x's device, in x's dtype (IEEE division on every device)."""
    if not portable():
        return x / d
    if isinstance(d, torch.Tensor) and d.ndim >= 1:
        return x / d
    out = arith.div(x, float(d)) if not isinstance(d, torch.Tensor) else x / d.to(x.device, x.dtype).reshape(1)
    return out.reshape(x.shape)   # a 0-dim x stays 0-dim
