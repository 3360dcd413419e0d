"""Strict top-k routing (torch backend; also serves CUDA, see triton_backend/__init__.py).

Per token, from fp32 router logits l [E] (the exact arithmetic of spec row ``moe_route``):

    m   = max_e l_e                               exact
    u_e = exp(l_e - m)                            the backend's exp, elementwise (position invariant)
    s   = tree_sum(u)                             balanced pairwise tree over the experts in index order
    p_e = u_e / s                                 IEEE division
    top-k of p: descending, equal p -> lower expert index first (a stable sort of -p)
    normalize: d = p_sel[0] + p_sel[1] + ... left to right (rank order); w_j = p_sel[j] / d

Every step is elementwise or a reduction whose order is written here, so a token's experts and
weights depend only on its own logits.
"""

from __future__ import annotations

import torch

from rlalign.ops._registry import register
from rlalign.reductions import tree_sum


def route(logits: torch.Tensor, top_k: int, normalize: bool):
    m = logits.amax(dim=-1, keepdim=True)
    u = torch.exp(logits - m)
    probs = u / tree_sum(u).unsqueeze(-1)
    # stable descending sort: equal probabilities keep index order, i.e. the lower expert wins
    experts = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, experts)
    if normalize:
        denom = weights[:, 0]
        for j in range(1, top_k):
            denom = denom + weights[:, j]
        weights = weights / denom.unsqueeze(-1)
    return experts, weights


register("moe_route", "torch")(route)


def combine(y: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Spec row ``moe_combine``: the k slots in expert order (a stable sort of the ids), acc = fp32(y) * w for
    the first, then acc = acc + fp32(y) * w left to right (separate multiply and add kernels: no fma), one
    rounding to y's dtype."""
    by_expert = torch.argsort(experts, dim=1, stable=True)
    y_sorted = y.gather(1, by_expert.unsqueeze(-1).expand_as(y)).float()
    w_sorted = weights.float().gather(1, by_expert).unsqueeze(-1)
    acc = y_sorted[:, 0] * w_sorted[:, 0]
    for j in range(1, y.shape[1]):
        acc = acc + y_sorted[:, j] * w_sorted[:, j]
    return acc.to(y.dtype)


register("moe_combine", "torch")(combine)
