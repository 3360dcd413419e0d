"""The temperature rule, defined once: how a temperature T turns fp32 LM-head logits into the
distribution that is sampled (``ops.sample``) and scored (``ops.logprob_entropy``: the rollout's
reported logprob and the trainer's), and which T a sampled token is scored at.

    z = logits / fp32(T)   IEEE fp32 division (round to nearest) by T rounded once to fp32, the
                           divisor a tensor on the logits' device: with a Python-scalar divisor
                           CUDA multiplies by a rounded reciprocal instead, which gives other bits
    T == 1                 no division (x / 1 == x exactly: the same bits, one pass fewer)
    sampling T == 0        greedy: the sampler takes the argmax of the raw logits (divisor 1)
    scoring                a token sampled at T is scored at ``logprob_temperature(T)``: T itself,
                           or 1.0 for a greedy token

So the logprob of a sampled token is log softmax(z)[token] for the very z the sampler drew it from
(greedy: the raw logits), and the trainer, scoring at the same logprob temperature through the same
op and this same division, gets the same bits. Every strict torch-backend path divides through
:func:`temperature_divisor` and :func:`divide_by_temperature`; the Triton kernels divide in-kernel
with ``tl.math.div_rn`` by the same fp32 T, skipped at T == 1 (rlalign/ops/triton_backend/logprob.py).
The native profile keeps the vendor formulation (``logits / T`` with a Python scalar).
"""

from __future__ import annotations

import math

import torch

from rlalign.contract.errors import fail


def logprob_temperature(sampling_temperature: float) -> float:
    """The temperature a token sampled at ``sampling_temperature`` is scored at: T for T > 0, 1.0 for
    greedy (T == 0). Raises ContractError for a negative or non-finite T."""
    if isinstance(sampling_temperature, bool) or not isinstance(sampling_temperature, (int, float)):
        raise fail("logprob_temperature", f"temperature must be a Python number, got "
                                          f"{type(sampling_temperature).__name__}")
    value = float(sampling_temperature)
    if not math.isfinite(value) or value < 0.0:
        raise fail("logprob_temperature", f"temperature must be finite and >= 0 (0 = greedy), got {value}")
    return value if value > 0.0 else 1.0


def temperature_divisor(temperature: float | torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """The divisor of the logits for ``temperature``.

    A Python T > 0: an fp32 0-dim tensor on ``device``, or None for T == 1.0 (no division).
    An fp32 [S] tensor of per-row sampling temperatures (0 = greedy): [S, 1], greedy rows divided by 1.
    """
    if isinstance(temperature, torch.Tensor):
        return torch.where(temperature == 0, 1.0, temperature).unsqueeze(-1)
    if temperature == 1.0:
        return None
    # torch.full, not torch.tensor: a fill kernel, no host-to-device copy, so it can be captured in a CUDA
    # graph; both round the Python float to fp32 once (round to nearest): the same divisor bits
    return torch.full((), temperature, dtype=torch.float32, device=device)


def divide_by_temperature(logits: torch.Tensor, divisor: torch.Tensor | None, *,
                          in_place: bool = False) -> torch.Tensor:
    """z = logits / divisor (fp32 IEEE division), or the logits themselves when ``divisor`` is None.
    ``in_place`` overwrites ``logits`` (for a freshly computed chunk)."""
    if divisor is None:
        return logits
    return logits.div_(divisor) if in_place else logits / divisor


__all__ = ["logprob_temperature", "temperature_divisor", "divide_by_temperature"]
