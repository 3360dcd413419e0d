"""The mixture-of-experts FFN kind (``ffn_kind="moe"``): Qwen3-MoE's sparse block, on rlalign's MoE ops.

Per token x (rows [T, hidden]; the exact arithmetic of each step is the contract's, rlalign.ops.moe)::

    logits       = router_logits(x, gate.weight)                 fp32 [T, E]
    experts, w   = moe_route(logits, top_k, normalize=norm_topk_prob)
    y[t, j]      = down_e(silu(gate_proj_e(x_t)) * up_proj_e(x_t)),  e = experts[t, j]
    out          = moe_combine(y, w, experts)                     fixed order by expert index, fp32

With ``shared_expert_intermediate_size`` in the options (Qwen3-Next; Hugging Face's ``Qwen3NextSparseMoeBlock``) a
sparse layer also has a gated shared expert (:class:`SharedExpertMoE`)::

    out          = moe_combine(...) + shared_expert_gate(shared_expert(x), x @ shared_expert_gate.weight^T)
                   shared_expert: the dense SwiGLU MLP of shared_expert_intermediate_size, gate weight [1, hidden]

(:func:`add_shared_expert`, which DeepSeek-V3's ungated shared experts use too: one rounding of the sum).

Which layers are sparse (Qwen3-MoE's rule): layer i is sparse when i is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; the others are the dense FFN of ``intermediate_size``.

Weights: the router ``mlp.gate.weight`` [E, hidden] and the experts stacked, one parameter per projection
(``mlp.experts.gate_proj`` / ``up_proj`` [E, I, hidden], ``mlp.experts.down_proj`` [E, hidden, I]:
:class:`StackedExperts`); checkpoints keep Hugging Face's per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``
(rlalign.models.layout maps them). The block core :func:`sparse_moe_block` takes the experts'
FFNs as a callable, so the transformers patch passes :func:`stacked_expert_ffns` over views of Hugging Face's
stacked expert tensors, and tensor parallelism (the ``EXPERTS`` plan of :class:`SparseMoE`) its sharded experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable, Sequence

import torch
from torch import nn

from rlalign import ops
from rlalign.contract import spec
from rlalign.contract import sharding
from rlalign.models.config import ModelConfig
from rlalign.models.ffn import MLP, register_ffn
from rlalign.models.modules import Linear
from rlalign.models.taps import layer_tap, tap


ExpertFFNs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (x [T, H], experts [T, k]) -> [T, k, H]


def is_sparse_layer(options: dict, layer_index: int) -> bool:
    return (layer_index not in options.get("mlp_only_layers", ())
            and options["num_experts"] > 0 and (layer_index + 1) % options.get("decoder_sparse_step", 1) == 0)


# ---- the routing record (training metrics, the load-balancing loss) ---------------------------------------

class RoutingRecord:
    """What each sparse layer routed in the forwards run inside :func:`record_routing`: per layer index, the
    list of (router logits fp32 [T, E], experts [T, k]) of each forward, logits still in the autograd graph.

    ``keep_logits=False`` (the routing-agreement record: rollout engine, trainer re-score) keeps no logits
    (None in their place) and stores the expert ids as int16 (E < 2**15: Qwen3-MoE has 128), so a record of
    a whole step costs rows x sparse layers x k x 2 bytes.

    A record opened inside another (``parent``) passes what it records on to the enclosing record too, so an
    inner record never hides routing from an outer one."""

    def __init__(self, keep_logits: bool = True, parent: RoutingRecord | None = None):
        self.keep_logits = keep_logits
        self.parent = parent
        self.layers: dict[int, list[tuple[torch.Tensor | None, torch.Tensor]]] = {}
        self.router_choice: dict[int, list[torch.Tensor]] = {}   # under a replay: the router's own top-k

    def add(self, layer: int, logits: torch.Tensor, experts: torch.Tensor,
            router_choice: torch.Tensor | None = None) -> None:
        """One forward's routing of ``layer``: the experts it used and, under a routing replay, the experts the
        router itself would have chosen (``router_choice``, [T, k])."""
        if self.parent is not None:
            self.parent.add(layer, logits, experts, router_choice)
        if not self.keep_logits:
            logits, experts = None, experts.to(torch.int16)
            router_choice = None if router_choice is None else router_choice.to(torch.int16)
        self.layers.setdefault(layer, []).append((logits, experts))
        if router_choice is not None:
            self.router_choice.setdefault(layer, []).append(router_choice)

    def expert_ids(self) -> torch.Tensor | None:
        """The recorded expert ids as one tensor [rows, sparse layers, k] (int16 with ``keep_logits=False``):
        sparse layers in increasing layer index, rows of the recorded forwards concatenated in the order they
        ran. None when no sparse layer ran. Every sparse layer sees every row, so the rows line up."""
        return _stacked({layer: [experts for _, experts in runs] for layer, runs in self.layers.items()})

    def router_choice_ids(self) -> torch.Tensor | None:
        """Under a routing replay (every recorded forward ran inside :func:`replay_routing`): the experts each
        router would have chosen itself, laid out as :meth:`expert_ids`; None otherwise."""
        if not self.router_choice or sorted(self.router_choice) != sorted(self.layers) or any(
                len(self.router_choice[layer]) != len(self.layers[layer]) for layer in self.layers):
            return None
        return _stacked(self.router_choice)

    @property
    def layer_indices(self) -> list[int]:
        """The sparse layers' indices, in the order of :meth:`expert_ids`' second dimension."""
        return sorted(self.layers)


def _stacked(per_layer: dict[int, list[torch.Tensor]]) -> torch.Tensor | None:
    """[rows, sparse layers, k]: each layer's forwards' rows concatenated, layers in increasing index."""
    if not per_layer:
        return None
    return torch.stack([torch.cat(per_layer[layer]) for layer in sorted(per_layer)], dim=1)


_RECORD = threading.local()


@contextlib.contextmanager
def record_routing(keep_logits: bool = True):
    """Collect every sparse layer's routing in this thread while the context is open (see RoutingRecord)."""
    previous = getattr(_RECORD, "current", None)
    record = RoutingRecord(keep_logits, parent=previous)
    _RECORD.current = record
    try:
        yield record
    finally:
        _RECORD.current = previous


def current_routing_record() -> RoutingRecord | None:
    """The record open in this thread (:func:`record_routing`), None outside one: a sparse block adds to it."""
    return getattr(_RECORD, "current", None)


# ---- routing replay (R3: the trainer reuses the rollout's expert choices) -----------------------------------

@dataclasses.dataclass(frozen=True)
class RoutingReplay:
    """The expert choices a forward replays: ``experts`` [rows of the forward, sparse layers, k] (any integer
    dtype; sparse layers in increasing layer index, :func:`sparse_layer_indices`' order), ``replayed`` bool
    [rows] (False: the row routes freshly, its ``experts`` entry unread) and ``layers``, the sparse layers'
    indices along ``experts``' second dimension.

    What a replayed row x computes in sparse layer L, with current router logits l = router_logits(x) (fp32 [E])
    and recorded experts e_1..e_k (the rollout's top-k, rank order)::

        w_j = softmax(l)[e_j]                    (normalize: w_j / sum_j w_j)
        out = moe_combine(FFN_{e_j}(x), w_j)     as without replay

    The expert set is a constant of the step (the rollout's choice); gradients flow into the router through w
    and into the chosen experts through FFN. A fresh row is the unreplayed block, bit for bit."""
    experts: torch.Tensor
    replayed: torch.Tensor
    layers: tuple[int, ...]

    def route(self, logits: torch.Tensor, layer: int, top_k: int, normalize: bool):
        """(experts [T, k] int64, gate weights [T, k] fp32, the router's own choice [T, k]) of sparse layer
        ``layer`` from its router logits [T, E]: the recorded experts on the replayed rows, the router's top-k on
        the others; the weights of whichever experts are used recomputed from ``logits``
        (:func:`rlalign.ops.moe_route_replay`), so the router keeps its gradient."""
        if layer not in self.layers:
            raise ValueError(f"routing replay: sparse layer {layer} is not in the replayed record's layers "
                             f"{list(self.layers)}")
        recorded = self.experts[:, self.layers.index(layer)]
        if recorded.shape != (logits.shape[0], top_k):
            raise ValueError(f"routing replay: the record holds {tuple(recorded.shape)} experts for layer {layer}, "
                             f"the forward {logits.shape[0]} rows x top-{top_k}")
        own, _ = ops.moe_route(logits.detach(), top_k, normalize=normalize)
        recorded = recorded.to(device=own.device, dtype=own.dtype)
        experts = torch.where(self.replayed.to(own.device).unsqueeze(1), recorded, own)
        return experts, ops.moe_route_replay(logits, experts, normalize=normalize), own


_REPLAY = threading.local()


@contextlib.contextmanager
def replay_routing(replay: RoutingReplay | None):
    """Every sparse block (:func:`sparse_moe_block`) of the forwards -- and the backward's recomputed forwards --
    run in this thread while the context is open routes by ``replay`` (None: freshly, as outside)."""
    previous = getattr(_REPLAY, "current", None)
    _REPLAY.current = replay
    try:
        yield replay
    finally:
        _REPLAY.current = previous


def current_routing_replay() -> RoutingReplay | None:
    """The replay open in this thread (:func:`replay_routing`), None outside one."""
    return getattr(_REPLAY, "current", None)


def sparse_layer_indices(cfg: ModelConfig) -> list[int]:
    """The indices of a model's sparse (MoE) layers; empty for dense models (gpt-oss: every layer)."""
    if cfg.ffn_kind == "gpt_oss_moe":
        return list(range(cfg.num_layers))
    if cfg.ffn_kind == "deepseek_moe":   # DeepSeek-V3: dense layers first, then every layer sparse
        return list(range(cfg.ffn_options["first_k_dense_replace"], cfg.num_layers))
    if cfg.ffn_kind != "moe":
        return []
    return [i for i in range(cfg.num_layers) if is_sparse_layer(cfg.ffn_options, i)]


# ---- the block core ----------------------------------------------------------------------------------------

def sparse_moe_block(x: torch.Tensor, router_w: torch.Tensor, expert_ffns: ExpertFFNs, *, top_k: int,
                     normalize: bool, layer: int) -> torch.Tensor:
    """The sparse FFN of rows ``x`` [T, hidden] (see the module docstring); taps ``router`` and ``routing``.
    Inside :func:`replay_routing` the experts come from the replayed record (:meth:`RoutingReplay.route`).

    ``expert_ffns(x, experts)`` -> y [T, k, hidden] applies each token's k experts: :func:`stacked_expert_ffns`
    over the full weights, or the tensor-parallel experts :func:`rlalign.distributed.parallelize.parallelize`
    installs (the same bits: the router and the combine are replicated, only the experts' FFNs are sharded)."""
    logits = tap(layer_tap(layer, "router"), ops.router_logits(x, router_w))
    replay, own = current_routing_replay(), None
    if replay is None:
        experts, weights = ops.moe_route(logits, top_k, normalize=normalize)
    else:   # routing replay: the recorded experts, weights from the current logits (RoutingReplay.route)
        experts, weights, own = replay.route(logits, layer, top_k, normalize)
    tap(layer_tap(layer, "routing"), experts)
    record = current_routing_record()
    if record is not None:
        record.add(layer, logits, experts, own)
    y = expert_ffns(x, experts)
    return ops.moe_combine(y, weights, experts)


def stacked_expert_ffns(gate_w: Sequence[torch.Tensor], up_w: Sequence[torch.Tensor],
                        down_w: Sequence[torch.Tensor]) -> ExpertFFNs:
    """The experts' FFNs over every expert's full weights (per-expert lists or stacked [E, ...] tensors):
    ops.moe_experts, down_proj on the canonical K partition of MOE_K_SEGMENTS (the partition tensor parallelism
    shards)."""
    def apply(x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return ops.moe_experts(x, experts, gate_w, up_w, down_w, down_segments=spec.MOE_K_SEGMENTS)
    return apply


# ---- modules --------------------------------------------------------------------------------------------------

class StackedExperts(nn.Module):
    """The E experts' SwiGLU FFN weights of a sparse layer, one parameter per projection: ``gate_proj`` and
    ``up_proj`` [E, I, H], ``down_proj`` [E, H, I] (expert e's nn.Linear weight is ``w[e]``, a view), so
    autograd and the optimizer see 3 tensors per layer, not 3 x E. Called as ``experts(x, experts_idx)``
    -> y [T, k, hidden] (:func:`stacked_expert_ffns`; down_proj on the canonical K partition
    ``down_segments`` = spec.MOE_K_SEGMENTS, the partition tensor parallelism shards).

    Gate and up stay two tensors (not Hugging Face's fused ``gate_up_proj`` [E, 2I, H]): the strict
    arithmetic runs them as two GEMMs anyway, the checkpoint holds them apart, and tensor parallelism
    shards each along I as one contiguous slice (a fused tensor's rank slice would be two pieces).

    The checkpoint keeps one tensor per expert and projection (``experts.{e}.gate_proj.weight`` ...):
    :meth:`checkpoint_entries` maps them (rlalign.models.layout)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype, device):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty((num_experts, inter, hidden), dtype=dtype, device=device))
        self.up_proj = nn.Parameter(torch.empty((num_experts, inter, hidden), dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty((num_experts, hidden, inter), dtype=dtype, device=device))
        self.down_segments = spec.MOE_K_SEGMENTS

    @property
    def num_experts(self) -> int:
        return self.gate_proj.shape[0]

    @property
    def inter(self) -> int:
        """moe_intermediate_size (I)."""
        return self.down_proj.shape[2]

    def forward(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return stacked_expert_ffns(self.gate_proj, self.up_proj, self.down_proj)(x, experts)

    def checkpoint_entries(self) -> list[tuple[str, str, int]]:
        return expert_checkpoint_entries(self.num_experts)


def expert_checkpoint_entries(num_experts: int) -> list[tuple[str, str, int]]:
    """(checkpoint suffix, parameter, expert) of stacked experts, in the checkpoint's per-expert order."""
    return [(f"{e}.{proj}.weight", proj, e) for e in range(num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")]


class SparseMoE(nn.Module):
    """Router ``gate`` [E, hidden] and ``experts`` (:class:`StackedExperts`); forward = :func:`sparse_moe_block`."""

    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, device):
        super().__init__()
        opts = cfg.ffn_options
        self.layer_index = layer_index
        self.top_k, self.normalize = int(opts["num_experts_per_tok"]), bool(opts["norm_topk_prob"])
        self.gate = Linear(cfg.hidden_size, opts["num_experts"], False, dtype, device)
        self.experts = StackedExperts(opts["num_experts"], cfg.hidden_size, opts["moe_intermediate_size"], dtype,
                                      device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparse_moe_block(x, self.gate.weight, self.experts, top_k=self.top_k, normalize=self.normalize,
                                layer=self.layer_index)

    def tp_plan(self) -> dict[str, sharding.ShardSpec]:
        # the router is replicated; the EXPERTS spec shards the stacked experts like the dense FFN (gate/up
        # along I as COLUMN, down along I as ROW) and runs them together (one cross-rank merge per projection)
        return {"experts": sharding.EXPERTS}


# ---- shared experts (a dense MLP beside the routed experts) -------------------------------------------------

def shared_expert_mlp(cfg: ModelConfig, layer_index: int, intermediate: int, dtype, device) -> MLP:
    """The dense SwiGLU MLP of width ``intermediate`` that a sparse layer runs on every token beside its routed
    experts (DeepSeek-V3's ``shared_experts``, Qwen3-Next's ``shared_expert``)."""
    return MLP(dataclasses.replace(cfg, intermediate_size=intermediate), layer_index, dtype, device)


def add_shared_expert(routed: torch.Tensor, x: torch.Tensor, shared: nn.Module,
                      gate: nn.Module | None = None) -> torch.Tensor:
    """routed + shared(x) (DeepSeek-V3), or with ``gate`` (a [1, hidden] linear) routed +
    ops.shared_expert_gate(shared(x), gate(x)) (Qwen3-Next): one rounding of the sum in the model dtype, as
    transformers adds the two."""
    out = shared(x)
    if gate is not None:
        out = ops.shared_expert_gate(out, gate(x))
    return routed + out


class SharedExpertMoE(SparseMoE):
    """:class:`SparseMoE` plus a gated shared expert: ``shared_expert`` (:func:`shared_expert_mlp` of
    ``shared_expert_intermediate_size``) scaled per token by sigmoid(``shared_expert_gate``(x)), a [1, hidden]
    linear (Qwen3-Next's sparse block). Tensor parallelism is refused for it (rlalign.distributed.parallelize.check_tp:
    the shared expert has no shard plan)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, device):
        super().__init__(cfg, layer_index, dtype, device)
        width = cfg.ffn_options["shared_expert_intermediate_size"]
        self.shared_expert = shared_expert_mlp(cfg, layer_index, width, dtype, device)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_shared_expert(super().forward(x), x, self.shared_expert, self.shared_expert_gate)


@register_ffn("moe")
def build_moe_layer_ffn(cfg: ModelConfig, layer_index: int, dtype, device) -> nn.Module:
    """The sparse block on the sparse layers (with a gated shared expert where the options give its width:
    Qwen3-Next), the dense FFN (``intermediate_size``) elsewhere."""
    if not is_sparse_layer(cfg.ffn_options, layer_index):
        return MLP(cfg, layer_index, dtype, device)
    if cfg.ffn_options.get("shared_expert_intermediate_size"):
        return SharedExpertMoE(cfg, layer_index, dtype, device)
    return SparseMoE(cfg, layer_index, dtype, device)


__all__ = ["is_sparse_layer", "sparse_layer_indices", "current_routing_record", "sparse_moe_block", "stacked_expert_ffns", "ExpertFFNs",
           "SparseMoE", "SharedExpertMoE", "StackedExperts", "shared_expert_mlp", "add_shared_expert", "expert_checkpoint_entries", "record_routing", "RoutingRecord",
           "RoutingReplay", "replay_routing", "current_routing_replay"]

