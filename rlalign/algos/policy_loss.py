"""Policy-gradient losses per token: PPO clip (asymmetric clip-higher, dual-clip), GSPO, CISPO.

Inputs are per-token ``[T]`` (see :mod:`rlalign.algos._segments`): ``logprobs`` of the current
policy (with gradient), ``old_logprobs`` of the policy that the data is attributed to (no
gradient), ``advantages`` and the bool ``mask``. Each function returns a
:class:`PolicyLossOutput`: ``loss`` ``[T]`` is the per-token loss to minimise (0 where mask is
False; aggregate it with :mod:`rlalign.algos.aggregate`), ``stats`` holds 0-dim detached tensors
over the masked-in tokens of this call (``.item()`` them to log).

The ratio is ``r_t = exp(clamp(logprobs - old_logprobs, -max_log_ratio, max_log_ratio))``.
``is_weights`` (optional, ``[T]``, e.g. truncated importance weights from
:mod:`rlalign.algos.mismatch`) multiply the per-token loss as constants.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlalign.algos import _portable as P
from rlalign.algos import _segments as S
from rlalign.algos.kl import kl_k3


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


def _check(fn: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
           mask: torch.Tensor, is_weights: torch.Tensor | None) -> None:
    S.check_flat(fn, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    S.check_float(fn, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    S.check_mask(fn, mask)
    if is_weights is not None:
        S.check_flat(fn, logprobs=logprobs, is_weights=is_weights)


def _check_clip(fn: str, clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise S.fail(fn, f"need 0 <= clip_low <= 1 and clip_high >= 0, got clip_low={clip_low}, "
                         f"clip_high={clip_high}")


def _finish(loss: torch.Tensor, mask: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    if is_weights is not None:
        loss = loss * is_weights.detach().to(loss.dtype)
    return torch.where(mask, loss, torch.zeros_like(loss))


def _ratio_stats(ratio: torch.Tensor, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, torch.Tensor]:
    ratio = ratio.detach()
    return {
        "ratio_mean": S.masked_mean(ratio, mask),
        "ratio_max": S.masked_max(ratio, mask),
        "ratio_min": S.masked_min(ratio, mask),
        # k3 estimate of KL(old || current) from tokens sampled by the old policy
        "approx_kl": S.masked_mean(kl_k3(old_logprobs.detach(), logprobs.detach()), mask),
    }


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max(pg1, pg2), pg1, pg2) with pg1 = -A r and pg2 = -A clamp(r, 1 - clip_low, 1 + clip_high)."""
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(pg1, pg2), pg1, pg2


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                  clip_c: float | None = None, is_weights: torch.Tensor | None = None,
                  max_log_ratio: float = 20.0) -> PolicyLossOutput:
    """PPO clipped surrogate with asymmetric bounds (DAPO clip-higher) and optional dual-clip.

    ``L_t = max(-A_t r_t, -A_t clamp(r_t, 1 - clip_low, 1 + clip_high))``; with dual-clip
    (Ye et al., 2020; ``clip_c > 1``) tokens with ``A_t < 0`` use ``min(L_t, -clip_c * A_t)``.
    Stats: ``clip_frac`` (tokens where the clipped term is the larger, i.e. no gradient),
    ``clip_frac_low`` (``A < 0`` and ``r < 1 - clip_low``), ``clip_frac_high`` (``A > 0`` and
    ``r > 1 + clip_high``), ``dual_clip_frac``, ``ratio_mean/max/min``, ``approx_kl`` (k3).
    """
    fn = "ppo_clip_loss"
    _check(fn, logprobs, old_logprobs, advantages, mask, is_weights)
    _check_clip(fn, clip_low, clip_high)
    if clip_c is not None and clip_c <= 1.0:
        raise S.fail(fn, f"clip_c must be > 1 (dual-clip bound), got {clip_c}")
    adv = advantages.detach()
    ratio = P.exp((logprobs - old_logprobs.detach()).clamp(-max_log_ratio, max_log_ratio))
    loss, pg1, pg2 = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    dual = torch.zeros_like(mask)
    if clip_c is not None:
        bound = -adv * clip_c
        dual = (adv < 0) & (bound < loss)
        loss = torch.where(dual, torch.minimum(loss, bound), loss)
    stats = {
        "clip_frac": S.frac(pg2.detach() > pg1.detach(), mask),
        "clip_frac_low": S.frac((adv < 0) & (ratio.detach() < 1.0 - clip_low), mask),
        "clip_frac_high": S.frac((adv > 0) & (ratio.detach() > 1.0 + clip_high), mask),
        "dual_clip_frac": S.frac(dual, mask),
        **_ratio_stats(ratio, logprobs, old_logprobs, mask),
    }
    return PolicyLossOutput(_finish(loss, mask, is_weights), stats)


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, seq_ids: torch.Tensor, *, clip_low: float = 3e-4, clip_high: float = 4e-4,
              num_seqs: int | None = None, is_weights: torch.Tensor | None = None,
              max_log_ratio: float = 10.0) -> PolicyLossOutput:
    """GSPO (Zheng et al., 2025), sequence-level ratio in its token form ("GSPO-token").

    ``log s_i = (1 / |y_i|) sum_{t in i} (logprobs_t - old_logprobs_t)`` over the masked-in
    tokens of sequence i (``s_i``: geometric mean of the token ratios), clamped to
    ``<= max_log_ratio``; per token ``s_{i,t} = exp(sg[log s_i] + logprobs_t - sg[logprobs_t])``,
    equal to ``s_i`` in value, with gradient ``s_i * grad logprobs_t``;
    ``L_t = max(-A_t s_{i,t}, -A_t clamp(s_{i,t}, 1 - clip_low, 1 + clip_high))``.
    Aggregate with ``seq-mean-token-mean`` to get GSPO's objective (with ``A_t = A_i``).
    Stats: ``clip_frac`` (tokens), ``seq_clip_frac``, ``seq_ratio_mean/max/min`` (over
    sequences with at least one masked-in token), ``approx_kl`` (k3, tokens).
    """
    fn = "gspo_loss"
    _check(fn, logprobs, old_logprobs, advantages, mask, is_weights)
    S.check_flat(fn, logprobs=logprobs, seq_ids=seq_ids)
    _check_clip(fn, clip_low, clip_high)
    num = S.check_ids(fn, seq_ids, num_seqs)
    seg = S.segments(seq_ids[mask], num)
    log_ratio = (logprobs - old_logprobs).detach()
    seq_log_s = S.seg_sum(log_ratio[mask], seg) / seg.counts.clamp(min=1).to(log_ratio.dtype)
    seq_log_s = seq_log_s.clamp(max=max_log_ratio)
    ratio = torch.exp(seq_log_s[seq_ids] + (logprobs - logprobs.detach()))
    adv = advantages.detach()
    loss, pg1, pg2 = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    seq_ratio = torch.exp(seq_log_s)
    has_tokens = seg.counts > 0
    seq_clipped = (seq_ratio < 1.0 - clip_low) | (seq_ratio > 1.0 + clip_high)
    stats = {
        "clip_frac": S.frac(pg2.detach() > pg1.detach(), mask),
        "seq_clip_frac": S.frac(seq_clipped, has_tokens),
        "seq_ratio_mean": S.masked_mean(seq_ratio, has_tokens),
        "seq_ratio_max": S.masked_max(seq_ratio, has_tokens),
        "seq_ratio_min": S.masked_min(seq_ratio, has_tokens),
        "approx_kl": S.masked_mean(kl_k3(old_logprobs.detach(), logprobs.detach()), mask),
    }
    return PolicyLossOutput(_finish(loss, mask, is_weights), stats)


def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, *, clip_low: float = 1.0, clip_high: float = 0.28,
               is_weights: torch.Tensor | None = None, max_log_ratio: float = 20.0) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, 2025): clipped, stop-gradient IS weight times the log-prob.

    ``w_t = sg[clamp(r_t, 1 - clip_low, 1 + clip_high)]`` and ``L_t = -w_t A_t logprobs_t``:
    every token keeps a gradient ``-w_t A_t grad logprobs_t``, only the weight is truncated.
    The default ``clip_low = 1`` leaves no lower bound (as in the paper); ``clip_high`` is the
    one to tune. Stats: ``clip_frac`` (tokens whose weight was truncated), ratio stats, ``approx_kl``.
    """
    fn = "cispo_loss"
    _check(fn, logprobs, old_logprobs, advantages, mask, is_weights)
    _check_clip(fn, clip_low, clip_high)
    ratio = torch.exp((logprobs - old_logprobs).detach().clamp(-max_log_ratio, max_log_ratio))
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * advantages.detach() * logprobs
    stats = {
        "clip_frac": S.frac(weight != ratio, mask),
        **_ratio_stats(ratio, logprobs, old_logprobs, mask),
    }
    return PolicyLossOutput(_finish(loss, mask, is_weights), stats)
