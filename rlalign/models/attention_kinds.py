"""Attention kinds: the registry ``DecoderLayer`` builds each layer's token mixer from.

A kind is a module class called as ``kind(config, layer_index, dtype, device)`` whose forward is
``attn(x, cos, sin, attend)`` -> [T, hidden] (``attend``: rlalign.models.blocks' packed or paged attention, whose
``batch`` is the forward's ForwardBatch), held by the layer under the kind's ``module_name`` (the checkpoint's name).
A layer's kind (:func:`layer_attention_kind`) is ``"linear"`` on a "linear_attention" layer (``layer_types``), else
``config.attention_kind``. Registered: ``"mha"`` (multi-head / grouped-query attention,
rlalign.models.decoder.Attention), ``"mla"`` (DeepSeek's multi-head latent attention, rlalign.models.deepseek_v3),
``"gated"`` (Qwen3-Next's full attention with a per-head output gate, rlalign.models.qwen3_next) and ``"linear"``
(Qwen3-Next's Gated-DeltaNet, ``linear_attn``, rlalign.models.gated_deltanet).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from rlalign.models.config import ModelConfig, ModelConfigError
from rlalign.models.linear_cache import LINEAR_ATTENTION

LINEAR = "linear"


@dataclasses.dataclass(frozen=True)
class _Kind:
    cls: type[nn.Module]
    module_name: str


_KINDS: dict[str, _Kind] = {}


def register_attention(kind: str, module_name: str = "self_attn"):
    """Class decorator: make ``kind`` buildable by :func:`build_attention`, held under ``module_name``."""
    def add(cls):
        if kind in _KINDS:
            raise ValueError(f"attention kind {kind!r} is already registered")
        _KINDS[kind] = _Kind(cls, module_name)
        return cls
    return add


def layer_attention_kind(config: ModelConfig, layer_index: int) -> str:
    """The attention kind of layer ``layer_index``: "linear" on a "linear_attention" layer, else the config's."""
    if config.layer_types is not None and config.layer_types[layer_index] == LINEAR_ATTENTION:
        return LINEAR
    return config.attention_kind


def build_attention(config: ModelConfig, layer_index: int, dtype, device) -> tuple[str, nn.Module]:
    """(the module's name in the layer, the module) of layer ``layer_index``'s attention kind."""
    name = layer_attention_kind(config, layer_index)
    kind = _KINDS.get(name)
    if kind is None:
        raise ModelConfigError(f"attention kind {name!r} is not implemented (known: {', '.join(_KINDS)})")
    return kind.module_name, kind.cls(config, layer_index, dtype, device)


__all__ = ["LINEAR", "register_attention", "layer_attention_kind", "build_attention"]
