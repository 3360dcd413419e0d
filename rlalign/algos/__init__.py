"""RL algorithms as pure torch functions: advantages, policy losses, KL, aggregation, DAPO
filters, train/rollout mismatch corrections and the value loss; :mod:`rlalign.algos.registry`
names them and declares each one's config keys.

Shapes (see :mod:`rlalign.algos._segments`): per-token tensors are flat ``[T]`` (packed
sequences) with ``seq_ids`` ``[T]`` (int64 index of the token's sequence in ``[0, N)``) and a bool
``mask`` ``[T]``; per-sequence tensors are ``[N]`` with ``group_ids`` ``[N]`` in ``[0, G)``.
"""

from rlalign.algos.moe import load_balancing_loss, routing_mismatch, routing_terms
from rlalign.algos._segments import seq_ids_from_lengths
from rlalign.algos.advantages import (
    discounted_returns,
    expand_to_tokens,
    expand_turns_to_tokens,
    gae_advantages,
    vtrace_gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
    turn_groups,
    whiten,
)
from rlalign.algos.aggregate import MODES as AGGREGATION_MODES
from rlalign.algos.aggregate import aggregate_loss, batch_counts, loss_weights
from rlalign.algos.filters import (
    entropy_bonus,
    first_groups,
    groups_to_draw,
    informative_groups,
    overlong_filter,
    soft_overlong_penalty,
)
from rlalign.algos.kl import ESTIMATORS as KL_ESTIMATORS
from rlalign.algos.kl import kl_estimate, kl_k1, kl_k2, kl_k3, kl_loss, kl_reward_penalty
from rlalign.algos.mismatch import (
    Correction,
    behaviour_weights,
    logprob_diff_distribution,
    logprob_mismatch_stats,
    sequence_mis,
    sequence_tis,
    token_mis,
    token_tis,
)
from rlalign.algos.policy_loss import PolicyLossOutput, cispo_loss, gspo_loss, ppo_clip_loss
from rlalign.algos.registry import (
    ADVANTAGES,
    KL_ESTIMATOR_REGISTRY,
    MISMATCH_CORRECTIONS,
    POLICY_LOSSES,
    AdvantageInputs,
    Algorithm,
    TurnInputs,
    refused_setting,
)
from rlalign.algos.value import value_loss
from rlalign.algos.decoupled import behaviour_correction, decoupled_ppo_loss

__all__ = [
    "ADVANTAGES", "AGGREGATION_MODES", "KL_ESTIMATORS", "KL_ESTIMATOR_REGISTRY", "MISMATCH_CORRECTIONS",
    "POLICY_LOSSES", "AdvantageInputs", "Algorithm", "TurnInputs", "Correction", "PolicyLossOutput", "refused_setting", "value_loss",
    "aggregate_loss", "batch_counts", "cispo_loss", "discounted_returns", "entropy_bonus",
    "expand_to_tokens", "expand_turns_to_tokens", "turn_groups", "first_groups", "gae_advantages", "groups_to_draw", "grpo_advantages",
    "vtrace_gae",
    "gspo_loss", "informative_groups", "kl_estimate", "kl_k1", "kl_k2", "kl_k3", "kl_loss",
    "kl_reward_penalty", "logprob_diff_distribution", "logprob_mismatch_stats", "loss_weights", "overlong_filter",
    "ppo_clip_loss", "reinforce_pp_advantages", "rloo_advantages", "seq_ids_from_lengths",
    "sequence_mis", "sequence_tis", "soft_overlong_penalty", "token_mis", "token_rewards",
    "token_tis", "whiten", "load_balancing_loss", "routing_terms", "routing_mismatch",
    "behaviour_weights", "behaviour_correction", "decoupled_ppo_loss",
]
