"""Vocab-parallel fused LM head: token logprob + entropy with the LM head's rows split over ranks.

Layout (the same at every TP degree): the vocab's nb = ceil(V / VOCAB_BLOCK) blocks are cut into
K_SEGMENTS = 8 canonical vocab segments, segment i = blocks [i*nb//8, (i+1)*nb//8) (possibly
empty); rank r of t holds segments [r*8/t, (r+1)*8/t), a contiguous vocab range starting on a
block boundary.

Forward (exactly ops.logprob_entropy's bits, at every degree): each rank computes its blocks'
statistics (ops.logprob_shard_stats: the fused op's own per-block max / sum exp / sum exp*z),
the [stats, blocks, tokens] arrays are all-gathered and concatenated in vocab order, and every
rank runs the fused op's left-to-right fold (ops.logprob_merge_stats). z[target] comes from the
rank that owns the target (selected, not summed).

Backward (the same bits at every degree; NOT the bits of ops.logprob_entropy's own backward,
whose dh is one sequential sum over the whole vocab):
    dz       = ops.logprob_shard_dlogits per segment and token chunk (TOKEN_CHUNK rows)
    dh       = canonical vocab partition: per segment, linear_partial(dz_seg, W_seg^T) from zero;
               the 8 segment partials merged by the balanced tree (a rank's subtree locally, the
               top across ranks in rank order), one rounding
    dW[seg]  = sum over token chunks, in order, of linear_weight_grad(dz_chunk, h_chunk) in fp32
               (identical work at every degree), one rounding
With tied embeddings the head reads a slice of the replicated embedding matrix and its full
gradient is all-gathered (exact copies), so every rank's embedding gradient is the same.
"""

from __future__ import annotations

import dataclasses

import torch

from rlalign.contract import spec
from rlalign.contract.errors import RLAlignError
from rlalign.distributed.collectives import gather_ranks, gather_ranks_varlen, merge_ranks, tree_reduce
from rlalign.contract.profiles import Profile, current_profile
from rlalign.distributed.launch import Group
from rlalign.distributed.native import NativeVocabLogprob
from rlalign.ops.logprob import check_strict_inputs, check_targets, check_temperature
from rlalign.ops.shard import (linear_partial, linear_weight_grad, logprob_merge_stats, logprob_shard_dlogits,
                               logprob_shard_stats)

TOKEN_CHUNK = 1024   # fixed: the order of dW's sum over tokens must not depend on the degree


@dataclasses.dataclass(frozen=True)
class VocabLayout:
    vocab: int
    segments: tuple[tuple[int, int], ...]      # absolute [start, stop) of each canonical segment

    @staticmethod
    def of(vocab: int) -> "VocabLayout":
        vb, p = spec.VOCAB_BLOCK, spec.K_SEGMENTS
        nb = -(-vocab // vb)
        bounds = [min((i * nb // p) * vb, vocab) for i in range(p + 1)]
        return VocabLayout(vocab, tuple((bounds[i], bounds[i + 1]) for i in range(p)))

    def rank_segments(self, rank: int, size: int) -> tuple[tuple[int, int], ...]:
        per = len(self.segments) // size
        return self.segments[rank * per:(rank + 1) * per]

    def rank_range(self, rank: int, size: int) -> tuple[int, int]:
        segs = self.rank_segments(rank, size)
        return segs[0][0], segs[-1][1]


def _fold_forward(hidden, w_shard, targets, v0, temperature, with_entropy, group, layout):
    stats, z_target = logprob_shard_stats(hidden, w_shard, targets, v0, temperature, with_entropy)
    all_stats = torch.cat(gather_ranks_varlen(stats, group, dim=1), dim=1)
    starts = torch.tensor([layout.rank_range(r, group.size)[0] for r in range(group.size)], device=targets.device)
    owner = torch.searchsorted(starts, targets, right=True) - 1
    z_all = torch.stack(gather_ranks(z_target, group))          # [ranks, T]
    z_target = z_all.gather(0, owner.unsqueeze(0)).squeeze(0)   # exact: the owner's value
    return logprob_merge_stats(all_stats, z_target)


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, group, layout, tied):
        start, stop = layout.rank_range(group.rank, group.size)
        w_shard = weight[start:stop] if tied else weight
        lp, ent, lse, mu = _fold_forward(hidden, w_shard, targets, start, temperature, with_entropy, group, layout)
        ctx.save_for_backward(hidden, weight, targets, lse, mu)
        ctx.set_materialize_grads(False)
        ctx.config = (temperature, with_entropy, group, layout, tied)
        return (lp, ent) if with_entropy else lp

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, targets, lse, mu = ctx.saved_tensors
        temperature, with_entropy, group, layout, tied = ctx.config
        g_lp = grads[0]
        g_ent = grads[1] if with_entropy else None
        if g_lp is None and g_ent is None:
            return (None,) * 8
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float()
        g_ent = None if g_ent is None else g_ent.float()
        start, _ = layout.rank_range(group.rank, group.size)
        dh_parts, dw_parts = [], []
        for a, b in layout.rank_segments(group.rank, group.size):
            w_seg = weight[a:b] if tied else weight[a - start:b - start]
            dh_seg, dw_seg = _segment_grads(hidden, w_seg, targets, a, lse, mu, temperature, g_lp, g_ent)
            dh_parts.append(dh_seg)
            dw_parts.append(dw_seg)
        grad_h = merge_ranks(tree_reduce(dh_parts), group).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.cat(dw_parts).to(weight.dtype)
            if tied:   # the full [V, H] gradient of the replicated matrix, the same on every rank
                grad_w = torch.cat(gather_ranks_varlen(grad_w, group, dim=0))
        return grad_h, grad_w, None, None, None, None, None, None


def _segment_grads(hidden, w_seg, targets, v0, lse, mu, temperature, g_lp, g_ent):
    """(dh partial fp32 [T, H], dW fp32 [seg, H]) of one canonical vocab segment, from zero."""
    tokens = hidden.shape[0]
    dh = torch.zeros((tokens, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    dw = torch.zeros(w_seg.shape, dtype=torch.float32, device=hidden.device)
    if w_seg.shape[0] == 0:
        return dh, dw
    for r0 in range(0, tokens, TOKEN_CHUNK):
        rows = slice(r0, min(tokens, r0 + TOKEN_CHUNK))
        dz = logprob_shard_dlogits(hidden[rows], w_seg, targets[rows], v0, lse[rows],
                                   None if mu is None else mu[rows], temperature, g_lp[rows],
                                   None if g_ent is None else g_ent[rows])
        dh[rows] = linear_partial(dz, w_seg.to(dz.dtype).t(), 1)
        part = linear_weight_grad(dz, hidden[rows].to(dz.dtype), torch.float32)
        dw = part if r0 == 0 else dw + part
    return dh, dw


class VocabParallelHead:
    """Callable LM head installed on a CausalLM by :func:`parallelize` (not an nn.Module: the weight
    stays the model's own parameter, ``lm_head.weight`` shard or the tied embedding)."""

    def __init__(self, model, group: Group):
        self.model, self.group = model, group
        self.tied = model.lm_head is None
        self.layout = VocabLayout.of(model.config.vocab_size)
        if spec.K_SEGMENTS % group.size:
            raise RLAlignError(f"vocab-parallel LM head: tp={group.size} must divide {spec.K_SEGMENTS}")

    def shard_range(self) -> tuple[int, int]:
        return self.layout.rank_range(self.group.rank, self.group.size)

    def __call__(self, hidden, targets, *, temperature: float = 1.0, with_entropy: bool = False):
        op = "logprob_entropy"
        weight = self.model.lm_head_weight
        check_targets(op, targets, hidden.shape[0], self.layout.vocab)
        temperature = check_temperature(op, temperature)
        if current_profile() is Profile.NATIVE:
            start, stop = self.shard_range()
            out = NativeVocabLogprob.apply(hidden, weight, targets.long(), start, stop, temperature, bool(with_entropy),
                                           self.group, self.tied)
            return out if with_entropy else (out, None)
        check_strict_inputs(op, hidden, weight, targets)
        out = _VocabParallelLogprob.apply(hidden, weight, targets.long(), float(temperature), bool(with_entropy),
                                          self.group, self.layout, self.tied)
        return out if with_entropy else (out, None)


__all__ = ["VocabLayout", "VocabParallelHead", "TOKEN_CHUNK"]
