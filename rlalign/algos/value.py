"""The PPO value-model loss (the value model itself lives with the trainer: rlalign.train.value).

Shapes follow :mod:`rlalign.algos._segments`: per-token ``[T]``.
"""

from __future__ import annotations

import torch

from rlalign.algos import _segments as S


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None) -> torch.Tensor:
    """Per-token ``0.5 * (V - R)^2``; with ``clip`` (PPO2 value clipping):
    ``0.5 * max((V - R)^2, (V_old + clamp(V - V_old, -clip, clip) - R)^2)``.

    ``values`` carry the gradient; ``old_values`` (the value model before the update) and
    ``returns`` (the targets) are constants. Aggregate it like the policy loss.
    """
    S.check_flat("value_loss", values=values, old_values=old_values, returns=returns)
    S.check_float("value_loss", values=values, old_values=old_values, returns=returns)
    if clip is not None and not clip > 0:
        raise S.fail("value_loss", f"clip must be > 0 (or None for no clipping), got {clip}")
    old_values, returns = old_values.detach(), returns.detach()
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss


__all__ = ["value_loss"]
