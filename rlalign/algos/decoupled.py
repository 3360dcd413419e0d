"""Decoupled PPO: the off-policy objective of asynchronous steps, with three policies.

- the **behaviour** policy ``behav``: the weights version that sampled a token (the rollout engine recorded its
  log-prob when it sampled it; in asynchronous steps an older version than the trainer's);
- the **proximal** policy ``prox``: the trainer's weights at the start of the step (its log-probs are a forward of
  the step's samples before any optimizer step);
- the **current** policy ``pi``: the weights being optimised (with gradient).

Per token (AReaL's decoupled PPO objective, Fu et al., 2025)::

    L_t = w_t * max(-A_t r_t, -A_t clamp(r_t, 1 - clip_low, 1 + clip_high)),
    r_t = exp(pi_t - prox_t),   w_t = exp(prox_t - behav_t)   (a constant: no gradient)

The clip acts on the trust region around the proximal policy; the behaviour weight ``w`` is the importance weight
that makes the samples of an older version an unbiased estimate under the proximal one. In rlalign ``behav`` is the
engine's exact log-prob (bit for bit the trainer's forward under that version's weights, checkable with
``run.verify_behaviour``), so ``w`` is exact, not an estimate of a mismatch. ``w`` may be bounded the usual ways
(:func:`behaviour_correction`): truncated at a cap (TIS) or masked outside ``[low, high]`` (MIS; AReaL's
``behav_imp_weight_cap`` masks above the cap), per token or per sequence. Every quantity is per token, so a sample
whose tokens several versions sampled (partial rollouts, ``rollout.partial_tokens``) needs nothing more: each token's
``behav`` is its own version's.
"""

from __future__ import annotations

import torch

from rlalign.algos.mismatch import Correction, behaviour_weights
from rlalign.algos.policy_loss import PolicyLossOutput, ppo_clip_loss
from rlalign.algos.registry import MISMATCH_CORRECTIONS


def behaviour_correction(correction: str, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                         mask: torch.Tensor, seq_ids: torch.Tensor, **knobs) -> Correction:
    """The behaviour weights ``w`` of the step's tokens under ``algo.mismatch_correction`` = ``correction``:
    ``none`` the exact ``exp(prox - behav)`` (:func:`rlalign.algos.mismatch.behaviour_weights`); a TIS / MIS name
    that correction of the same ratio (``knobs``: its ``mismatch_cap``)."""
    entry = MISMATCH_CORRECTIONS[correction]
    if entry.fn is None:
        return behaviour_weights(proximal_logprobs, behaviour_logprobs, mask)
    return entry.fn(proximal_logprobs, behaviour_logprobs, mask, seq_ids, **knobs)


def decoupled_ppo_loss(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, *,
                       correction: str = "none", clip_low: float = 0.2, clip_high: float = 0.28,
                       clip_c: float | None = None, **knobs) -> PolicyLossOutput:
    """The per-token decoupled PPO loss of the module doc: the clipped surrogate of :func:`ppo_clip_loss` against
    the proximal log-probs, times the behaviour weights of :func:`behaviour_correction` (as constants). The trainer
    computes exactly this: ``algo.policy_loss`` with the weights as its ``is_weights``."""
    weights = behaviour_correction(correction, proximal_logprobs, behaviour_logprobs, mask, seq_ids, **knobs)
    w = weights.weights if weights.weights is not None else weights.mask.to(logprobs.dtype)
    return ppo_clip_loss(logprobs, proximal_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                         clip_c=clip_c, is_weights=w)


__all__ = ["behaviour_correction", "decoupled_ppo_loss"]
