"""FFN kinds: the registry ``DecoderLayer`` builds its FFN from (``config.ffn_kind``).

A kind is a module class (or factory) called as ``kind(config, layer_index, dtype, device)`` (the
layer index lets a kind vary by layer, e.g. MoE models with dense layers); its forward is a
functional core that reads only the module's children (the transformers patch binds the same
forward onto Hugging Face's FFN module), and it declares its tensor-parallel plan (``tp_plan``). Adding a kind (e.g. a mixture-of-experts FFN) = one module defining the class
and calling :func:`register_ffn`, plus the family entry in :mod:`rlalign.models.architectures` that
sets ``ffn_kind`` / ``ffn_options``.
"""

from __future__ import annotations

from torch import nn

from rlalign.contract import spec
from rlalign.contract import sharding
from rlalign.models.blocks import dense_ffn_block
from rlalign.models.config import ModelConfig, ModelConfigError
from rlalign.models.modules import Linear, stack_rows

_KINDS: dict[str, type[nn.Module]] = {}


def register_ffn(kind: str):
    """Class decorator: make ``kind`` buildable by :func:`build_ffn`."""
    def add(cls):
        if kind in _KINDS:
            raise ValueError(f"FFN kind {kind!r} is already registered")
        _KINDS[kind] = cls
        return cls
    return add


def build_ffn(config: ModelConfig, layer_index: int, dtype, device) -> nn.Module:
    kind = _KINDS.get(config.ffn_kind)
    if kind is None:
        raise ModelConfigError(f"FFN kind {config.ffn_kind!r} is not implemented (known: {', '.join(_KINDS)})")
    return kind(config, layer_index, dtype, device)


@register_ffn("dense")
class MLP(nn.Module):
    """SiLU-gated dense FFN: ``down_proj(silu(gate_proj(x)) * up_proj(x))``; down_proj reduces over the
    canonical K partition."""

    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, device):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, False, dtype, device)
        self.up_proj = Linear(h, i, False, dtype, device)
        self.down_proj = Linear(i, h, False, dtype, device, k_segments=spec.K_SEGMENTS)
        self.stack_projections()

    def stack_projections(self) -> None:
        """gate_proj and up_proj's weights back to back (modules.stack_rows): one GEMM without grad."""
        stack_rows(self.gate_proj, self.up_proj)

    def forward(self, x):
        return dense_ffn_block(self, x)

    def tp_plan(self) -> dict[str, sharding.ShardSpec]:
        return {"gate_proj": sharding.COLUMN, "up_proj": sharding.COLUMN, "down_proj": sharding.ROW}


__all__ = ["register_ffn", "build_ffn", "MLP"]
