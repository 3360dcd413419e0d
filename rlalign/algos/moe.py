"""Mixture-of-experts training terms: the routers' load-balancing loss and the expert-load statistics."""

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


__all__ = ["load_balancing_loss", "routing_terms"]
