"""In-place weight updates: new values copied into a model's parameters, found by their Hugging Face names.

Copying in place keeps every tensor the engine holds valid (its captured decode graphs read the
parameters where they are).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from rlalign.rollout.errors import WeightsUpdateError


def copy_weights(model, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each (name, tensor) of ``weights`` into the model's parameter of that name (cast to its dtype and
    device); returns how many were copied. ``lm_head.weight`` is skipped when the head is tied to the
    embedding (as checkpoints store it). An unknown name or a shape that differs raises
    :class:`WeightsUpdateError`, leaving the tensors before it copied."""
    params = dict(model.named_parameters())
    tied_head = model.lm_head is None
    items = weights.items() if isinstance(weights, Mapping) else weights
    count = 0
    for name, tensor in items:
        if tied_head and name == "lm_head.weight":
            continue  # tied to the embedding, as checkpoints do
        param = params.get(name)
        if param is None:
            raise WeightsUpdateError(f"update_weights: unknown parameter {name!r} (expected Hugging Face names "
                                     f"such as {next(iter(params))!r})")
        if tuple(tensor.shape) != tuple(param.shape):
            raise WeightsUpdateError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is "
                                     f"{tuple(param.shape)}")
        param.copy_(tensor)
        count += 1
    return count
