"""Per-token estimators of KL(pi || ref) from the log-probs of tokens sampled from pi.

With ``log_r = ref_logprobs - logprobs`` (log of ref(y_t) / pi(y_t)), Schulman's estimators are

- k1 = ``-log_r = logprobs - ref_logprobs``            (unbiased, can be negative),
- k2 = ``0.5 * log_r^2``                               (biased, low variance, >= 0),
- k3 = ``exp(log_r) - log_r - 1``                      (unbiased, >= 0).

Each is exact in expectation (k1, k3) over y_t ~ pi; none needs the full distribution.
Use KL either in the reward (:func:`kl_reward_penalty`, with the old policy's log-probs, no
gradient) or as a loss term (:func:`kl_loss`, gradient through ``logprobs``).
"""

from __future__ import annotations

import torch

from rlalign.algos import _portable as P
from rlalign.algos import _segments as S



def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k1 = logprobs - ref_logprobs``."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k2 = 0.5 * (logprobs - ref_logprobs)^2``."""
    d = logprobs - ref_logprobs
    return 0.5 * d * d


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(ref_logprobs - logprobs) - (ref_logprobs - logprobs) - 1``."""
    log_r = ref_logprobs - logprobs
    return P.exp(log_r) - log_r - 1.0


ESTIMATOR_FUNCTIONS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}   # name -> fn(logprobs, ref_logprobs)
ESTIMATORS = tuple(ESTIMATOR_FUNCTIONS)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3", *,
                clamp: float | None = None) -> torch.Tensor:
    """Per-token KL(pi || ref) by ``estimator`` ('k1' | 'k2' | 'k3'), elementwise, any shape.

    With ``clamp`` = c, the estimate is clamped to ``[-c, c]`` (guards k3's exp against
    outliers; the gradient is zero where the clamp is active).
    """
    if estimator not in ESTIMATORS:
        raise S.fail("kl_estimate", f"unknown estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise S.fail("kl_estimate", f"shapes differ: logprobs {tuple(logprobs.shape)} vs "
                                    f"ref_logprobs {tuple(ref_logprobs.shape)}")
    kl = ESTIMATOR_FUNCTIONS[estimator](logprobs, ref_logprobs)
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def kl_reward_penalty(kl: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token reward term ``-coef * kl`` on masked-in tokens, 0 elsewhere (detached).

    Add it to the per-token rewards (see :func:`rlalign.algos.advantages.token_rewards`).
    """
    S.check_flat("kl_reward_penalty", kl=kl, mask=mask)
    S.check_mask("kl_reward_penalty", mask)
    pen = -coef * kl.detach()
    return torch.where(mask, pen, torch.zeros_like(pen))


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
            estimator: str = "k3", *, clamp: float | None = 10.0) -> torch.Tensor:
    """Per-token KL loss term ``[T]`` (unscaled): ``kl_estimate(logprobs, ref_logprobs.detach())``.

    0 on masked-out tokens; the gradient flows through ``logprobs`` only. Multiply by the KL
    coefficient and aggregate with :mod:`rlalign.algos.aggregate` like the policy loss.
    """
    S.check_flat("kl_loss", logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    S.check_mask("kl_loss", mask)
    kl = kl_estimate(logprobs, ref_logprobs.detach(), estimator, clamp=clamp)
    return torch.where(mask, kl, torch.zeros_like(kl))
