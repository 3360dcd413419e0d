"""Attention kinds: the registry ``DecoderLayer`` builds its attention module from (``config.attention_kind``).

A kind is a module class called as ``kind(config, layer_index, dtype, device)`` whose forward is
``attn(x, cos, sin, attend)`` -> [T, hidden] (``attend``: rlalign.models.blocks' packed or paged attention).
Registered: ``"mha"`` (multi-head / grouped-query attention, rlalign.models.decoder.Attention) and ``"mla"``
(DeepSeek's multi-head latent attention, rlalign.models.deepseek_v3).
"""

from __future__ import annotations

from torch import nn

from rlalign.models.config import ModelConfig, ModelConfigError

_KINDS: dict[str, type[nn.Module]] = {}


def register_attention(kind: str):
    """Class decorator: make ``kind`` buildable by :func:`build_attention`."""
    def add(cls):
        if kind in _KINDS:
            raise ValueError(f"attention kind {kind!r} is already registered")
        _KINDS[kind] = cls
        return cls
    return add


def build_attention(config: ModelConfig, layer_index: int, dtype, device) -> nn.Module:
    kind = _KINDS.get(config.attention_kind)
    if kind is None:
        raise ModelConfigError(f"attention kind {config.attention_kind!r} is not implemented (known: "
                               f"{', '.join(_KINDS)})")
    return kind(config, layer_index, dtype, device)


__all__ = ["register_attention", "build_attention"]
