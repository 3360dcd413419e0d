"""Mixture-of-experts training terms: the routers' load-balancing loss, the expert-load statistics and the
routing agreement between the rollout engine and the trainer."""

from __future__ import annotations

import math

import torch


def load_balancing_loss(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE / Switch auxiliary loss for one layer's router: E * sum_e f_e * P_e, where f_e is the
    fraction of (token, slot) assignments that went to expert e and P_e the mean router probability
    of e over the tokens. Zero-size input gives 0. Gradient flows through P only (f is a count)."""
    tokens, n_experts = logits.shape
    if tokens == 0:
        return logits.new_zeros(())
    probs = torch.softmax(logits.float(), dim=-1)
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype)
    frac = counts / experts.numel()
    return n_experts * (frac * probs.mean(dim=0)).sum()


def routing_terms(record) -> tuple[torch.Tensor, float]:
    """From one forward's MoE routing (``rlalign.models.moe.record_routing``): the load-balancing loss (mean over
    the sparse layers; differentiable through the router logits) and the expert-load entropy (entropy of each
    layer's histogram of (token, slot) assignments over the experts divided by log E, so 1.0 = perfectly even,
    0 = one expert; mean over layers)."""
    aux, entropies = [], []
    for forwards in record.layers.values():
        for logits, experts in forwards:
            aux.append(load_balancing_loss(logits, experts))
            n = logits.shape[1]
            counts = torch.bincount(experts.reshape(-1), minlength=n).double()
            p = counts / counts.sum().clamp(min=1)
            h = -(p[p > 0] * p[p > 0].log()).sum()
            entropies.append(float(h / math.log(n)) if n > 1 else 1.0)
    if not aux:
        return torch.zeros(()), 1.0
    return torch.stack(aux).mean(), sum(entropies) / len(entropies)


def routing_mismatch(trainer_ids: torch.Tensor, rollout_ids: torch.Tensor) -> dict:
    """Routing agreement of two records of the same rows: expert ids [rows, sparse layers, k] each (any integer
    dtype, same shape). A (row, layer) pair differs when its top-k expert SETS differ (each pair's k ids are
    sorted before comparing: the order within the top-k is not part of the routing). A rollout id of -1 (a
    row the engine never recorded) differs from every expert, so a gap in the record counts as a mismatch.

    Returns ``{"tokens": rows * layers compared, "count": pairs that differ, "first": (row, layer) of the
    first differing pair in row-major order, or None}``."""
    if trainer_ids.shape != rollout_ids.shape:
        raise ValueError(f"routing_mismatch: trainer ids {tuple(trainer_ids.shape)} vs rollout ids "
                         f"{tuple(rollout_ids.shape)}")
    ours = torch.sort(trainer_ids.to(torch.int32), dim=-1).values
    theirs = torch.sort(rollout_ids.to(device=trainer_ids.device, dtype=torch.int32), dim=-1).values
    differ = (ours != theirs).any(dim=-1)
    count = int(differ.sum())
    first = tuple(int(i) for i in differ.nonzero()[0]) if count else None
    return {"tokens": differ.numel(), "count": count, "first": first}


__all__ = ["load_balancing_loss", "routing_terms", "routing_mismatch"]
