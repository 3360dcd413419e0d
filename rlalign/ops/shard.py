"""Shard-level entries of the strict ops, for tensor parallelism (rlalign.distributed).

Each returns the *unrounded fp32* piece that one rank contributes, computed with exactly the
arithmetic the full op uses for that piece, so that a fixed cross-rank merge rebuilds the full
op's bits:

    linear_partial(x, w, segments)          fp32 [M, N]: K cut into ``segments`` equal segments, each
                                            reduced from zero, merged by the balanced tree -- one
                                            subtree of the canonical partition (rounded nowhere)
    linear_weight_grad(g, x, out_dtype)     dW = g^T @ x as the backend's linear backward computes it
    logprob_shard_stats(h, w_shard, targets, v0, temperature, with_entropy)
                                            per-vocab-block (max, sum exp, sum exp*z) of the shard
                                            [v0, v0 + len(w_shard)) and z[target] where the target
                                            falls inside the shard (0 elsewhere)
    logprob_merge_stats(stats, z_target)    the fixed left-to-right fold of all blocks' stats
                                            -> (logprob, entropy | None, lse, mu | None)
    logprob_shard_dlogits(h, w_shard, targets, v0, lse, mu, temperature, g_lp, g_ent)
                                            d loss / d z for the shard's columns

The block size of the stats is the backend's (torch: spec.VOCAB_BLOCK, triton: its vocab tile);
``v0`` must be a multiple of spec.VOCAB_BLOCK, which is a multiple of both.
"""

from __future__ import annotations

import torch

from rlalign.contract import spec
from rlalign.contract.errors import fail
from rlalign.ops import _checks as chk
from rlalign.ops._dispatch import strict_impl


def linear_partial(x: torch.Tensor, w: torch.Tensor, segments: int) -> torch.Tensor:
    """fp32 [M, N] = the canonical-partition subtree of x [M, K] @ w [N, K]^T over ``segments``
    equal K segments (1, 2, 4 or 8; must divide K). Not differentiable (used inside autograd Functions)."""
    op = "linear_partial"
    chk.dtype_ok(op, x, w)
    chk.same_device(op, x, w)
    chk.ndim(op, "x", x, 2)
    chk.ndim(op, "w", w, 2)
    if x.shape[1] != w.shape[1]:
        raise fail(op, f"x has {x.shape[1]} features but w is {tuple(w.shape)} ([N, K])")
    if segments not in (1, 2, 4, 8) or x.shape[1] % segments:
        raise fail(op, f"segments must be 1, 2, 4 or 8 and divide K={x.shape[1]}, got {segments}")
    return strict_impl(op, x.device)(x, w, segments)


def linear_weight_grad(grad_out: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dW [N, K] = grad_out[M, N]^T @ x[M, K], reduced over the M rows as the backend's linear backward does."""
    op = "linear_weight_grad"
    chk.dtype_ok(op, grad_out, x)
    if grad_out.shape[0] != x.shape[0]:
        raise fail(op, f"grad_out has {grad_out.shape[0]} rows but x has {x.shape[0]}")
    return strict_impl(op, x.device)(grad_out, x, out_dtype)


def _check_shard(op: str, hidden, weight, targets, v0: int) -> None:
    chk.dtype_ok(op, hidden, weight)
    chk.same_device(op, hidden, weight, targets)
    if hidden.shape[1] != weight.shape[1]:
        raise fail(op, f"hidden has {hidden.shape[1]} features but the weight shard is {tuple(weight.shape)}")
    if v0 % spec.VOCAB_BLOCK:
        raise fail(op, f"shard offset {v0} is not a multiple of VOCAB_BLOCK={spec.VOCAB_BLOCK}")


def logprob_shard_stats(hidden, weight, targets, v0: int, temperature: float, with_entropy: bool):
    """-> (stats fp32 [2|3, blocks, T], z_target fp32 [T]); see the module docstring."""
    op = "logprob_shard_stats"
    _check_shard(op, hidden, weight, targets, v0)
    return strict_impl(op, hidden.device)(hidden, weight, targets.long(), int(v0), float(temperature),
                                          bool(with_entropy))


def logprob_merge_stats(stats: torch.Tensor, z_target: torch.Tensor):
    """-> (logprob, entropy | None, lse, mu | None), fp32 [T]; stats [2|3, blocks, T] in vocab order."""
    op = "logprob_merge_stats"
    if stats.dim() != 3 or stats.shape[0] not in (2, 3) or stats.shape[2] != z_target.shape[0]:
        raise fail(op, f"stats must be [2|3, blocks, T] matching z_target [T], got {tuple(stats.shape)}")
    return strict_impl(op, stats.device)(stats.contiguous(), z_target.contiguous())


def logprob_shard_dlogits(hidden, weight, targets, v0: int, lse, mu, temperature: float, g_lp, g_ent):
    """d loss / d z [T, V_shard] for the shard's columns (dtype: the backend's)."""
    op = "logprob_shard_dlogits"
    _check_shard(op, hidden, weight, targets, v0)
    return strict_impl(op, hidden.device)(hidden, weight, targets.long(), int(v0), lse, mu, float(temperature),
                                          g_lp, g_ent)


__all__ = ["linear_partial", "linear_weight_grad", "logprob_shard_stats", "logprob_merge_stats",
           "logprob_shard_dlogits"]
