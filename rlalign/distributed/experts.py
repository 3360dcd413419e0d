"""Tensor-parallel mixture-of-experts: every expert's SwiGLU FFN sharded like the dense FFN, the router replicated.

Layout (t ranks, rank r; I = moe_intermediate_size): the stacked experts (models.moe.StackedExperts) are
sharded along I like the dense FFN: gate_proj / up_proj [E, I, H] keep rows [r*I/t, (r+1)*I/t) of every
expert (a COLUMN linear per expert: [E, I/t, H], ``tp_dim`` 1) and down_proj [E, H, I] the same columns (a ROW
linear per expert: [E, H, I/t], ``tp_dim`` 2; rank r's subtree of the canonical K partition of I, which has
spec.MOE_K_SEGMENTS = 4 segments for experts -- so MoE layers split over TP = 1, 2, 4, and TP = 8 is refused).
Each projection stays ONE parameter per rank (one autograd input, one gradient [E, ...]). The router
``gate`` and everything around the experts (routing, combine, the residual stream) stay replicated: the
router sees the replicated post-norm hidden rows, so every rank routes every token identically.

The sparse layer's ``experts`` become a :class:`TensorParallelExperts` (the plan's EXPERTS spec). Its
call ``(x [T, H], experts [T, k]) -> y [T, k, H]`` groups the (token, slot) rows by expert (stable sort), then
for all experts at once::

    gate, up   column shards: ops.linear(rows_e, W_e) per expert (a column's bits do not depend on N)
    act        ops.silu_mul(gate, up)                  (elementwise: a column slice keeps its bits)
    y          row shards: linear_partial(act_e, Wdown_e) per expert, fp32, unrounded; the partials of ALL
               experts concatenated and merged across ranks ONCE (collectives.merge_ranks), one rounding
    backward   down: dX_e = linear(g_e, Wdown_e^T) (columns of the full dX), dW_e = linear_weight_grad
               gate/up: dX partials over this rank's canonical N segments per expert, concatenated and merged
               once per projection; dW_e = linear_weight_grad (the rows of the full dW)

Per row this is exactly the arithmetic of :mod:`rlalign.distributed.layers` (the dense FFN's column / row
linears), so log-probs, entropy, loss and every gradient are the same bits at TP 1, 2, 4, 8, and the forward
equals the unsharded model's (ops.moe_experts with ``down_segments=MOE_K_SEGMENTS``). A token's result never
depends on which other tokens chose its experts (the strict linear is row invariant), so grouping all experts'
rows into one merge changes no bits; it only makes the collectives per layer 1 forward + 2 backward, as for a
dense FFN, instead of one per expert. An expert no token chose gets a zero gradient slice, as in the unsharded
model.

Expert parallelism (whole experts on different ranks) is not implemented (docs/distributed.md: next).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlalign import ops
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import Profile, current_profile
from rlalign.distributed.collectives import merge_ranks
from rlalign.distributed.launch import Group
from rlalign.contract import spec
from rlalign.distributed.layers import check_column_shard, shard_parameter, local_segments
from rlalign.distributed.native import stock_all_reduce
from rlalign.ops.shard import linear_partial, linear_weight_grad


def _spans(counts: tuple[int, ...]):
    """(expert, start, stop) of each expert with rows, in expert order."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, start + n
        start += n


def _weight_grad(ctx, g, x, weight, grad_of):
    """The stacked weight's gradient: ``grad_of(g_e, x_e, weight[e])`` at [e] for each expert with rows, zeros
    for the others (as the unsharded experts' stacked dW); None when the weight needs none."""
    if not ctx.needs_input_grad[4] or not any(ctx.counts):
        return None      # (no rows at all: no gradient, as the unsharded experts' constant output)
    grad = torch.zeros_like(weight)
    for e, a, b in _spans(ctx.counts):
        grad[e] = grad_of(g[a:b], x[a:b], weight[e])
    return grad


class _ExpertColumns(torch.autograd.Function):
    """rows grouped by expert [N, H] -> [N, I/t]: each group times its expert's column shard of the stacked
    weight [E, I/t, H]."""

    @staticmethod
    def forward(ctx, rows, counts, group, dx_segments, weight):
        ctx.save_for_backward(rows, weight)
        ctx.counts, ctx.group, ctx.dx_segments = counts, group, dx_segments
        with torch.no_grad():
            outs = [ops.linear(rows[a:b], weight[e]) for e, a, b in _spans(counts)]
        return torch.cat(outs) if outs else rows.new_zeros((0, weight.shape[1]))

    @staticmethod
    def backward(ctx, g):
        rows, weight = ctx.saved_tensors
        g = g.to(rows.dtype)
        grad_rows = None
        if ctx.needs_input_grad[0] and rows.shape[0]:
            # this rank's canonical-N subtree of every row's dX, merged across ranks once for all experts
            parts = [linear_partial(g[a:b], weight[e].t(), ctx.dx_segments) for e, a, b in _spans(ctx.counts)]
            grad_rows = merge_ranks(torch.cat(parts), ctx.group).to(rows.dtype)
        grad = _weight_grad(ctx, g, rows, weight, lambda ge, xe, w: linear_weight_grad(ge, xe, w.dtype))
        return grad_rows, None, None, None, grad


class _ExpertRows(torch.autograd.Function):
    """act grouped by expert [N, I/t] -> [N, H]: each group's canonical-K subtree with its expert's down shard
    (stacked [E, H, I/t]; fp32), every rank's partials merged in rank order, one rounding."""

    @staticmethod
    def forward(ctx, act, counts, group, segments, weight):
        ctx.save_for_backward(act, weight)
        ctx.counts = counts
        if act.shape[0] == 0:   # every rank routes identically: all skip the collective together
            return act.new_zeros((0, weight.shape[1]))
        parts = [linear_partial(act[a:b], weight[e], segments) for e, a, b in _spans(counts)]
        return merge_ranks(torch.cat(parts), group).to(act.dtype)

    @staticmethod
    def backward(ctx, g):
        act, weight = ctx.saved_tensors
        g = g.to(act.dtype)
        grad_act = None
        if ctx.needs_input_grad[0] and act.shape[0]:
            with torch.no_grad():
                grad_act = torch.cat([ops.linear(g[a:b], weight[e].t().contiguous())
                                      for e, a, b in _spans(ctx.counts)])
        grad = _weight_grad(ctx, g, act, weight, lambda ge, xe, w: linear_weight_grad(ge, xe, w.dtype))
        return grad_act, None, None, None, grad


class _NativeExpertColumns(torch.autograd.Function):
    """Native profile (the baseline, no guarantee): vendor GEMMs, dX summed by one stock all-reduce."""

    @staticmethod
    def forward(ctx, rows, counts, group, dx_segments, weight):
        ctx.save_for_backward(rows, weight)
        ctx.counts, ctx.group = counts, group
        outs = [F.linear(rows[a:b], weight[e]) for e, a, b in _spans(counts)]
        return torch.cat(outs) if outs else rows.new_zeros((0, weight.shape[1]))

    @staticmethod
    def backward(ctx, g):
        rows, weight = ctx.saved_tensors
        grad_rows = None
        if rows.shape[0]:
            parts = [g[a:b] @ weight[e] for e, a, b in _spans(ctx.counts)]
            grad_rows = stock_all_reduce(torch.cat(parts), ctx.group)
        return grad_rows, None, None, None, _weight_grad(ctx, g, rows, weight, lambda ge, xe, w: ge.t() @ xe)


class _NativeExpertRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, act, counts, group, segments, weight):
        ctx.save_for_backward(act, weight)
        ctx.counts = counts
        if act.shape[0] == 0:
            return act.new_zeros((0, weight.shape[1]))
        return stock_all_reduce(torch.cat([F.linear(act[a:b], weight[e]) for e, a, b in _spans(counts)]), group)

    @staticmethod
    def backward(ctx, g):
        act, weight = ctx.saved_tensors
        grad_act = torch.cat([g[a:b] @ weight[e] for e, a, b in _spans(ctx.counts)]) if act.shape[0] else None
        return grad_act, None, None, None, _weight_grad(ctx, g, act, weight, lambda ge, xe, w: ge.t() @ xe)


def check_expert_shards(inter: int, tp: int, name: str, down_segments: int = spec.MOE_K_SEGMENTS) -> tuple[int, int]:
    """(dX segments of gate/up, canonical K segments of down) one of ``tp`` ranks holds, or a one-line error
    naming the projection: gate/up shard I like a COLUMN linear, down like a ROW linear of ``down_segments``."""
    check_column_shard(inter, tp, f"{name}.gate_proj")
    return (local_segments(inter, tp, f"{name}.gate_proj"),
            local_segments(inter, tp, f"{name}.down_proj", down_segments))


class TensorParallelExperts(nn.Module):
    """A sparse layer's stacked experts under TP (:class:`rlalign.models.moe.StackedExperts` sharded: the
    same parameter names, each rank's slice along I tagged ``tp_dim``/``tp_range``); called like it:
    ``(x [T, H], experts [T, k]) -> y [T, k, H]``."""

    def __init__(self, experts: nn.Module, group: Group, name: str):
        super().__init__()
        if not all(isinstance(getattr(experts, p, None), torch.Tensor) and getattr(experts, p).dim() == 3
                   for p in ("gate_proj", "up_proj", "down_proj")):
            raise RLAlignError(f"{name}: the EXPERTS plan shards stacked experts (gate_proj/up_proj [E, I, H], "
                               f"down_proj [E, H, I]); got {type(experts).__name__}")
        self.group, self.name = group, name
        self.dx_segments, self.down_segments = check_expert_shards(experts.inter, group.size, name,
                                                                   experts.down_segments)
        self.gate_proj = shard_parameter(experts.gate_proj, 1, group)    # [E, I/t, H]: COLUMN along I
        self.up_proj = shard_parameter(experts.up_proj, 1, group)
        self.down_proj = shard_parameter(experts.down_proj, 2, group)    # [E, H, I/t]: ROW along I
        self._entries = experts.checkpoint_entries()

    @property
    def num_experts(self) -> int:
        return self.gate_proj.shape[0]

    def checkpoint_entries(self) -> list[tuple[str, str, int]]:
        return self._entries

    def forward(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or experts.dim() != 2 or experts.shape[0] != x.shape[0]:
            raise RLAlignError(f"{self.name}: expected x [T, H] and experts [T, k], got {tuple(x.shape)} and "
                               f"{tuple(experts.shape)}")
        columns, rows_fn = ((_NativeExpertColumns, _NativeExpertRows) if current_profile() is Profile.NATIVE
                            else (_ExpertColumns, _ExpertRows))
        tokens, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.sort(flat, stable=True).indices     # slots grouped by expert, slot order inside a group
        counts = tuple(torch.bincount(flat, minlength=self.num_experts).tolist())
        if len(counts) != self.num_experts:
            raise RLAlignError(f"{self.name}: expert id {int(flat.max())} is outside [0, {self.num_experts})")
        rows = x.unsqueeze(1).expand(tokens, k, x.shape[1]).reshape(tokens * k, x.shape[1]).index_select(0, order)
        gate = columns.apply(rows, counts, self.group, self.dx_segments, self.gate_proj)
        up = columns.apply(rows, counts, self.group, self.dx_segments, self.up_proj)
        grouped = rows_fn.apply(ops.silu_mul(gate, up), counts, self.group, self.down_segments, self.down_proj)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return grouped.index_select(0, inverse).view(tokens, k, x.shape[1])


__all__ = ["TensorParallelExperts", "check_expert_shards"]
