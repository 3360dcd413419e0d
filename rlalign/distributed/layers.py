"""Column- and row-parallel linears whose forward AND backward give the TP=1 bits at any degree.

Notation: t ranks, rank r; P(n) = segment_count(n, K_SEGMENTS) (8 where n allows).

Column-parallel (q/k/v, gate/up; weight rows = output features N split in t contiguous shards):
    forward   y_r = linear(x, W_r, b_r)                     -- each output column computed exactly
                                                               as at TP=1 (fixed-shape GEMM columns
                                                               do not depend on N: doctor-checked)
    dX        canonical N partition: P(N) segments of the output features, each reduced from zero;
              rank r reduces its P(N)/t segments to its subtree (ops.linear_partial), the subtrees are
              gathered and merged in rank order (collectives.merge_ranks), one rounding
              -> the same bits at TP=1, 2, 4, 8 (at TP=1 the whole tree is local)
    dW_r      ops.linear_weight_grad(g_r, x): the rows of the full dW (a sum over tokens per row)
    db_r      tree_sum over tokens in fp32 (elementwise tree, so a column's sum ignores N)

Row-parallel (o_proj, down_proj; weight columns = input features K split in t shards):
    forward   rank r's subtree of the canonical K partition (ops.linear_partial, fp32, unrounded),
              merged across ranks in rank order, one rounding -> the TP=1 bits by construction
    dX_r      linear(g, W_r^T): the columns of the full dX (reduction over N, not split)
    dW_r      ops.linear_weight_grad(g, x_r): the columns of the full dW
"""

from __future__ import annotations

import torch
from torch import nn

from rlalign import ops
from rlalign.contract import spec
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import Profile, current_profile
from rlalign.distributed.collectives import merge_ranks, tree_reduce
from rlalign.distributed.launch import Group
from rlalign.distributed.native import NativeColumn, NativeRow
from rlalign.ops.shard import linear_partial, linear_weight_grad
from rlalign.ops.torch_backend.linear import segment_count
from rlalign.reductions import tree_sum


# The column-parallel forward relies on a GEMM column's bits not depending on N (doctor-checked at
# 1024 columns). The CPU GEMM switches micro-kernel for narrow slices, where it fails (measured by slicing tile_mm at
# widths 1..64 on the CI CPU, 2026-11-30: a column's bits change under 12 columns); column shards must be at least
# this wide.
MIN_SHARD_COLUMNS = 16


def check_column_shard(features: int, tp: int, name: str) -> None:
    """A column-parallel linear's ``features`` outputs split over ``tp`` ranks: equal, and wide enough."""
    if features % tp:
        raise RLAlignError(f"{name}: {features} output features are not divisible by tp={tp}")
    if tp > 1 and features // tp < MIN_SHARD_COLUMNS:
        raise RLAlignError(f"{name}: tp={tp} leaves {features // tp} output features per rank; shards narrower than "
                           f"{MIN_SHARD_COLUMNS} change the CPU GEMM's column bits (measured), choose a smaller tp")


def local_segments(features: int, tp: int, what: str, segments: int = spec.K_SEGMENTS) -> int:
    """Segments of the canonical partition of ``features`` (at most ``segments``) that one of ``tp`` ranks holds."""
    p = segment_count(features, segments)
    if p % tp:
        raise RLAlignError(f"{what}: {features} features split into {p} canonical segments cannot be shared "
                           f"by tp={tp} ranks (tp must divide {p})")
    return p // tp


def row_segments(linear: nn.Module) -> int:
    """The canonical K partition a row-parallel linear shards: the linear's own ``k_segments`` (the experts'
    down_proj: spec.MOE_K_SEGMENTS), else spec.K_SEGMENTS."""
    return getattr(linear, "k_segments", None) or spec.K_SEGMENTS


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, group, dx_segments):
        ctx.save_for_backward(x2d, weight)
        ctx.group, ctx.dx_segments, ctx.has_bias = group, dx_segments, bias is not None
        with torch.no_grad():
            return ops.linear(x2d, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x2d, weight = ctx.saved_tensors
        g = g.to(x2d.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            part = linear_partial(g, weight.t(), ctx.dx_segments)      # reduction over this rank's N
            grad_x = merge_ranks(part, ctx.group).to(x2d.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = linear_weight_grad(g, x2d, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = tree_sum(g.float().t()).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, group, segments):
        ctx.save_for_backward(x2d, weight)
        return merge_ranks(linear_partial(x2d, weight, segments), group).to(x2d.dtype)

    @staticmethod
    def backward(ctx, g):
        x2d, weight = ctx.saved_tensors
        g = g.to(x2d.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            with torch.no_grad():
                grad_x = ops.linear(g, weight.t().contiguous())
        if ctx.needs_input_grad[1]:
            grad_w = linear_weight_grad(g, x2d, weight.dtype)
        return grad_x, grad_w, None, None


def shard_parameter(t: torch.Tensor, dim: int, group: Group) -> nn.Parameter:
    """This rank's equal slice of ``t`` along ``dim``, tagged with ``tp_dim`` and ``tp_range``."""
    size = t.shape[dim] // group.size
    p = nn.Parameter(t.detach().narrow(dim, group.rank * size, size).clone())
    p.tp_dim, p.tp_range = dim, (group.rank * size, (group.rank + 1) * size)
    return p


class ColumnParallelLinear(nn.Module):
    """Holds rows [r*N/t, (r+1)*N/t) of ``weight`` (and ``bias``); output: those features."""

    def __init__(self, linear: nn.Module, group: Group, name: str):
        super().__init__()
        n = linear.weight.shape[0]
        check_column_shard(n, group.size, name)
        self.dx_segments = local_segments(n, group.size, name)
        self.group = group
        self.weight = shard_parameter(linear.weight, 0, group)
        self.bias = None if linear.bias is None else shard_parameter(linear.bias, 0, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if current_profile() is Profile.NATIVE:
            out = NativeColumn.apply(x.reshape(-1, shape[-1]), self.weight, self.bias, self.group)
            return out.reshape(*shape[:-1], self.weight.shape[0])
        out = _ColumnParallel.apply(x.reshape(-1, shape[-1]), self.weight, self.bias, self.group, self.dx_segments)
        return out.reshape(*shape[:-1], self.weight.shape[0])


class RowParallelLinear(nn.Module):
    """Holds columns [r*K/t, (r+1)*K/t) of ``weight``; input: those features; output: the full
    (replicated) features, merged across ranks in the canonical tree."""

    def __init__(self, linear: nn.Module, group: Group, name: str):
        super().__init__()
        if linear.bias is not None:
            raise RLAlignError(f"{name}: a row-parallel linear with a bias is not supported")
        k = linear.weight.shape[1]
        self.segments = local_segments(k, group.size, name, row_segments(linear))
        self.group = group
        self.weight = shard_parameter(linear.weight, 1, group)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if current_profile() is Profile.NATIVE:
            out = NativeRow.apply(x.reshape(-1, shape[-1]), self.weight, self.group)
            return out.reshape(*shape[:-1], self.weight.shape[0])
        out = _RowParallel.apply(x.reshape(-1, shape[-1]), self.weight, self.group, self.segments)
        return out.reshape(*shape[:-1], self.weight.shape[0])


class _GroupedWeight(torch.autograd.Function):
    """n copies of a replicated weight; backward merges their gradients (fp32) by the fixed tree,
    this rank's copies locally, then the ranks' subtrees in rank order."""

    @staticmethod
    def forward(ctx, weight, n, group):
        ctx.group, ctx.dtype = group, weight.dtype
        return tuple(weight.detach().clone() for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        ref = next((g for g in grads if g is not None), None)
        if ref is None:
            return None, None, None
        # a copy without a gradient counts as zeros, so the tree is the same on every rank
        local = tree_reduce([torch.zeros_like(ref, dtype=torch.float32) if g is None else g.float() for g in grads])
        return merge_ranks(local, ctx.group).to(ctx.dtype), None, None


class HeadGroupedRMSNorm(nn.Module):
    """q_norm / k_norm under TP (both profiles): the shared [head_dim] weight's gradient is a sum over every head,
    and heads live on different ranks. The heads are cut into G = segment_count(heads, 8) canonical
    groups; each group is normalised by its own ops.rms_norm call (rows are independent, so the
    output bits do not change) and the G per-group weight gradients are merged by the fixed tree,
    the top across ranks -- the same bits at every degree."""

    def __init__(self, norm: nn.Module, heads: int, group: Group, name: str):
        super().__init__()
        self.weight, self.eps, self.group = norm.weight, norm.eps, group
        self.local_groups = local_segments(heads, group.size, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = _GroupedWeight.apply(self.weight, self.local_groups, self.group)
        per = x.shape[1] // self.local_groups
        return torch.cat([ops.rms_norm(x[:, i * per:(i + 1) * per], w, self.eps) for i, w in enumerate(weights)],
                         dim=1)


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "HeadGroupedRMSNorm", "local_segments", "row_segments",
           "check_column_shard"]
