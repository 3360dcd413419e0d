"""Train/rollout mismatch: comparison statistics and corrections for the native profile.

In the strict profile the trainer's old-policy log-probs equal the rollout engine's bit for
bit and none of this is needed beyond :func:`logprob_mismatch_stats`. In the native profile
they differ; with ``log rho_t = old_logprobs_t - rollout_logprobs_t`` (trainer minus rollout),
the tokens were sampled from the rollout policy and ``rho`` reweights them to the trainer's:

- TIS (truncated importance sampling): weight ``min(rho, C)`` per token, or per sequence with
  the sequence ratio;
- MIS (masked importance sampling): drop tokens / sequences whose ratio is outside ``[low, high]``.

The sequence ratio is ``exp(sum_t log rho_t)`` (``ratio="product"``) or
``exp(mean_t log rho_t)`` (``ratio="geometric"``), over the sequence's masked-in tokens.
Ratios are computed as ``exp(min(log rho, 80))`` so statistics stay finite (float64 inside).
Every function returns a :class:`Correction`; stats are 0-dim detached tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rlalign.algos import _segments as S
from rlalign.algos.kl import kl_k3
from rlalign.contract.bits import differing

DIFF_QUANTILES = (0.5, 0.9, 0.99)

SEQ_RATIOS = ("product", "geometric")
_MAX_LOG = 80.0


@dataclass
class Correction:
    """``weights`` ``[T]``: multiply the per-token loss (``is_weights`` of the policy losses);
    0 where ``mask`` is False. ``mask`` ``[T]``: the tokens still in the loss."""

    weights: torch.Tensor
    mask: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


def _log_rho(fn: str, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
             ) -> torch.Tensor:
    S.check_flat(fn, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    S.check_float(fn, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    S.check_mask(fn, mask)
    return (old_logprobs.detach().double() - rollout_logprobs.detach().double())


def _ratio(log_rho: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_rho.clamp(max=_MAX_LOG))


def _seq_log_rho(fn: str, log_rho: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor,
                 num_seqs: int | None, ratio: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sequence log ratio ``[N]``, bool ``[N]`` sequences with a masked-in token)."""
    if ratio not in SEQ_RATIOS:
        raise S.fail(fn, f"unknown ratio {ratio!r}; choose one of {', '.join(SEQ_RATIOS)}")
    S.check_flat(fn, mask=mask, seq_ids=seq_ids)
    seg = S.segments(seq_ids[mask], S.check_ids(fn, seq_ids, num_seqs))
    total = S.seg_sum(log_rho[mask], seg)
    if ratio == "geometric":
        total = total / seg.counts.clamp(min=1).double()
    return total, seg.counts > 0


def _token_ratio_stats(log_rho: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    rho = _ratio(log_rho)
    return {
        "ratio_mean": S.masked_mean(rho, mask),
        "ratio_max": S.masked_max(rho, mask),
        "ratio_min": S.masked_min(rho, mask),
        # samples come from the rollout policy: k3 estimate of KL(rollout || trainer)
        "kl_k3": S.masked_mean(torch.exp(log_rho) - log_rho - 1.0, mask),
    }


def _seq_stats(seq_log: torch.Tensor, has_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    rho = _ratio(seq_log)
    return {
        "seq_ratio_mean": S.masked_mean(rho, has_tokens),
        "seq_ratio_max": S.masked_max(rho, has_tokens),
        "seq_ratio_min": S.masked_min(rho, has_tokens),
    }


def _check_cap(fn: str, cap: float) -> None:
    if not cap > 0:
        raise S.fail(fn, f"cap must be > 0, got {cap}")


def _check_bounds(fn: str, low: float, high: float) -> None:
    if not 0 <= low <= 1.0 <= high:
        raise S.fail(fn, f"need 0 <= low <= 1 <= high, got low={low}, high={high}")


def _weights(values: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).to(dtype)


def token_tis(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
              cap: float = 2.0) -> Correction:
    """Token-level TIS: ``w_t = min(exp(old_t - rollout_t), cap)`` on masked-in tokens, else 0.

    Stats: ``ratio_mean/max/min`` (untruncated rho), ``truncated_frac`` (tokens with rho > cap),
    ``kl_k3`` (k3 estimate of KL(rollout || trainer) per token, mean).
    """
    _check_cap("token_tis", cap)
    log_rho = _log_rho("token_tis", old_logprobs, rollout_logprobs, mask)
    rho = _ratio(log_rho)
    stats = {**_token_ratio_stats(log_rho, mask), "truncated_frac": S.frac(rho > cap, mask)}
    return Correction(_weights(rho.clamp(max=cap), mask, old_logprobs.dtype), mask, stats)


def sequence_tis(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                 seq_ids: torch.Tensor, *, cap: float = 2.0, ratio: str = "product",
                 num_seqs: int | None = None) -> Correction:
    """Sequence-level TIS: every masked-in token of sequence i gets ``min(rho_i, cap)``.

    ``rho_i`` is the sequence ratio (module doc). Stats: token ``ratio_*`` and ``kl_k3``,
    ``seq_ratio_mean/max/min`` and ``truncated_frac`` (fraction of sequences with rho_i > cap).
    """
    fn = "sequence_tis"
    _check_cap(fn, cap)
    log_rho = _log_rho(fn, old_logprobs, rollout_logprobs, mask)
    seq_log, has_tokens = _seq_log_rho(fn, log_rho, mask, seq_ids, num_seqs, ratio)
    seq_w = _ratio(seq_log).clamp(max=cap)
    stats = {**_token_ratio_stats(log_rho, mask), **_seq_stats(seq_log, has_tokens),
             "truncated_frac": S.frac(_ratio(seq_log) > cap, has_tokens)}
    return Correction(_weights(seq_w[seq_ids], mask, old_logprobs.dtype), mask, stats)


def token_mis(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
              low: float = 0.5, high: float = 2.0) -> Correction:
    """Token-level MIS: keep token t iff ``low <= rho_t <= high``; ``mask`` out = ``mask & keep``,
    weights 1.0 on kept tokens, 0 elsewhere. Stats: ratio stats, ``kl_k3``, ``masked_frac``
    (fraction of the input's masked-in tokens that were dropped)."""
    _check_bounds("token_mis", low, high)
    log_rho = _log_rho("token_mis", old_logprobs, rollout_logprobs, mask)
    rho = _ratio(log_rho)
    keep = mask & (rho >= low) & (rho <= high)
    stats = {**_token_ratio_stats(log_rho, mask), "masked_frac": S.frac(~keep, mask)}
    return Correction(_weights(torch.ones_like(rho), keep, old_logprobs.dtype), keep, stats)


def sequence_mis(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                 seq_ids: torch.Tensor, *, low: float = 0.5, high: float = 2.0, ratio: str = "geometric",
                 num_seqs: int | None = None) -> Correction:
    """Sequence-level MIS: drop every token of sequence i unless ``low <= rho_i <= high``.

    ``rho_i`` per the module doc (default geometric mean, whose scale does not grow with length).
    Stats: token ratio stats, ``kl_k3``, ``seq_ratio_*``, ``masked_frac`` (fraction of sequences
    with a masked-in token that were dropped).
    """
    fn = "sequence_mis"
    _check_bounds(fn, low, high)
    log_rho = _log_rho(fn, old_logprobs, rollout_logprobs, mask)
    seq_log, has_tokens = _seq_log_rho(fn, log_rho, mask, seq_ids, num_seqs, ratio)
    seq_rho = _ratio(seq_log)
    seq_keep = (seq_rho >= low) & (seq_rho <= high)
    keep = mask & seq_keep[seq_ids]
    stats = {**_token_ratio_stats(log_rho, mask), **_seq_stats(seq_log, has_tokens),
             "masked_frac": S.frac(~seq_keep, has_tokens)}
    return Correction(_weights(torch.ones_like(log_rho), keep, old_logprobs.dtype), keep, stats)


def behaviour_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor
                      ) -> Correction:
    """The exact behaviour importance weight of decoupled PPO: ``w_t = exp(prox_t - behav_t)`` on masked-in
    tokens (computed in float64 from ``exp(min(prox_t - behav_t, 80))``, cast to the log-probs' dtype), else 0.

    ``behav`` are the log-probs the rollout engine recorded when it sampled the token (an older weights version
    in asynchronous steps), ``prox`` the trainer's log-probs under the weights at the start of the step (the
    proximal policy). Untruncated: use :func:`token_tis` / :func:`token_mis` on the same inputs to bound it.
    Stats: ``ratio_mean/max/min`` of ``w`` and ``kl_k3`` (k3 estimate of KL(behaviour || proximal))."""
    log_w = _log_rho("behaviour_weights", proximal_logprobs, behaviour_logprobs, mask)
    return Correction(_weights(_ratio(log_w), mask, proximal_logprobs.dtype), mask, _token_ratio_stats(log_w, mask))


def logprob_mismatch_stats(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                           mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Compare two log-prob tensors token by token over ``mask``.

    Keys: ``tokens`` (masked-in tokens compared), ``count`` (tokens whose raw bits differ,
    :mod:`rlalign.contract.bits`, so -0.0 vs +0.0 counts), ``max_abs`` and ``mean_abs`` of
    ``|trainer - rollout|`` (float64),
    ``kl_k3`` (mean over tokens of ``exp(d) - d - 1``, ``d = trainer - rollout``: k3 estimate of
    KL(rollout || trainer)). Both tensors must have the same dtype.
    """
    fn = "logprob_mismatch_stats"
    S.check_flat(fn, trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    S.check_mask(fn, mask)
    if trainer_logprobs.dtype != rollout_logprobs.dtype:
        raise S.fail(fn, f"dtypes differ: {trainer_logprobs.dtype} vs {rollout_logprobs.dtype}")
    a, b = trainer_logprobs.detach(), rollout_logprobs.detach()
    differ = differing(a, b)
    d = a.double() - b.double()
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    abs_d = d.abs()
    return {
        "tokens": mask.sum(),
        "count": (differ & mask).sum(),
        "max_abs": S.masked_max(abs_d, mask),
        "mean_abs": S.masked_mean(abs_d, mask),
        "kl_k3": S.masked_mean(kl_k3(b.double(), a.double()), mask),
    }


def logprob_diff_distribution(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                              mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The spread of ``d = trainer - rollout`` over the masked-in tokens (float64), beyond
    :func:`logprob_mismatch_stats`' mean and max: ``abs_p50`` / ``abs_p90`` / ``abs_p99``, the
    :data:`DIFF_QUANTILES` of ``|d|`` (``torch.quantile``'s linear interpolation), and ``ratio_min`` /
    ``ratio_max``, the extremes of the per-token importance ratio ``exp(d)`` (``exp(min(d, 80))``).
    Every value is 0 when no token is masked in (the ratio's then 1)."""
    fn = "logprob_diff_distribution"
    S.check_flat(fn, trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    S.check_float(fn, trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs)
    S.check_mask(fn, mask)
    d = trainer_logprobs.detach().double()[mask] - rollout_logprobs.detach().double()[mask]
    if d.numel() == 0:
        zero, one = torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
        return {**{f"abs_p{round(q * 100)}": zero for q in DIFF_QUANTILES}, "ratio_min": one, "ratio_max": one}
    qs = torch.quantile(d.abs(), torch.tensor(DIFF_QUANTILES, dtype=torch.float64, device=d.device))
    rho = _ratio(d)
    return {**{f"abs_p{round(q * 100)}": v for q, v in zip(DIFF_QUANTILES, qs)},
            "ratio_min": rho.min(), "ratio_max": rho.max()}
