"""The value model for PPO with GAE: the policy's decoder with a scalar head.

``V(prefix)`` for each completion token is read at the same hidden row the policy uses to predict
that token (the state before it): ``value_t = head(hidden[row_t])``, the head a strict
``ops.linear`` to one output, computed in fp32. It starts as a copy of the policy's backbone and a
zero head, and is trained on :func:`rlalign.algos.value_loss` (``0.5 * (V - returns)^2``, optionally
clipped around the old values as in PPO2), aggregated like the policy loss, with its own AdamW.
It reads the step's :class:`~rlalign.train.packing.TrainBatch` micro-batches (the policy's layout).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rlalign import ops
from rlalign.train.packing import MicroBatch, TrainBatch

__all__ = ["ValueModel"]


class ValueModel(nn.Module):
    def __init__(self, policy):
        super().__init__()
        self.backbone = copy.deepcopy(policy)
        if self.backbone.lm_head is not None:
            self.backbone.lm_head = None  # unused; the scalar head replaces it
        hidden = policy.config.hidden_size
        self.head_weight = nn.Parameter(torch.zeros(1, hidden, dtype=torch.float32, device=policy.device))
        self.head_bias = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=policy.device))

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """fp32 [completion tokens of ``mb``] values, one packed forward (differentiable)."""
        hidden = self.backbone.forward_hidden(mb.forward).index_select(0, mb.rows).float()
        return ops.linear(hidden, self.head_weight, self.head_bias)[:, 0]

    @torch.no_grad()
    def old_values(self, batch: TrainBatch) -> torch.Tensor:
        """fp32 [T] values of every completion token of the step, before the update."""
        return torch.cat([self.values(mb) for mb in batch.micro_batches])
