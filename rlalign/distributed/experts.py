"""Tensor-parallel mixture-of-experts: every expert's SwiGLU FFN sharded like the dense FFN, the router replicated.

Layout (t ranks, rank r; I = moe_intermediate_size): each expert's own plan (models.moe.Expert) makes its
gate_proj / up_proj :class:`ColumnParallelLinear` (rows [r*I/t, (r+1)*I/t)) and its down_proj a
:class:`RowParallelLinear` (the same columns: rank r's subtree of the canonical K partition of I, which has
spec.MOE_K_SEGMENTS = 4 segments for experts -- so MoE layers split over TP = 1, 2, 4, and TP = 8 is refused). The router
``gate`` and everything around the experts (routing, combine, the residual stream) stay replicated: the
router sees the replicated post-norm hidden rows, so every rank routes every token identically.

The sparse layer's ``experts`` list becomes a :class:`TensorParallelExperts` (the plan's EXPERTS spec). Its
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
dense FFN, instead of one per expert. An expert no token chose gets no gradient (None), as in the unsharded model.

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
from rlalign.distributed.layers import ColumnParallelLinear, RowParallelLinear
from rlalign.distributed.native import stock_all_reduce
from rlalign.ops.shard import linear_partial, linear_weight_grad


def _spans(counts: tuple[int, ...]):
    """(expert, start, stop) of each expert with rows, in expert order."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, start + n
        start += n


def _weight_grads(ctx, g, x, weights, grad_of):
    """Per expert: ``grad_of(g_e, x_e, w)`` where the weight needs one, else None (unused experts get None)."""
    grads = [None] * len(weights)
    for e, a, b in _spans(ctx.counts):
        if ctx.needs_input_grad[4 + e]:
            grads[e] = grad_of(g[a:b], x[a:b], weights[e])
    return grads


class _ExpertColumns(torch.autograd.Function):
    """rows grouped by expert [N, H] -> [N, I/t]: each group times its expert's column shard."""

    @staticmethod
    def forward(ctx, rows, counts, group, dx_segments, *weights):
        ctx.save_for_backward(rows, *weights)
        ctx.counts, ctx.group, ctx.dx_segments = counts, group, dx_segments
        with torch.no_grad():
            outs = [ops.linear(rows[a:b], weights[e]) for e, a, b in _spans(counts)]
        return torch.cat(outs) if outs else rows.new_zeros((0, weights[0].shape[0]))

    @staticmethod
    def backward(ctx, g):
        rows, *weights = ctx.saved_tensors
        g = g.to(rows.dtype)
        grad_rows = None
        if ctx.needs_input_grad[0] and rows.shape[0]:
            # this rank's canonical-N subtree of every row's dX, merged across ranks once for all experts
            parts = [linear_partial(g[a:b], weights[e].t(), ctx.dx_segments) for e, a, b in _spans(ctx.counts)]
            grad_rows = merge_ranks(torch.cat(parts), ctx.group).to(rows.dtype)
        grads = _weight_grads(ctx, g, rows, weights, lambda ge, xe, w: linear_weight_grad(ge, xe, w.dtype))
        return (grad_rows, None, None, None, *grads)


class _ExpertRows(torch.autograd.Function):
    """act grouped by expert [N, I/t] -> [N, H]: each group's canonical-K subtree with its expert's down shard
    (fp32), every rank's partials merged in rank order, one rounding."""

    @staticmethod
    def forward(ctx, act, counts, group, segments, *weights):
        ctx.save_for_backward(act, *weights)
        ctx.counts = counts
        hidden = weights[0].shape[0]
        if act.shape[0] == 0:   # every rank routes identically: all skip the collective together
            return act.new_zeros((0, hidden))
        parts = [linear_partial(act[a:b], weights[e], segments) for e, a, b in _spans(counts)]
        return merge_ranks(torch.cat(parts), group).to(act.dtype)

    @staticmethod
    def backward(ctx, g):
        act, *weights = ctx.saved_tensors
        g = g.to(act.dtype)
        grad_act = None
        if ctx.needs_input_grad[0] and act.shape[0]:
            with torch.no_grad():
                grad_act = torch.cat([ops.linear(g[a:b], weights[e].t().contiguous())
                                      for e, a, b in _spans(ctx.counts)])
        grads = _weight_grads(ctx, g, act, weights, lambda ge, xe, w: linear_weight_grad(ge, xe, w.dtype))
        return (grad_act, None, None, None, *grads)


class _NativeExpertColumns(torch.autograd.Function):
    """Native profile (the baseline, no guarantee): vendor GEMMs, dX summed by one stock all-reduce."""

    @staticmethod
    def forward(ctx, rows, counts, group, dx_segments, *weights):
        ctx.save_for_backward(rows, *weights)
        ctx.counts, ctx.group = counts, group
        outs = [F.linear(rows[a:b], weights[e]) for e, a, b in _spans(counts)]
        return torch.cat(outs) if outs else rows.new_zeros((0, weights[0].shape[0]))

    @staticmethod
    def backward(ctx, g):
        rows, *weights = ctx.saved_tensors
        grad_rows = None
        if rows.shape[0]:
            parts = [g[a:b] @ weights[e] for e, a, b in _spans(ctx.counts)]
            grad_rows = stock_all_reduce(torch.cat(parts), ctx.group)
        grads = _weight_grads(ctx, g, rows, weights, lambda ge, xe, w: ge.t() @ xe)
        return (grad_rows, None, None, None, *grads)


class _NativeExpertRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, act, counts, group, segments, *weights):
        ctx.save_for_backward(act, *weights)
        ctx.counts = counts
        if act.shape[0] == 0:
            return act.new_zeros((0, weights[0].shape[0]))
        return stock_all_reduce(torch.cat([F.linear(act[a:b], weights[e]) for e, a, b in _spans(counts)]), group)

    @staticmethod
    def backward(ctx, g):
        act, *weights = ctx.saved_tensors
        grad_act = torch.cat([g[a:b] @ weights[e] for e, a, b in _spans(ctx.counts)]) if act.shape[0] else None
        grads = _weight_grads(ctx, g, act, weights, lambda ge, xe, w: ge.t() @ xe)
        return (grad_act, None, None, None, *grads)


class TensorParallelExperts(nn.ModuleList):
    """A sparse layer's experts under TP (the same Expert modules, so parameter names do not change); called
    like :class:`rlalign.models.moe.ExpertList`: ``(x [T, H], experts [T, k]) -> y [T, k, H]``."""

    def __init__(self, experts: nn.ModuleList, group: Group, name: str):
        super().__init__(list(experts))
        self.group, self.name = group, name

    def _shards(self):
        """(gate, up, down) weight shards of every expert, and the (dX, down) canonical segments per rank."""
        for i, e in enumerate(self):
            if not (isinstance(e.gate_proj, ColumnParallelLinear) and isinstance(e.up_proj, ColumnParallelLinear)
                    and isinstance(e.down_proj, RowParallelLinear)):
                raise RLAlignError(f"{self.name}.{i}: the expert's FFN is not sharded (its tp_plan must declare "
                                   "gate_proj/up_proj COLUMN and down_proj ROW)")
        first = self[0]
        return ([e.gate_proj.weight for e in self], [e.up_proj.weight for e in self],
                [e.down_proj.weight for e in self], first.gate_proj.dx_segments, first.down_proj.segments)

    def forward(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or experts.dim() != 2 or experts.shape[0] != x.shape[0]:
            raise RLAlignError(f"{self.name}: expected x [T, H] and experts [T, k], got {tuple(x.shape)} and "
                               f"{tuple(experts.shape)}")
        gate_w, up_w, down_w, dx_segments, down_segments = self._shards()
        columns, rows_fn = ((_NativeExpertColumns, _NativeExpertRows) if current_profile() is Profile.NATIVE
                            else (_ExpertColumns, _ExpertRows))
        tokens, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.sort(flat, stable=True).indices     # slots grouped by expert, slot order inside a group
        counts = tuple(torch.bincount(flat, minlength=len(self)).tolist())
        if len(counts) != len(self):
            raise RLAlignError(f"{self.name}: expert id {int(flat.max())} is outside [0, {len(self)})")
        rows = x.unsqueeze(1).expand(tokens, k, x.shape[1]).reshape(tokens * k, x.shape[1]).index_select(0, order)
        gate = columns.apply(rows, counts, self.group, dx_segments, *gate_w)
        up = columns.apply(rows, counts, self.group, dx_segments, *up_w)
        grouped = rows_fn.apply(ops.silu_mul(gate, up), counts, self.group, down_segments, *down_w)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return grouped.index_select(0, inverse).view(tokens, k, x.shape[1])


__all__ = ["TensorParallelExperts"]
