"""Tap hook: the model's named boundaries, and the one place a recorder is plugged in.

Every engine that runs the decoder's math (``CausalLM``, the transformers patch, the vLLM plugin)
calls :func:`tap` at the boundaries below and :func:`note_batch` at the start of a forward. Both
are no-ops (one global read) unless a recorder is installed with :func:`install`; the parity
layer's capture (``rlalign.parity.capture``) is such a recorder. models/ never imports parity.

The boundary names, one table (token-major tensors, first dim = the forward's rows in packed order):

    embed                                 embedding output
    layers.{i}.input_norm                 input RMSNorm output
    layers.{i}.q / k / v                  q, k after qk-norm and rope, v: [T, heads, head_dim]
    layers.{i}.attn                       attention output before o_proj, [T, heads * head_dim]
    layers.{i}.o_proj                     o_proj output
    layers.{i}.residual                   residual stream after the attention add (post_norm's input)
    layers.{i}.post_norm                  post-attention RMSNorm output
    layers.{i}.router                     MoE layers only: fp32 router logits [T, experts]
    layers.{i}.routing                    MoE layers only: the chosen experts [T, k] (int64, rank order)
    layers.{i}.mlp                        FFN output (dense: down_proj output)
    final_norm                            final RMSNorm output
    logprob                               fp32 logprob of each row's target
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

EMBED = "embed"
FINAL_NORM = "final_norm"
LOGPROB = "logprob"
# Per-layer boundaries, in forward order; "residual" is the residual stream after the attention add
# (post_norm's input); "router"/"routing" exist in sparse (MoE) layers only.
LAYER_BOUNDARIES = ("input_norm", "q", "k", "v", "attn", "o_proj", "residual", "post_norm", "router", "routing", "mlp")
MOE_BOUNDARIES = ("router", "routing")


def layer_tap(layer: int, boundary: str) -> str:
    """The name of ``boundary`` (one of LAYER_BOUNDARIES) in decoder layer ``layer``."""
    if boundary not in LAYER_BOUNDARIES:
        raise ValueError(f"unknown layer boundary {boundary!r} (one of {', '.join(LAYER_BOUNDARIES)})")
    return f"layers.{layer}.{boundary}"


def all_names(num_layers: int, moe_layers=()) -> list[str]:
    """Every boundary name of a model with ``num_layers`` layers (``moe_layers``: the sparse ones), in forward order."""
    names = [EMBED]
    for i in range(num_layers):
        names += [layer_tap(i, b) for b in LAYER_BOUNDARIES if i in moe_layers or b not in MOE_BOUNDARIES]
    return names + [FINAL_NORM, LOGPROB]


class Recorder(Protocol):
    def record(self, name: str, tensor: torch.Tensor) -> None: ...

    def begin_batch(self, batch) -> None: ...


_INSTALLED: Recorder | None = None
_LOCK = threading.Lock()


def tap(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Hand ``tensor`` to the installed recorder (if any); always returns ``tensor`` unchanged."""
    recorder = _INSTALLED
    if recorder is not None:
        recorder.record(name, tensor)
    return tensor


def note_batch(batch) -> None:
    """Tell the installed recorder (if any) which rows the next taps hold: a ForwardBatch."""
    recorder = _INSTALLED
    if recorder is not None:
        recorder.begin_batch(batch)


def install(recorder: Recorder | None) -> Recorder | None:
    """Make ``recorder`` receive the taps (None: no recorder); returns the one it replaces, for
    :func:`install` to restore when the new one ends (recorders nest)."""
    global _INSTALLED
    with _LOCK:
        previous, _INSTALLED = _INSTALLED, recorder
    return previous


def installed() -> Recorder | None:
    return _INSTALLED


__all__ = ["tap", "note_batch", "install", "installed", "layer_tap", "all_names", "LAYER_BOUNDARIES", "MOE_BOUNDARIES",
           "EMBED", "FINAL_NORM", "LOGPROB", "Recorder"]
