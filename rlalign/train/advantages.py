"""What weighs each token of the step's update, before the update runs: advantages (and a value model's
targets), the KL penalty folded into the reward, and the rollout-mismatch correction weights.

Every formula is a function of :mod:`rlalign.algos`, chosen by name from :mod:`rlalign.algos.registry`:
``algo.advantage`` (:data:`~rlalign.algos.registry.ADVANTAGES`), ``algo.kl_estimator`` and
``algo.mismatch_correction`` (:data:`~rlalign.algos.registry.MISMATCH_CORRECTIONS`).
"""

from __future__ import annotations

import dataclasses

import torch

from rlalign import algos
from rlalign.train.packing import TrainBatch
from rlalign.train.samples import StepSamples
from rlalign.train.value import ValueModel


def kl_in_reward(algo, old_lp: torch.Tensor | None, ref_lp: torch.Tensor | None,
                 batch: TrainBatch) -> torch.Tensor | None:
    """The per-token KL to the reference policy folded into the reward (``algo.kl_in_reward``), or None. Without
    the old policy's own log-probs (strict profile, no rescore) the rollout's stand for them: equal bit for bit,
    checked on every token in the first update pass."""
    if ref_lp is None or not algo.kl_in_reward:
        return None
    return algos.kl_estimate(old_lp if old_lp is not None else batch.rollout_logprobs, ref_lp, algo.kl_estimator)


def token_advantages(algo, samples: StepSamples, batch: TrainBatch, kl: torch.Tensor | None,
                     value: ValueModel | None, log_ratio: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Per-token advantages [T] by ``algo.advantage`` and, for estimators with a value model, the value targets
    (``returns``, ``old_values``). ``kl`` (per token, or None) is the KL penalty folded into the reward;
    ``log_ratio`` (per token, or None for on-policy samples) the proximal minus behaviour log-probs of samples
    generated ahead (``gae``: V-trace targets)."""
    estimator = algos.ADVANTAGES[algo.advantage]
    dev = batch.seq_ids.device
    old_values = value.old_values(batch) if estimator.value_model else None
    inputs = algos.AdvantageInputs(samples.reward_tensor(dev), samples.group_tensor(dev), batch.seq_ids, batch.mask,
                                   kl=kl, kl_coef=algo.kl_coef, values=old_values, turns=turn_inputs(samples, dev),
                                   log_ratio=log_ratio if estimator.value_model else None)
    adv, returns = estimator.fn(inputs, **estimator.knob_values(dataclasses.asdict(algo)))
    return adv, ({"returns": returns, "old_values": old_values} if estimator.value_model else {})


def turn_inputs(samples: StepSamples, device) -> "algos.TurnInputs | None":
    """Multi-turn episodes' turns (each turn's return-to-go, turn counts, each token's turn), or None."""
    if samples.turns is None:
        return None
    return algos.TurnInputs(samples.turn_returns.to(device), samples.turn_counts.to(device), samples.turns.to(device))


def mismatch_correction(algo, old_lp: torch.Tensor | None, batch: TrainBatch) -> tuple[torch.Tensor | None, dict]:
    """(per-token importance weights or None, ``rollout_corr/*`` record) of ``algo.mismatch_correction``: TIS / MIS
    weights of the trainer's old log-probs against the rollout's (none: no weights, no record)."""
    correction = algos.MISMATCH_CORRECTIONS[algo.mismatch_correction]
    if correction.fn is None:
        return None, {}
    corr = correction.fn(old_lp, batch.rollout_logprobs, batch.mask, batch.seq_ids,
                         **correction.knob_values(dataclasses.asdict(algo)))
    stats = {f"rollout_corr/{k}": float(v) for k, v in corr.stats.items()}
    weights = corr.weights if corr.weights is not None else corr.mask.to(torch.float32)
    return weights, stats


__all__ = ["kl_in_reward", "token_advantages", "turn_inputs", "mismatch_correction"]
