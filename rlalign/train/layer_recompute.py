"""Activation checkpointing (``optim.activation_checkpointing``): each decoder layer recomputed in backward.

:func:`recompute_layers` puts a :class:`RecomputedLayer` in each decoder layer's place: a ``DecoderLayer`` over
the very same submodules (same names, so parameter names, the state dict and checkpoints are unchanged) whose
forward runs the layer's own forward through ``torch.utils.checkpoint.checkpoint`` (non-reentrant) when grad is
enabled: its activations are not kept but recomputed in backward, with the same ops on the same inputs (the
same bits). A no-grad forward (scoring, the reference) runs the layer as it is.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from rlalign.models.decoder import DecoderLayer


class RecomputedLayer(DecoderLayer):
    """A decoder layer whose activations are recomputed in backward; holds the wrapped layer's submodules and
    attributes (not copies)."""

    def __init__(self, layer: DecoderLayer):
        torch.nn.Module.__init__(self)
        if next(layer.parameters(recurse=False), None) is not None or next(layer.buffers(recurse=False), None) is not None:
            raise TypeError("RecomputedLayer: a decoder layer holds its tensors in submodules, not directly")
        for name, value in vars(layer).items():   # plain attributes (layer_index, ...); the module's own state is set above
            if not name.startswith("_"):
                setattr(self, name, value)
        for name, child in layer.named_children():
            self.add_module(name, child)

    def forward(self, *args):
        if torch.is_grad_enabled():
            return checkpoint(super().forward, *args, use_reentrant=False)
        return super().forward(*args)


def recompute_layers(model) -> None:
    """Replace every decoder layer of ``model`` (a CausalLM) by its :class:`RecomputedLayer`."""
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = RecomputedLayer(layer)


__all__ = ["RecomputedLayer", "recompute_layers"]
