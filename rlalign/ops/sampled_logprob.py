"""The log-prob of a token under the distribution the sampler actually drew it from (``rollout.logprobs=sampled``).

``ops.sample`` draws from the kept set K of a row (temperature, then min-p, top-k, top-p; greedy: the argmax
alone; :func:`rlalign.ops.torch_backend.sample.kept_set`, the one definition), renormalised over K. This op scores a
token under that distribution:

    logits  = ops.lm_logits(h, W)                        fp32, strict: the sampler's bits for the row
    z, K    = kept_set(logits, T, top_k, top_p, min_p)   z = logits / fp32(T) (the temperature rule; greedy: / 1)
    m       = max_v z_v                                  (always in K: the first token of the order)
    e_v     = exp(z_v - m) for v in K, else 0
    s       = tree_sum(e)                                (a balanced pairwise tree over the row, shape: V only)
    lse_K   = m + log(s)
    logprob = z[target] - lse_K   if target in K, else -inf
    entropy = lse_K - tree_sum(e * z over K) / s         (the entropy of the kept distribution; with_entropy)

Every step is per row, so a token's value depends only on its hidden row, W and its settings: the rollout engine
(``ops.sample_and_score(..., logprobs="sampled")``) and the trainer call this op on the same hidden rows and get the
same bits, the kept set included (the same rule on the same logits bits). Also returned, not differentiable, for
metrics: the full-softmax log-prob of the target by the same arithmetic with K = every token (not the fused
``ops.logprob_entropy`` fold: its last bits may differ) and |K|.

Gradient (a custom autograd.Function; the kept set is a non-differentiable, piecewise-constant function of the
logits, so it is held fixed): with p_v = exp(z_v - lse_K) on K and 0 elsewhere, mu = E_p[z],

    d logprob / dz_v = [v == target] - p_v        d entropy / dz_v = -p_v (z_v - mu)      (0 for v outside K)

then through / T and the LM-head GEMM as ``ops.logprob_entropy``'s torch backward does (dh over vocab blocks in
order with fixed-shape GEMMs, dW over token chunks in order, fp32, no atomics). The backward recomputes the logits
chunk by chunk and K from two saved numbers a row (K is a prefix of the order: its last token and that token's z):
peak extra memory O(token_chunk x V), never [T, V].

Strict profile only: the native sampler keeps its own set (ties at the cut broken by the sort), so its tokens are
not always in this K; ``profile="native"`` raises.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from rlalign.contract.errors import fail
from rlalign.contract.profiles import Profile, as_profile
from rlalign.ops import _checks as chk
from rlalign.ops.logprob import check_targets, lm_logits
from rlalign.ops.sample import check_min_p, check_values, per_row
from rlalign.ops.temperature import divide_by_temperature, temperature_divisor
from rlalign.ops.torch_backend.logprob import add_grad_hidden, add_grad_weight, index_chunks
from rlalign.reductions import tree_sum
from rlalign.ops.torch_backend.sample import kept_set

OP = "sampled_logprob"
TOKEN_CHUNK = 256   # rows per chunk: memory only (every step is per row)


class SampledLogprobs(NamedTuple):
    """``logprob`` fp32 [T] (log p_K(target), differentiable); ``entropy`` fp32 [T] of p_K or None; ``full_logprob``
    fp32 [T] (log softmax(z)[target], no gradient); ``kept`` int64 [T] (|K|)."""
    logprob: torch.Tensor
    entropy: torch.Tensor | None
    full_logprob: torch.Tensor
    kept: torch.Tensor


def sampled_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature=1.0, top_k=0,
                    top_p=1.0, min_p=0.0, with_entropy: bool = False, token_chunk: int = TOKEN_CHUNK,
                    profile=None) -> SampledLogprobs:
    """Score ``targets`` under the kept-set distribution of ``ops.sample`` (module docstring).

    hidden [T, H], weight [V, H] (the LM head), targets int [T]; temperature (0 = greedy), top_k (0 = off), top_p
    (1 = off), min_p (0 = off): a number or a [T] tensor each, the values ``ops.sample`` takes. Differentiable with
    respect to hidden and weight through ``logprob`` and ``entropy``."""
    if as_profile(profile) is Profile.PORTABLE:
        raise fail(OP, "sampled log-probs are not implemented in the portable profile (docs/portable.md)")
    if as_profile(profile) is Profile.NATIVE:
        raise fail(OP, "sampled log-probs need the strict profile (the native sampler's kept set breaks ties at the "
                       "cut by its sort, so a drawn token may lie outside the scored set)")
    chk.ndim(OP, "hidden", hidden, 2)
    chk.ndim(OP, "weight", weight, 2)
    check_targets(OP, targets, hidden.shape[0], weight.shape[0])
    if isinstance(token_chunk, bool) or not isinstance(token_chunk, int) or token_chunk <= 0:
        raise fail(OP, f"token_chunk must be a positive int, got {token_chunk!r}")
    settings = _settings(hidden, temperature, top_k, top_p, min_p)
    out = _SampledLogprob.apply(hidden, weight, targets.long(), settings, token_chunk, bool(with_entropy))
    logprob, entropy, full, kept = out
    return SampledLogprobs(logprob, entropy if with_entropy else None, full, kept)


def _settings(hidden, temperature, top_k, top_p, min_p) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p) as [T] tensors on the hidden rows' device, checked as ops.sample checks
    them."""
    rows, dev = hidden.shape[0], hidden.device
    temperature = per_row("temperature", temperature, rows, dev, integer=False)
    top_k = per_row("top_k", top_k, rows, dev, integer=True)
    top_p = per_row("top_p", top_p, rows, dev, integer=False)
    min_p = per_row("min_p", min_p, rows, dev, integer=False)
    zeros = torch.zeros(rows, dtype=torch.int64, device=dev)
    check_values(zeros, zeros, zeros, temperature, top_k, top_p)
    check_min_p(min_p)
    return temperature, top_k, top_p, min_p


def _kept_chunk(hidden, weight, settings, rows: slice):
    """(z, keep) of token chunk ``rows``: the sampler's logits of those rows and their kept sets."""
    logits = lm_logits(hidden[rows], weight, profile="strict")
    return kept_set(logits, *(s[rows] for s in settings))


def kept_boundary(z: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z_c, c) per row: the last kept token c of the order (z desc, id asc) and its z. K is a prefix of that order
    (every rule of ``kept_set`` keeps one), so these two numbers hold it exactly: :func:`kept_from_boundary`."""
    z_c = torch.where(keep, z, float("inf")).amin(-1)
    ids = torch.arange(z.shape[1], device=z.device)
    c = torch.where(keep & (z == z_c.unsqueeze(-1)), ids, -1).amax(-1)
    return z_c, c


def kept_from_boundary(z: torch.Tensor, z_c: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The kept set from its boundary (:func:`kept_boundary`) and the same z bits: the tokens before or at c in the
    order, i.e. z > z_c, or z == z_c with an id <= c."""
    ids = torch.arange(z.shape[1], device=z.device)
    z_c, c = z_c.unsqueeze(-1), c.unsqueeze(-1)
    return (z > z_c) | ((z == z_c) & (ids <= c))


def kept_log_softmax(z: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """The forward formula of the module docstring on one chunk: (logprob, entropy | None, full logprob, |K|, lse_K,
    mu | None), all per row."""
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    m = z.amax(-1, keepdim=True)
    e_all = torch.exp(z - m)
    e = torch.where(keep, e_all, zero)
    lse = m.squeeze(-1) + torch.log(tree_sum(e))
    z_t = z.gather(1, targets.unsqueeze(1)).squeeze(1)
    in_k = keep.gather(1, targets.unsqueeze(1)).squeeze(1)
    logprob = torch.where(in_k, z_t - lse, float("-inf"))
    full = z_t - (m.squeeze(-1) + torch.log(tree_sum(e_all)))
    entropy = mu = None
    if with_entropy:   # e * z over K only (a masked -inf z outside K would give 0 * -inf = NaN)
        mu = tree_sum(torch.where(keep, e * z, zero)) / tree_sum(e)
        entropy = lse - mu
    return logprob, entropy, full, keep.sum(-1), lse, mu


def _grad_logits(z, keep, targets, lse, mu, g_lp, g_ent, divisor):
    """dL/dlogits of one chunk: d/dz of the module docstring, 0 outside K, then / T (the temperature rule)."""
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    p = torch.where(keep, torch.exp(z - lse.unsqueeze(1)), zero)
    q = g_lp.unsqueeze(1) if g_ent is None else g_lp.unsqueeze(1) + g_ent.unsqueeze(1) * (z - mu.unsqueeze(1))
    dz = torch.where(keep, -(p * q), zero)
    in_k = keep.gather(1, targets.unsqueeze(1))
    dz.scatter_add_(1, targets.unsqueeze(1), torch.where(in_k, g_lp.unsqueeze(1), zero))
    return dz / divisor


class _SampledLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, settings, token_chunk, with_entropy):
        tokens, dev = hidden.shape[0], hidden.device
        parts = []
        for rows in index_chunks(tokens, token_chunk):
            z, keep = _kept_chunk(hidden, weight, settings, rows)
            parts.append((*kept_log_softmax(z, keep, targets[rows], with_entropy), *kept_boundary(z, keep)))
        if not parts:
            empty = torch.empty(0, dtype=torch.float32, device=dev)
            parts = [(empty, empty if with_entropy else None, empty, empty.long(), empty, empty if with_entropy else None,
                      empty, empty.long())]
        logprob, entropy, full, kept, lse, mu, z_c, c = (None if p[0] is None else torch.cat(p) for p in zip(*parts))
        # the backward rebuilds each row's kept set from its boundary (two numbers a row) and the recomputed z
        ctx.save_for_backward(hidden, weight, targets, lse, z_c, c, *(() if mu is None else (mu,)))
        ctx.settings, ctx.token_chunk = settings, token_chunk
        ctx.mark_non_differentiable(full, kept)
        ctx.set_materialize_grads(False)
        return logprob, (entropy if with_entropy else logprob.new_zeros(0)), full, kept

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent, _g_full, _g_kept):
        hidden, weight, targets, lse, z_c, c, *rest = ctx.saved_tensors
        mu = rest[0] if rest else None
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float()
        g_ent = None if g_ent is None or mu is None or not g_ent.numel() else g_ent.float()
        w_f32 = weight.float()
        dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_dh else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
        for rows in index_chunks(hidden.shape[0], ctx.token_chunk):
            divisor = temperature_divisor(ctx.settings[0][rows], hidden.device)   # [rows, 1], greedy rows 1
            z = divide_by_temperature(lm_logits(hidden[rows], weight, profile="strict"), divisor)   # kept_set's z
            keep = kept_from_boundary(z, z_c[rows], c[rows])
            dlogits = _grad_logits(z, keep, targets[rows], lse[rows], None if mu is None else mu[rows], g_lp[rows],
                                   None if g_ent is None else g_ent[rows], divisor)
            if need_dh:
                add_grad_hidden(dh[rows], dlogits, w_f32)
            if need_dw:
                add_grad_weight(dw, dlogits, hidden[rows].float().contiguous(), first=rows.start == 0)
        return (None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype),
                None, None, None, None)


__all__ = ["sampled_logprob", "SampledLogprobs", "kept_log_softmax", "kept_boundary", "kept_from_boundary"]
