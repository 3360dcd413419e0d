"""Mixture-of-experts ops: top-k routing, the experts' SwiGLU FFNs, and the combine.

A sparse MoE FFN (Qwen3-MoE) computes, for each token t with hidden row x_t::

    logits_t = x_t @ W_router^T                      (fp32, the strict linear on fp32 copies)
    experts_t, weights_t = moe_route(logits_t, k)    (softmax, top-k, optional renormalisation)
    y_{t,j}  = down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = experts_t[j]   (strict linear, silu_mul)
    out_t    = moe_combine(y_t, weights_t, experts_t)                        (fixed order, fp32)

Why this is bitwise by construction: every piece is a per-token function. The router and the combine
are row-wise elementwise/tree arithmetic; the expert FFN runs each expert's rows through the strict
linear, whose per-row result does not depend on how many rows share the call or where they sit, so
a token's expert output is the same whether 1 or 10,000 tokens chose that expert, and in whatever
order. Routing is then identical in any two engines that see the same hidden row: no routing replay.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlalign.contract.errors import fail
from rlalign.contract.profiles import Profile, as_profile
from rlalign.ops import _checks as chk
from rlalign.ops._dispatch import strict_impl
from rlalign.ops._registry import register
from rlalign.ops.basic import linear, silu_mul


def router_logits(x: torch.Tensor, weight: torch.Tensor, *, profile=None) -> torch.Tensor:
    """Router logits [T, E] in fp32: the strict linear on fp32 copies of x [T, H] and weight [E, H].

    bf16 inputs are upcast exactly, so a bf16 model's logits are its fp32 logits (transformers rounds
    them to bf16 before the softmax; we do not: a rounding there would only add ties to the top-k)."""
    return linear(x.float(), weight.float(), profile=profile)


def moe_route(logits: torch.Tensor, top_k: int, *, normalize: bool, profile=None):
    """Top-k routing of each token from its fp32 router logits [T, E].

    Returns ``(experts, weights)``: experts [T, k] int64 in rank order (largest probability first),
    weights [T, k] fp32. Strict contract, per token (rlalign.contract.spec, row ``moe_route``):
    p = softmax(logits) with m = max_e l_e (exact), u_e = exp(l_e - m), s = balanced tree sum of u
    over the experts in index order, p_e = u_e / s; the k largest p, equal p broken by the lower expert
    index; with ``normalize`` the weights are p_sel / (p_sel[0] + p_sel[1] + ... added left to right in
    rank order), else p_sel. Differentiable (the gradient flows into the logits through the selected
    probabilities and their normaliser).
    """
    chk.ndim("moe_route", "logits", logits, 2)
    n_experts = logits.shape[1]
    if not 1 <= top_k <= n_experts:
        raise fail("moe_route", f"top_k={top_k} must be between 1 and the number of experts ({n_experts})")
    if as_profile(profile) is Profile.NATIVE:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, top_k, dim=-1)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights
    if logits.dtype != torch.float32:
        raise fail("moe_route", f"router logits must be float32 (got {logits.dtype}): use ops.router_logits")
    chk.finite("moe_route", "logits", logits)
    return strict_impl("moe_route", logits.device)(logits, top_k, normalize)


def moe_experts(x: torch.Tensor, experts: torch.Tensor, gate_w: Sequence[torch.Tensor], up_w: Sequence[torch.Tensor],
                down_w: Sequence[torch.Tensor], *, down_segments: int | None = None, profile=None) -> torch.Tensor:
    """Each token's k experts applied to it: y [T, k, H] (x's dtype), y[t, j] = FFN_{experts[t, j]}(x[t]).

    x [T, H]; experts [T, k] int64; gate_w, up_w: E matrices [I, H]; down_w: E matrices [H, I] (a stacked
    [E, ...] tensor or a list of per-expert weights: only ``w[e]`` is used, never a copy of all experts). FFN_e(v) = down_e(silu(gate_e(v)) * up_e(v)), each projection the strict linear (down
    with the canonical K partition ``down_segments``, as the dense FFN's down_proj, so tensor-parallel
    shards of I agree). The (token, slot) rows are grouped by expert with a stable sort and the backend's
    ``moe_expert_ffn`` runs each group through the strict linear's arithmetic (torch: one call per
    projection per expert; triton: one grouped GEMM per projection, no host sync): a row's result does not
    depend on the group's size or order. Backward: the grouping is a permutation (its gradient a permutation, no scatter-add)
    and the k copies of a token's gradient are summed by one reduction over a fixed [T, k, H] view.
    """
    chk.ndim("moe_experts", "x", x, 2)
    chk.ndim("moe_experts", "experts", experts, 2)
    n_experts = len(gate_w)
    _check_expert_shapes(x, gate_w, up_w, down_w)
    hidden = x.shape[1]
    if experts.shape[0] != x.shape[0]:
        raise fail("moe_experts", f"experts has {experts.shape[0]} rows but x has {x.shape[0]}")
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    if flat.numel():
        _validate_expert_ids(flat, n_experts)
    order = torch.sort(flat, stable=True).indices       # slots grouped by expert, slot order inside a group
    rows = x.unsqueeze(1).expand(tokens, k, hidden).reshape(tokens * k, hidden).index_select(0, order)
    expert_of_row = flat.index_select(0, order)
    if as_profile(profile) is Profile.NATIVE:
        grouped = expert_ffn_loop(rows, expert_of_row, gate_w, up_w, down_w, down_segments, profile=profile)
    else:
        chk.finite("moe_experts", "x", x)
        grouped = strict_impl("moe_expert_ffn", x.device)(rows, expert_of_row, gate_w, up_w, down_w, down_segments)
    # back to slot order: position order[i] receives grouped row i (a permutation)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return grouped.index_select(0, inverse).view(tokens, k, hidden)


@register("moe_expert_ffn", "torch")
def expert_ffn_loop(rows: torch.Tensor, expert_of_row: torch.Tensor, gate_w, up_w, down_w, down_segments,
                    profile=None) -> torch.Tensor:
    """The experts' FFNs of rows sorted by expert (``expert_of_row`` non-decreasing): one strict linear per
    projection per expert that has rows (the torch backend; the triton backend runs the same arithmetic
    as grouped GEMMs, one launch per projection: rlalign.ops.triton_backend.moe). Reads the expert counts
    on the host (one sync)."""
    counts = torch.bincount(expert_of_row, minlength=len(gate_w)).tolist()
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe = rows[start:start + n]
        act = silu_mul(linear(xe, gate_w[e], profile=profile), linear(xe, up_w[e], profile=profile), profile=profile)
        outs.append(linear(act, down_w[e], k_segments=down_segments, profile=profile))
        start += n
    return torch.cat(outs) if outs else rows.new_zeros((0, rows.shape[1]))


def moe_combine(y: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * y[t, j], in fp32, the k terms added in increasing expert index.

    y [T, k, H] (model dtype), weights [T, k] fp32, experts [T, k]. Each term is fp32(y) * fp32(w)
    (one rounding), the running sum starts at the first term and adds the next left to right (no fused
    multiply-add), one rounding of the sum to y's dtype. The same in every profile."""
    if y.dim() != 3 or weights.shape != y.shape[:2] or experts.shape != y.shape[:2]:
        raise fail("moe_combine", f"y {tuple(y.shape)}, weights {tuple(weights.shape)} and experts "
                   f"{tuple(experts.shape)} must be [T, k, H], [T, k], [T, k]")
    if y.shape[1] == 0:
        raise fail("moe_combine", "k = 0 expert outputs per token: nothing to combine")
    return strict_impl("moe_combine", y.device)(y, weights, experts)


def _check_expert_shapes(x, gate_w, up_w, down_w) -> None:
    n_experts, hidden = len(gate_w), x.shape[1]
    if n_experts == 0 or len(up_w) != n_experts or len(down_w) != n_experts:
        raise fail("moe_experts", f"{n_experts} gate, {len(up_w)} up and {len(down_w)} down expert weights: "
                   "need the same number (>= 1) of each")
    inter = gate_w[0].shape[0]
    for e in range(n_experts):
        shapes = (tuple(gate_w[e].shape), tuple(up_w[e].shape), tuple(down_w[e].shape))
        if shapes != ((inter, hidden), (inter, hidden), (hidden, inter)):
            raise fail("moe_experts", f"expert {e}: gate {shapes[0]}, up {shapes[1]}, down {shapes[2]} do not fit "
                       f"x {tuple(x.shape)} (want [I, H], [I, H], [H, I] with H={hidden}, I={inter})")


def _validate_expert_ids(flat: torch.Tensor, n_experts: int) -> None:
    """Expert ids in [0, E). On the CPU at once. On a GPU the verdict stays on the device and the next
    sync point raises (as the deferred finiteness checks: a host read per MoE layer would stall the
    launch queue); meanwhile an out-of-range id is harmless -- its rows fall outside every expert's row
    range and are never computed. Skipped inside a CUDA graph capture (the caller validated the batch)."""
    if flat.device.type == "cpu":
        chk.memo("moe_expert_ids", lambda: _check_expert_ids(flat, n_experts), flat, extra=(n_experts,))
    elif not chk.is_capturing():
        ok = ((flat >= 0) & (flat < n_experts)).all()
        chk.requeue([("moe_experts", f"an expert id is outside [0, {n_experts})", ok)])


def _check_expert_ids(flat: torch.Tensor, n_experts: int) -> bool:
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= n_experts:
        raise fail("moe_experts", f"expert id {lo if lo < 0 else hi} is outside [0, {n_experts})")
    return True

