"""The native-profile tensor parallelism: the usual Megatron-style layers (vendor GEMMs, stock
all-reduce with the library's own algorithm), no guarantee across degrees. The baseline that
scripts/gpu_tp.py times the strict layers against; selected by ``use_profile("native")``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlalign.distributed.launch import Group


def stock_all_reduce(t: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group.size > 1:
        dist.all_reduce(t, op=op, group=group.pg)
    return t


class NativeColumn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, group):
        ctx.save_for_backward(x2d, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x2d, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x2d, weight = ctx.saved_tensors
        grad_x = stock_all_reduce(g @ weight, ctx.group)
        grad_b = g.sum(0) if ctx.has_bias else None
        return grad_x, g.t() @ x2d, grad_b, None


class NativeRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, group):
        ctx.save_for_backward(x2d, weight)
        return stock_all_reduce(F.linear(x2d, weight), group)

    @staticmethod
    def backward(ctx, g):
        x2d, weight = ctx.saved_tensors
        return g @ weight, g.t() @ x2d, None


class NativeVocabLogprob(torch.autograd.Function):
    """Vocab-parallel log-softmax with materialised fp32 logits of the shard: max, sum exp and the
    target logit all-reduced (the standard vocab-parallel cross-entropy)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, v0, v1, temperature, with_entropy, group, tied):
        w = weight[v0:v1] if tied else weight
        z = (hidden.float() @ w.float().t()) / temperature
        m = z.amax(-1) if z.shape[1] else z.new_full((z.shape[0],), float("-inf"))
        m = stock_all_reduce(m, group, dist.ReduceOp.MAX)
        e = torch.exp(z - m.unsqueeze(1))
        s = stock_all_reduce(e.sum(-1), group)
        lse = m + torch.log(s)
        local = targets - v0
        inside = (local >= 0) & (local < z.shape[1])
        picked = z.gather(1, local.clamp(0, max(z.shape[1] - 1, 0)).unsqueeze(1)).squeeze(1) if z.shape[1] \
            else torch.zeros_like(m)
        z_target = stock_all_reduce(torch.where(inside, picked, torch.zeros_like(picked)), group)
        mu = stock_all_reduce((e * z).sum(-1), group) / s if with_entropy else None
        ctx.save_for_backward(hidden, weight, z, lse, local, inside, *(() if mu is None else (mu,)))
        ctx.config = (v0, v1, temperature, group, tied, with_entropy)
        ctx.set_materialize_grads(False)
        lp = z_target - lse
        return (lp, lse - mu) if with_entropy else lp

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, z, lse, local, inside, *rest = ctx.saved_tensors
        v0, v1, temperature, group, tied, with_entropy = ctx.config
        g_lp = grads[0] if grads[0] is not None else torch.zeros_like(lse)
        p = torch.exp(z - lse.unsqueeze(1))
        q = g_lp.unsqueeze(1).expand_as(z)
        if with_entropy and grads[1] is not None:
            q = q + grads[1].unsqueeze(1) * (z - rest[0].unsqueeze(1))
        dz = -(p * q)
        rows = inside.nonzero().squeeze(1)
        dz[rows, local[rows]] += g_lp[rows]
        dz = dz / temperature
        w = (weight[v0:v1] if tied else weight).float()
        grad_h = stock_all_reduce(dz @ w, group).to(hidden.dtype)
        grad_w_shard = (dz.t() @ hidden.float()).to(weight.dtype)
        if tied:
            grad_w = torch.zeros_like(weight)
            grad_w[v0:v1] = grad_w_shard
            grad_w = stock_all_reduce(grad_w, group)
        else:
            grad_w = grad_w_shard
        return grad_h, grad_w, None, None, None, None, None, None, None


__all__ = ["NativeColumn", "NativeRow", "NativeVocabLogprob", "stock_all_reduce"]
