"""Public dense ops: linear, linear_group, rms_norm, rope, silu_mul, embedding.

Each validates its inputs (strict fails closed with a message naming the op), then runs the
strict backend for the tensors' device or, in the native profile, the vendor path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlalign.contract.profiles import Profile, as_profile
from rlalign.ops import _checks as chk
from rlalign.ops._dispatch import strict_impl
from rlalign.ops.portable import dense as portable_dense
from rlalign.ops.portable import grad as portable_grad
from rlalign.contract.errors import fail


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           k_segments: int | None = None, profile=None) -> torch.Tensor:
    """y = x @ weight.T (+ bias). x [..., K], weight [N, K], bias [N].

    ``k_segments=P`` selects the canonical K partition of row-parallel layers (o_proj, down_proj):
    P segments reduced from zero, merged by a fixed balanced tree, so tensor-parallel degrees
    1..P give the same bits.
    """
    if as_profile(profile) is Profile.NATIVE:
        return F.linear(x, weight, bias)
    _check_linear(x, weight, bias)
    chk.finite("linear", "x", x)
    return strict_impl("linear", x.device, profile)(x, weight, bias, k_segments)


def linear_group(x: torch.Tensor, weights, biases=None, *, views: bool = False,
                 profile=None) -> tuple[torch.Tensor, ...]:
    """``(linear(x, w, b) for w, b in zip(weights, biases))`` -- each output with exactly those bits -- for the
    projections of one input (q/k/v, gate/up). Where the weights are consecutive row blocks of one tensor
    (:func:`rlalign.ops.stacking.stacked_rows`; the decoder lays its projections out so) a backend may run them as ONE GEMM over the
    stacked weight: the Triton backend does where its Hopper kernel takes the whole call (decode batches), which
    writes each block to its own tensor; an element's operations do not depend on N there (they do on the CPU,
    whose route is chosen per (K, N): the torch backend runs one linear per weight). ``biases``: None, or one
    bias (or None) per weight. ``views``: the caller takes outputs whose rows are strided (column views of one
    [..., sum N] tensor; silu_mul does), so the stacked GEMM may also run where only one output tensor is possible
    (the Triton kernel)."""
    weights = tuple(weights)
    biases = (None, ) * len(weights) if biases is None else tuple(biases)
    if not weights or len(biases) != len(weights):
        raise fail("linear", f"linear_group takes one or more weights and as many biases, got {len(weights)} "
                             f"weights and {len(biases)} biases")
    if as_profile(profile) is Profile.NATIVE:
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    for w, b in zip(weights, biases):
        _check_linear(x, w, b)
    chk.finite("linear", "x", x)
    return strict_impl("linear_group", x.device, profile)(x, weights, biases, views)


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    chk.dtype_ok("linear", *tensors)
    chk.same_device("linear", *tensors)
    chk.ndim("linear", "weight", weight, 2)
    if x.shape[-1] != weight.shape[1]:
        raise fail("linear", f"x has {x.shape[-1]} input features but weight is {tuple(weight.shape)} ([N, K])")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise fail("linear", f"bias shape {tuple(bias.shape)} does not match N={weight.shape[0]}")


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, *more: torch.Tensor) -> None:
    """rms_norm's strict argument checks (also ops.rope_write_kv's for its fused q/k norms): strict dtypes, one
    device (``more``: e.g. the residual), a weight of the hidden size."""
    chk.dtype_ok("rms_norm", x, weight, *more)
    chk.same_device("rms_norm", x, weight, *more)
    if weight.shape != x.shape[-1:]:
        raise fail("rms_norm", f"weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             profile=None):
    """RMSNorm over the last dim. With ``residual``: h = x + residual (rounded to x.dtype) is
    normalised and ``(normed, h)`` is returned, h being the new residual stream."""
    if residual is not None and residual.shape != x.shape:
        raise fail("rms_norm", f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if as_profile(profile) is Profile.NATIVE:
        if residual is not None:
            x = x + residual  # one rounding to the stream dtype, the same in both profiles
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
        return out if residual is None else (out, x)
    tensors = (x, weight) if residual is None else (x, weight, residual)
    check_rms_norm(x, weight, *tensors[2:])
    impl = strict_impl("rms_norm", x.device, profile)
    if residual is not None and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        # the backend adds the residual itself (h = x + residual rounded once to x.dtype; the Triton kernel in the
        # norm's own launch), then normalises h; h is checked as x is below
        out, h = impl(x, weight, float(eps), residual=residual)
        chk.finite("rms_norm", "x", h)
        return out, h
    if residual is not None:
        x = x + residual  # one rounding to the stream dtype
    chk.finite("rms_norm", "x", x)
    out = impl(x, weight, float(eps))
    return out if residual is None else (out, x)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies in float64 (default RoPE, or ``rope_type: llama3`` scaling)."""
    if head_dim % 2:
        raise fail("rope", f"head_dim must be even, got {head_dim}")
    inv = 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv
    if kind == "yarn":
        return _yarn_inv_freq(inv, head_dim, float(theta), scaling)
    if kind != "llama3":
        raise fail("rope", f"rope scaling type {kind!r} is not supported (supported: default, llama3, yarn)")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _yarn_inv_freq(inv: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (transformers' ``_compute_yarn_parameters``, in float64): the frequencies between the correction
    dims of ``beta_fast`` / ``beta_slow`` rotations over the original context blend linearly from
    extrapolation (inv) to interpolation (inv / factor); ``truncate`` (default true) rounds the range outward."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv / factor) * (1 - extrapolation) + inv * extrapolation


def rope_attention_scaling(scaling: dict | None) -> float:
    """The factor YaRN multiplies cos and sin by (transformers' ``attention_factor``); 1 for other ropes."""
    scaling = scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, float(scaling["mscale"])) / mscale(factor, float(scaling["mscale_all_dim"]))
    return mscale(factor)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0, *, profile=None):
    """cos/sin tables [T, D/2] for absolute ``positions``: computed in float64, stored fp32. Portable profile:
    sin / cos by its own float64 polynomials (rlalign.ops.portable.dense.rope_tables), the same on every device."""
    if as_profile(profile) is Profile.PORTABLE:
        return portable_dense.rope_tables(positions, inv_freq, attention_scaling)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(device=positions.device, dtype=torch.float64)
    return ((torch.cos(angles) * attention_scaling).float(), (torch.sin(angles) * attention_scaling).float())


def check_rope(op: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, strict: bool) -> None:
    """rope's argument checks (also ops.rope_write_kv's, for q and for k): x [T, H, D], cos/sin [T, D/2];
    strict: a strict dtype and fp32 tables."""
    chk.ndim(op, "x", x, 3)
    if cos.shape != (x.shape[0], x.shape[2] // 2) or sin.shape != cos.shape:
        raise fail(op, f"cos/sin must be [T, D/2] = {(x.shape[0], x.shape[2] // 2)}, got {tuple(cos.shape)}")
    if strict:
        chk.dtype_ok(op, x)
        if cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise fail(op, "cos/sin tables must be float32 (build them with rope_cos_sin)")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, profile=None) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] with per-token tables cos/sin [T, D/2] (fp32)."""
    strict = as_profile(profile) is not Profile.NATIVE
    check_rope("rope", x, cos, sin, strict)
    if strict:
        return strict_impl("rope", x.device, profile)(x, cos, sin)
    half = x.shape[-1] // 2
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, profile=None) -> torch.Tensor:
    """silu(gate) * up (the SwiGLU MLP's activation)."""
    if gate.shape != up.shape:
        raise fail("silu_mul", f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if as_profile(profile) is Profile.NATIVE:
        return F.silu(gate) * up
    chk.dtype_ok("silu_mul", gate, up)
    return strict_impl("silu_mul", gate.device, profile)(gate, up)


def embedding(ids: torch.Tensor, weight: torch.Tensor, *, profile=None) -> torch.Tensor:
    """Row gather (exact in every profile). Out-of-range ids raise naming the id. Portable profile with a
    gradient: the weight's gradient by rlalign.ops.portable.grad.embedding_grad (fixed order, every device)."""
    chk.index_dtype("embedding", "ids", ids)
    if ids.numel():
        # a host sync: like the other index validations, skipped while a CUDA graph is captured
        # (its caller checks the ids) -- chk.memo
        chk.memo("embedding_ids", lambda: _check_ids(ids, weight.shape[0]), ids, extra=(weight.shape[0],))
    if as_profile(profile) is Profile.PORTABLE and torch.is_grad_enabled() and weight.requires_grad:
        return portable_grad.embedding(ids, weight)   # a fixed-order backward (F.embedding's is atomic on CUDA)
    return F.embedding(ids, weight)


def _check_ids(ids: torch.Tensor, vocab: int) -> bool:
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise fail("embedding", f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab})")
    return True
