"""parallelize(model, tp): shard a CausalLM in place for tensor parallelism (Megatron layout).

The model's modules declare how their weights shard (``tp_plan``, :mod:`rlalign.contract.sharding`);
this module only obeys the plans, in module order: a COLUMN child becomes a
:class:`ColumnParallelLinear`, ROW a :class:`RowParallelLinear` (canonical K partition), HEAD_GROUPED
a :class:`HeadGroupedRMSNorm`, VOCAB the vocab-parallel LM head (:mod:`.vocab_head`; with untied
embeddings ``lm_head.weight`` is replaced by the rank's rows), EXPERTS a sparse layer's stacked experts by
:class:`TensorParallelExperts` (:mod:`.experts`: gate/up sharded along I as COLUMN, down as ROW); then the
module's ``tp_localize(tp)`` makes its shape fields rank-local (the decoder's attention: heads split into
contiguous groups, rank r holds query heads [r*H/t, (r+1)*H/t) and kv heads likewise). Everything not planned (norms,
embeddings, the residual stream) stays replicated (every rank computes it identically).

Parameter names do not change; a sharded parameter carries ``tp_dim`` (0: rows, 1: columns) and
``tp_range`` (its [start, stop) along that dim; stacked experts: 1 for gate/up [E, I, H], 2 for down
[E, H, I]), and :func:`full_state` rebuilds the unsharded tensors (state or gradients) on every rank.
tp=1 (``Group.single()``) applies the same modules without any process group: it is the
reference the TP degrees agree with.
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.distributed.collectives import gather_ranks_varlen
from rlalign.distributed.experts import TensorParallelExperts
from rlalign.distributed.launch import Group
from rlalign.distributed.layers import (ColumnParallelLinear, HeadGroupedRMSNorm, RowParallelLinear, check_column_shard,
                                       local_segments, row_segments)
from rlalign.distributed.vocab_head import VocabParallelHead
from rlalign.contract.sharding import COLUMN, ROW, Shard, ShardSpec
from rlalign.contract.spec import K_SEGMENTS

SUPPORTED_TP = (1, 2, 4, 8)


def check_tp(config, tp: int, model=None) -> None:
    """Raise a one-line error when ``config``'s shapes cannot be split over ``tp`` ranks. With ``model`` (any
    model of that config, e.g. on the meta device), also every planned shard's width; without, those are
    checked when :func:`parallelize` builds the shards (same messages)."""
    if tp not in SUPPORTED_TP:
        raise RLAlignError(f"tp={tp} is not supported (choose one of {', '.join(map(str, SUPPORTED_TP))})")
    if tp > 1 and (config.attention_sinks or config.o_bias or config.ffn_kind not in ("dense", "moe")
                   or config.linear_attention or config.attention_kind == "gated"
                   or config.ffn_options.get("shared_expert_intermediate_size")):
        raise RLAlignError(f"tp={tp}: tensor parallelism is not implemented for {config.family} models (attention "
                           f"sinks, an o_proj bias, gated or linear attention, shared experts or its FFN kind "
                           f"{config.ffn_kind!r} have no shard plan); use tp=1")
    sizes = [("num_attention_heads", config.num_heads), ("num_key_value_heads", config.num_kv_heads)]
    if config.ffn_options.get("num_experts") and "moe_intermediate_size" in config.ffn_options:
        sizes.append(("moe_intermediate_size", config.ffn_options["moe_intermediate_size"]))
    for what, n in sizes:
        if n % tp:
            raise RLAlignError(f"tp={tp} does not divide the model's {what}={n}; choose a tp that divides it")
    if tp == 1 or model is None:
        return
    for name, spec, features, segments in _planned_shards(model):
        if spec.kind is Shard.COLUMN:
            check_column_shard(features, tp, name)
        local_segments(features, tp, name, segments)


def _planned_shards(model):
    """(name, spec, sharded features, canonical segments) of the COLUMN / ROW children ``model``'s plans
    declare; one per distinct (name with layer indices wildcarded, width)."""
    seen = set()
    for path, module in model.named_modules():
        for child, spec in getattr(module, "tp_plan", dict)().items():
            name = f"{path}.{child}".removeprefix("model.")
            for shard in _shards_of(getattr(module, child), spec, name):
                generic = ".".join("*" if part.isdigit() else part for part in shard[0].split("."))
                if (generic, shard[2]) not in seen:
                    seen.add((generic, shard[2]))
                    yield shard


def _shards_of(child, spec: ShardSpec, name: str):
    """The COLUMN / ROW shards one planned child makes: a linear's own; stacked experts shard gate/up along
    I as a COLUMN linear and down along I as a ROW linear of the experts' canonical K partition."""
    if spec.kind is Shard.EXPERTS:
        yield f"{name}.gate_proj", COLUMN, child.inter, K_SEGMENTS
        yield f"{name}.down_proj", ROW, child.inter, child.down_segments
    elif spec.kind in (Shard.COLUMN, Shard.ROW):
        features = child.weight.shape[0 if spec.kind is Shard.COLUMN else 1]
        yield name, spec, features, row_segments(child) if spec.kind is Shard.ROW else K_SEGMENTS


def parallelize(model, group: Group):
    """Shard ``model`` (a CausalLM) over ``group`` in place, as its modules' ``tp_plan`` say, and return it."""
    if getattr(model, "tp_group", None) is not None:
        raise RLAlignError("model is already parallelized")
    check_tp(model.config, group.size, model)
    for path, module in list(model.named_modules()):
        plan = getattr(module, "tp_plan", None)
        if plan is None:
            continue
        for child, spec in plan().items():
            _shard_child(model, module, child, spec, group, f"{path}.{child}".removeprefix("model.").lstrip("."))
        localize = getattr(module, "tp_localize", None)
        if localize is not None:
            localize(group.size)
    model.tp_group = group
    return model


def _shard_child(model, owner, child: str, spec: ShardSpec, group: Group, name: str) -> None:
    if spec.kind is Shard.COLUMN:
        setattr(owner, child, ColumnParallelLinear(getattr(owner, child), group, name))
    elif spec.kind is Shard.ROW:
        setattr(owner, child, RowParallelLinear(getattr(owner, child), group, name))
    elif spec.kind is Shard.HEAD_GROUPED:
        setattr(owner, child, HeadGroupedRMSNorm(getattr(owner, child), spec.heads, group, name))
    elif spec.kind is Shard.VOCAB:
        _vocab_parallel(model, group)
    elif spec.kind is Shard.EXPERTS:
        setattr(owner, child, TensorParallelExperts(getattr(owner, child), group, name))
    else:
        raise RLAlignError(f"{name}: shard kind {spec.kind} has no parallel implementation")


def _vocab_parallel(model, group: Group) -> None:
    head = VocabParallelHead(model, group)
    if model.lm_head is not None:
        start, stop = head.shard_range()
        weight = torch.nn.Parameter(model.lm_head.weight.detach()[start:stop].clone())
        weight.tp_dim, weight.tp_range = 0, (start, stop)
        model.lm_head.weight = weight
    model.parallel_head = head


@torch.no_grad()
def full_state(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """name -> the unsharded parameter (or its gradient with ``grads``), rebuilt on every rank by
    exact all-gathers; replicated parameters are returned as they are."""
    group = getattr(model, "tp_group", None) or Group.single()
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        dim = getattr(p, "tp_dim", None)
        out[name] = t if dim is None else torch.cat(gather_ranks_varlen(t.contiguous(), group, dim=dim), dim=dim)
    return out


__all__ = ["parallelize", "full_state", "check_tp", "SUPPORTED_TP"]
