"""The mixture-of-experts FFN kind (``ffn_kind="moe"``): Qwen3-MoE's sparse block, on rlalign's MoE ops.

Per token x (rows [T, hidden]; the exact arithmetic of each step is the contract's, rlalign.ops.moe)::

    logits       = router_logits(x, gate.weight)                 fp32 [T, E]
    experts, w   = moe_route(logits, top_k, normalize=norm_topk_prob)
    y[t, j]      = down_e(silu(gate_proj_e(x_t)) * up_proj_e(x_t)),  e = experts[t, j]
    out          = moe_combine(y, w, experts)                     fixed order by expert index, fp32

Which layers are sparse (Qwen3-MoE's rule): layer i is sparse when i is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; the others are the dense FFN of ``intermediate_size``.

Weights keep the checkpoint's names: ``mlp.gate.weight`` [E, hidden] and
``mlp.experts.{e}.{gate,up,down}_proj.weight``; the block core :func:`sparse_moe_block` takes the weights
as arguments, so the transformers patch calls it with views of Hugging Face's stacked expert tensors.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Sequence

import torch
from torch import nn

from rlalign import ops
from rlalign.contract import spec
from rlalign.contract import sharding
from rlalign.models.config import ModelConfig
from rlalign.models.ffn import MLP, register_ffn
from rlalign.models.modules import Linear
from rlalign.models.taps import layer_tap, tap


def is_sparse_layer(options: dict, layer_index: int) -> bool:
    return (layer_index not in options.get("mlp_only_layers", ())
            and options["num_experts"] > 0 and (layer_index + 1) % options.get("decoder_sparse_step", 1) == 0)


# ---- the routing record (training metrics, the load-balancing loss) ---------------------------------------

class RoutingRecord:
    """What each sparse layer routed in the forwards run inside :func:`record_routing`: per layer index, the
    list of (router logits fp32 [T, E], experts [T, k]) of each forward, logits still in the autograd graph."""

    def __init__(self):
        self.layers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(self, layer: int, logits: torch.Tensor, experts: torch.Tensor) -> None:
        self.layers.setdefault(layer, []).append((logits, experts))


_RECORD = threading.local()


@contextlib.contextmanager
def record_routing():
    """Collect every sparse layer's routing in this thread while the context is open."""
    previous, record = getattr(_RECORD, "current", None), RoutingRecord()
    _RECORD.current = record
    try:
        yield record
    finally:
        _RECORD.current = previous


# ---- the block core ----------------------------------------------------------------------------------------

def sparse_moe_block(x: torch.Tensor, router_w: torch.Tensor, gate_w: Sequence[torch.Tensor],
                     up_w: Sequence[torch.Tensor], down_w: Sequence[torch.Tensor], *, top_k: int, normalize: bool,
                     layer: int) -> torch.Tensor:
    """The sparse FFN of rows ``x`` [T, hidden] (see the module docstring); taps ``router`` and ``routing``."""
    logits = tap(layer_tap(layer, "router"), ops.router_logits(x, router_w))
    experts, weights = ops.moe_route(logits, top_k, normalize=normalize)
    tap(layer_tap(layer, "routing"), experts)
    record = getattr(_RECORD, "current", None)
    if record is not None:
        record.add(layer, logits, experts)
    y = ops.moe_experts(x, experts, gate_w, up_w, down_w, down_segments=spec.MOE_K_SEGMENTS)
    return ops.moe_combine(y, weights, experts)


# ---- modules --------------------------------------------------------------------------------------------------

class Expert(nn.Module):
    """One expert's SwiGLU FFN weights (names as in the checkpoint)."""

    def __init__(self, hidden: int, inter: int, dtype, device):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, False, dtype, device)
        self.up_proj = Linear(hidden, inter, False, dtype, device)
        self.down_proj = Linear(inter, hidden, False, dtype, device, k_segments=spec.MOE_K_SEGMENTS)

    def tp_plan(self) -> dict[str, sharding.ShardSpec]:
        return {"gate_proj": sharding.COLUMN, "up_proj": sharding.COLUMN, "down_proj": sharding.ROW}


class SparseMoE(nn.Module):
    """Router ``gate`` [E, hidden] and ``experts`` (E x :class:`Expert`); forward = :func:`sparse_moe_block`."""

    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, device):
        super().__init__()
        opts = cfg.ffn_options
        self.layer_index = layer_index
        self.top_k, self.normalize = int(opts["num_experts_per_tok"]), bool(opts["norm_topk_prob"])
        self.gate = Linear(cfg.hidden_size, opts["num_experts"], False, dtype, device)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, opts["moe_intermediate_size"], dtype, device)
                                     for _ in range(opts["num_experts"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparse_moe_block(x, self.gate.weight, [e.gate_proj.weight for e in self.experts],
                                [e.up_proj.weight for e in self.experts], [e.down_proj.weight for e in self.experts],
                                top_k=self.top_k, normalize=self.normalize, layer=self.layer_index)

    def tp_plan(self) -> dict[str, sharding.ShardSpec]:
        return {}   # the router is replicated; each Expert declares its own plan (like the dense FFN)


@register_ffn("moe")
def build_moe_layer_ffn(cfg: ModelConfig, layer_index: int, dtype, device) -> nn.Module:
    """The sparse block on Qwen3-MoE's sparse layers, the dense FFN (``intermediate_size``) elsewhere."""
    if is_sparse_layer(cfg.ffn_options, layer_index):
        return SparseMoE(cfg, layer_index, dtype, device)
    return MLP(cfg, layer_index, dtype, device)


__all__ = ["is_sparse_layer", "sparse_moe_block", "SparseMoE", "Expert", "record_routing", "RoutingRecord"]

