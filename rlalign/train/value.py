"""The value model for PPO with GAE: the policy's decoder with a scalar head.

``V(prefix)`` for each completion token is read at the same hidden row the policy uses to predict
that token (the state before it): ``value_t = head(hidden[row_t])``, the head a strict
``ops.linear`` to one output, computed in fp32. It starts as a copy of the policy's backbone and a
zero head, and is trained on ``0.5 * (V - returns)^2`` (optionally clipped around the old values,
as in PPO2), aggregated like the policy loss, with its own AdamW.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rlalign import ops
from rlalign.models.batch import ForwardBatch
from rlalign.train.packing import micro_batches, scored_rows

__all__ = ["ValueModel", "value_loss"]


class ValueModel(nn.Module):
    def __init__(self, policy):
        super().__init__()
        self.backbone = copy.deepcopy(policy)
        if self.backbone.lm_head is not None:
            self.backbone.lm_head = None  # unused; the scalar head replaces it
        hidden = policy.config.hidden_size
        self.head_weight = nn.Parameter(torch.zeros(1, hidden, dtype=torch.float32, device=policy.device))
        self.head_bias = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=policy.device))

    def values(self, samples) -> torch.Tensor:
        """fp32 [completion tokens] values of ``samples`` ((tokens, prompt_len) pairs), one packed forward."""
        device = self.head_weight.device
        batch = ForwardBatch.packed([list(t) for t, _ in samples], device=device)
        rows, _ = scored_rows(samples, device)
        hidden = self.backbone.forward_hidden(batch).index_select(0, rows).float()
        return ops.linear(hidden, self.head_weight, self.head_bias)[:, 0]

    @torch.no_grad()
    def values_in_micro_batches(self, samples, max_tokens: int) -> torch.Tensor:
        parts = [self.values([samples[i] for i in mb]) for mb in micro_batches([len(t) for t, _ in samples], max_tokens)]
        return torch.cat(parts)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None) -> torch.Tensor:
    """Per-token ``0.5 * (V - R)^2``; with ``clip``: ``0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2)``."""
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss
