"""The per-step statistics TRL / verl users look for, computed from one step's tensors.

All are means / extremes over the step's samples (rewards, lengths), its groups (zero-std
fraction), or its unmasked completion tokens (advantages, KL to the reference policy); and the
process's peak memory. In the cross-machine mode (``RLALIGN_CPU_CROSS_MACHINE=1``) means and standard
deviations are rlalign.reductions' fixed-order ones (the logged bits do not depend on the CPU); otherwise torch's.
"""

from __future__ import annotations

import resource

import torch

from rlalign import mklmode
from rlalign.algos import kl_estimate
from rlalign.reductions import fixed_mean, fixed_mean_std


def _mean(x: torch.Tensor) -> float:
    """The mean of every element (nan for none, as torch's)."""
    return (fixed_mean(x) if x.numel() else float("nan")) if mklmode.fixed_reductions() else float(x.mean())


def _std(x: torch.Tensor) -> float:
    """The unbiased std of every element; 0.0 for fewer than two."""
    if x.numel() < 2:
        return 0.0
    return fixed_mean_std(x)[1] if mklmode.fixed_reductions() else float(x.std())


def sample_stats(rewards: torch.Tensor, truncated: torch.Tensor, lens: torch.Tensor,
                 entropy: torch.Tensor) -> dict[str, float]:
    """Reward mean/std, mean token entropy, mean completion length and the fraction of samples cut at their
    length limit."""
    return {"reward/mean": _mean(rewards), "reward/std": _std(rewards),
            "entropy": _mean(entropy), "completion/mean_len": _mean(lens.float()),
            "completion/truncated_frac": int(truncated.sum()) / len(truncated)}


def rollout_stats(rewards: torch.Tensor, groups: torch.Tensor, lens: torch.Tensor) -> dict[str, float]:
    """Reward min/max, the fraction of groups whose rewards are all equal (no GRPO signal: zero
    advantage), and completion length min/max."""
    num_groups = int(groups.max()) + 1 if groups.numel() else 0
    lo = torch.full((num_groups,), float("inf")).scatter_reduce(0, groups.cpu(), rewards.cpu(), "amin")
    hi = torch.full((num_groups,), float("-inf")).scatter_reduce(0, groups.cpu(), rewards.cpu(), "amax")
    return {"reward/min": float(rewards.min()), "reward/max": float(rewards.max()),
            "reward/zero_std_frac": _mean((lo == hi).float()) if num_groups else 0.0,
            "completion/min_len": int(lens.min()), "completion/max_len": int(lens.max())}


def token_stats(token_adv: torch.Tensor, mask: torch.Tensor, old_lp: torch.Tensor,
                ref_lp: "torch.Tensor | None") -> dict[str, float]:
    """Advantage mean/std over unmasked tokens; ``kl/ref``: mean k3 KL(policy || reference) of the
    sampled tokens under the policy that sampled them (present when a reference model is used)."""
    adv = token_adv.detach()[mask].float()
    out = {"advantage/mean": _mean(adv) if adv.numel() else 0.0, "advantage/std": _std(adv)}
    if ref_lp is not None:
        kl = kl_estimate(old_lp.detach(), ref_lp.detach(), "k3")[mask]
        out["kl/ref"] = _mean(kl) if kl.numel() else 0.0
    return out


def policy_step_kl(old_lp: torch.Tensor, new_lp: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean k3 estimate of KL(pi_before || pi_after) over the step's unmasked tokens, which pi_before
    sampled: how far one update moved the policy (verl's ``actor/ppo_kl`` measures it only inside the
    update passes, where it is 0 for the first one)."""
    kl = kl_estimate(old_lp.detach(), new_lp.detach(), "k3")[mask]   # samples are from pi_before
    return _mean(kl) if kl.numel() else 0.0


def sampled_logprob_stats(logprob: torch.Tensor, full_logprob: torch.Tensor, kept: torch.Tensor,
                          mask: torch.Tensor) -> dict[str, float]:
    """``rollout.logprobs=sampled``: the step's tokens under the policy before the update, over ``mask``: the mean
    log-prob of the kept set's distribution (what the objective uses) and of the full softmax, the mean ratio
    full / sampled probability (the kept set's probability mass: the importance ratio a full-softmax trainer
    would see for these samples at the start of the step), and the kept-set sizes."""
    m = mask.bool()
    lp, full, k = logprob[m].double(), full_logprob[m].double(), kept[m].double()
    if not lp.numel():
        return {}
    return {"logprob/sampled_mean": float(lp.mean()), "logprob/full_mean": float(full.mean()),
            "logprob/full_over_sampled_ratio_mean": float(torch.exp(full - lp).mean()),
            "kept/mean": float(k.mean()), "kept/min": float(k.min()), "kept/max": float(k.max())}


def peak_memory_mb(device: torch.device) -> float:
    """The peak memory of the step's device so far: CUDA's allocator peak, or the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def step_costs(t_rollout: float, t_train: float, n_tokens: int, device: torch.device, weights_version: int,
               engine_copy_bytes: int) -> dict:
    """The step's time, throughput and memory, and the engine's weights version."""
    return {"time/rollout_s": t_rollout, "time/train_s": t_train,
            "tokens_per_s/rollout": n_tokens / max(t_rollout, 1e-9),
            "memory/peak_mb": peak_memory_mb(device), "weights_version": weights_version,
            "memory/engine_weight_copy_mb": engine_copy_bytes / 2**20}   # 0: the engine shares the policy's


__all__ = ["sample_stats", "rollout_stats", "token_stats", "policy_step_kl", "peak_memory_mb", "step_costs"]

