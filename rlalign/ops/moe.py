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
order. Routing is then identical in any two engines that see the same hidden row: no routing replay. The native
profile may replay a recorded routing instead (:func:`moe_route_replay`: the gate weights of given experts).

Native (no promise): the same dispatch, then, outside autograd, three grouped GEMMs (``torch._grouped_mm``,
no host read: capturable in a decode graph) where torch takes the weights, else one linear per projection
per expert (:func:`expert_ffn_loop`, which reads the expert loads on the host).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from rlalign.contract.errors import fail
from rlalign.contract.profiles import Profile, as_profile
from rlalign.ops import _checks as chk
from rlalign.ops._dispatch import probe_failure, strict_impl
from rlalign.ops._registry import register
from rlalign.ops.basic import linear, silu_mul
from rlalign.ops.expert_ids import validate_expert_ids
from rlalign.ops.gated_delta import sigmoid
from rlalign.reductions import tree_sum


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  profile=None) -> torch.Tensor:
    """Router logits [T, E] in fp32: the strict linear on fp32 copies of x [T, H], weight [E, H] (and the
    router's bias [E], gpt-oss: added in fp32 by the linear).

    bf16 inputs are upcast exactly, so a bf16 model's logits are its fp32 logits (transformers rounds
    them to bf16 before the softmax; we do not: a rounding there would only add ties to the top-k)."""
    _refuse_portable("router_logits", profile)
    return linear(x.float(), weight.float(), None if bias is None else bias.float(), profile=profile)


def moe_route_topk_softmax(logits: torch.Tensor, top_k: int, *, profile=None):
    """gpt-oss's routing: the top-k of the fp32 router logits [T, E], then a softmax over the k chosen.

    Returns ``(experts [T, k] int64 in rank order, weights [T, k] fp32)``. Strict, per token: a stable
    descending sort of the logits (equal logits: the lower expert index first), the first k; m = the first
    (the largest, exact), u_j = exp(l_j - m), s = balanced tree sum of u in rank order, w_j = u_j / s.
    Differentiable (into the selected logits). Native: torch.topk and torch.softmax."""
    _refuse_portable("moe_route", profile)
    chk.ndim("moe_route", "logits", logits, 2)
    n_experts = logits.shape[1]
    if not 1 <= top_k <= n_experts:
        raise fail("moe_route", f"top_k={top_k} must be between 1 and the number of experts ({n_experts})")
    if as_profile(profile) is Profile.NATIVE:
        values, experts = torch.topk(logits, top_k, dim=-1)
        return experts, torch.softmax(values, dim=-1, dtype=torch.float32)
    if logits.dtype != torch.float32:
        raise fail("moe_route", f"router logits must be float32 (got {logits.dtype}): use ops.router_logits")
    chk.finite("moe_route", "logits", logits)
    experts = torch.sort(logits.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    chosen = logits.gather(1, experts)
    u = torch.exp(chosen - chosen[:, :1])
    return experts, u / tree_sum(u).unsqueeze(-1)


def _refuse_portable(op: str, profile) -> None:
    """Mixture-of-experts ops have no portable implementation: one line, never a fallback."""
    if as_profile(profile) is Profile.PORTABLE:
        raise fail(op, "mixture-of-experts layers are not implemented in the portable profile (docs/portable.md)")


def moe_route_grouped_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, *, n_group: int, topk_group: int,
                              normalize: bool, scaling: float, profile=None):
    """DeepSeek-V3's routing (transformers' ``DeepseekV3TopkRouter``) of the fp32 router logits [T, E].

    scores = sigmoid(logits); choice = scores + ``bias`` (``e_score_correction_bias`` [E], used for the choice
    only); the E experts split into ``n_group`` groups of E / n_group, a group's score = the sum of its two largest
    choice values; the ``topk_group`` best groups are kept, the top-k experts of their choice values chosen;
    weights = the chosen experts' unbiased scores, with ``normalize`` divided by (their sum + 1e-20), times
    ``scaling`` (routed_scaling_factor). Returns ``(experts [T, k] int64 in rank order, weights [T, k] fp32)``.

    Strict, per token (rlalign.contract.spec, row ``moe_route_grouped_sigmoid``): sigmoid as 1 / (1 + exp(-l))
    (torch's sigmoid is not position invariant on the CPU; exp is), the group's two largest by a stable
    descending sort added largest first, groups and experts chosen by stable descending sorts (equal values:
    the lower group / expert index first), the weights' sum added left to right in rank order. Differentiable into
    the logits through the chosen scores (the choice itself and the bias are not). Native: transformers' formula
    (torch.topk, sigmoid, sum)."""
    _refuse_portable("moe_route", profile)
    chk.ndim("moe_route", "logits", logits, 2)
    n_experts = logits.shape[1]
    if bias.shape != (n_experts,) or not bias.is_floating_point():
        raise fail("moe_route", f"bias must be a floating [E]=[{n_experts}] tensor, got {tuple(bias.shape)} "
                                f"{bias.dtype}")
    if n_group < 1 or n_experts % n_group or n_experts // n_group < 2 or not 1 <= topk_group <= n_group:
        raise fail("moe_route", f"{n_experts} experts do not split into n_group={n_group} groups of >= 2 with "
                                f"topk_group={topk_group} of them kept")
    size = n_experts // n_group
    if not 1 <= top_k <= topk_group * size:
        raise fail("moe_route", f"top_k={top_k} must be between 1 and the {topk_group * size} experts of the kept "
                                "groups")
    if as_profile(profile) is Profile.NATIVE:
        return _native_grouped_sigmoid(logits, bias, top_k, n_group, topk_group, normalize, scaling)
    if logits.dtype != torch.float32:
        raise fail("moe_route", f"router logits must be float32 (got {logits.dtype}): use ops.router_logits")
    chk.finite("moe_route", "logits", logits)
    scores = sigmoid(logits)
    choice = scores.detach() + bias.detach().float()
    tokens = choice.shape[0]
    top2 = torch.sort(choice.view(tokens, n_group, size), dim=-1, descending=True, stable=True).values
    group_scores = top2[..., 0] + top2[..., 1]
    kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    keep = torch.zeros((tokens, n_group), dtype=torch.bool, device=logits.device).scatter_(1, kept, True)
    masked = choice.masked_fill(~keep.repeat_interleave(size, dim=1), float("-inf"))
    experts = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, experts)
    if normalize:
        total = weights[:, 0]
        for j in range(1, top_k):
            total = total + weights[:, j]
        weights = weights / (total + 1e-20).unsqueeze(-1)
    return experts, weights * float(scaling)


def _native_grouped_sigmoid(logits, bias, top_k, n_group, topk_group, normalize, scaling):
    """transformers' DeepseekV3TopkRouter arithmetic on the fp32 logits (no invariance promise)."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    tokens, size = choice.shape[0], choice.shape[1] // n_group
    group_scores = choice.view(tokens, n_group, size).topk(2, dim=-1)[0].sum(dim=-1)
    kept = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, kept, 1).bool()
    masked = choice.masked_fill(~keep.repeat_interleave(size, dim=1), float("-inf"))
    experts = torch.topk(masked, k=top_k, dim=-1)[1]
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * float(scaling)


def shared_expert_gate(shared: torch.Tensor, gate_logits: torch.Tensor, *, profile=None) -> torch.Tensor:
    """A sparse layer's gated shared expert (Qwen3-Next's ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``):
    shared [T, H] (the shared expert's output, model dtype) times sigmoid(gate_logits [T, 1]) per row.

    Strict: fp32 from exact upcasts, sigmoid as 1 / (1 + exp(-l)) (rlalign.ops.gated_delta.sigmoid: torch's sigmoid
    is not position invariant on the CPU; exp is), one rounding of the product to shared's dtype; elementwise, so a
    row's bits depend on its own inputs only. transformers rounds sigmoid(l) to the model dtype before the product
    (in bf16: one more rounding; the same in fp32 up to it). Native: torch.sigmoid, the same product."""
    _refuse_portable("shared_expert_gate", profile)
    chk.ndim("shared_expert_gate", "shared", shared, 2)
    if gate_logits.shape != (shared.shape[0], 1):
        raise fail("shared_expert_gate", f"gate_logits must be [T, 1] = [{shared.shape[0]}, 1], got "
                                         f"{tuple(gate_logits.shape)}")
    g = gate_logits.float()
    scale = torch.sigmoid(g) if as_profile(profile) is Profile.NATIVE else sigmoid(g)
    return (shared.float() * scale).to(shared.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float, *, profile=None) -> torch.Tensor:
    """gpt-oss's expert activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit).

    Strict: elementwise in fp32 from exact upcasts, sigmoid written as g / (1 + exp(-(g * alpha))) (torch's
    sigmoid is not position invariant on the CPU, contract: what the CPU backend relies on), one rounding to
    the input dtype; differentiable (torch's elementwise autograd: clamp passes no gradient outside its range).
    Native: the same formula (elementwise: nothing to gain from a vendor kernel)."""
    _refuse_portable("clamped_swiglu", profile)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise fail("clamped_swiglu", f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                                     "must have one shape and dtype")
    g = gate.float().clamp(max=float(limit))
    u = up.float().clamp(min=-float(limit), max=float(limit))
    glu = g / (1.0 + torch.exp(-(g * float(alpha))))
    return ((u + 1.0) * glu).to(gate.dtype)


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
    return strict_impl("moe_route", logits.device, profile)(logits, top_k, normalize)


def moe_route_replay(logits: torch.Tensor, experts: torch.Tensor, *, normalize: bool, profile=None) -> torch.Tensor:
    """The gate weights [T, k] fp32 of GIVEN experts [T, k] (a recorded routing replayed: R3), from the current
    fp32 router logits [T, E]: the same formula as :func:`moe_route`'s native weights with the top-k choice
    replaced by ``experts``::

        p = softmax(logits)                 over all E experts, fp32
        w[t, j] = p[t, experts[t, j]]       (normalize: divided by sum_j w[t, j])

    Differentiable into the logits (the router keeps its gradient: through the chosen probabilities and, by the
    softmax, every logit). With ``experts`` = ``moe_route``'s own native choice the weights are its bits (the
    same softmax, gathered instead of taken by topk). Native only: in the strict profile the trainer's routing
    already equals the engine's bit for bit, so there is nothing to replay (one line, never a fallback)."""
    if as_profile(profile) is not Profile.NATIVE:
        raise fail("moe_route_replay", "routing replay runs in the native profile only: in the strict profile the "
                   "trainer's expert choices equal the rollout engine's bit for bit")
    chk.ndim("moe_route_replay", "logits", logits, 2)
    chk.ndim("moe_route_replay", "experts", experts, 2)
    if experts.shape[0] != logits.shape[0] or not 1 <= experts.shape[1] <= logits.shape[1]:
        raise fail("moe_route_replay", f"experts {tuple(experts.shape)} do not fit logits {tuple(logits.shape)} "
                   "(want [T, k], 1 <= k <= E)")
    experts = experts.to(device=logits.device, dtype=torch.int64)
    validate_expert_ids(experts.reshape(-1), logits.shape[1])
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def moe_experts(x: torch.Tensor, experts: torch.Tensor, gate_w: Sequence[torch.Tensor], up_w: Sequence[torch.Tensor],
                down_w: Sequence[torch.Tensor], *, down_segments: int | None = None, profile=None) -> torch.Tensor:
    """Each token's k experts applied to it: y [T, k, H] (x's dtype), y[t, j] = FFN_{experts[t, j]}(x[t]).

    x [T, H]; experts [T, k] int64; gate_w, up_w: E matrices [I, H]; down_w: E matrices [H, I], each either
    a stacked [E, ...] tensor (the model's layout; strided views such as a slice of Hugging Face's fused
    ``gate_up_proj`` included) or a list of per-expert weights. A stacked tensor is ONE autograd input with
    one gradient [E, ...] (zeros for an expert no row chose); a list gives one gradient per used expert.
    Only ``w[e]`` is read, never a copy of all experts. FFN_e(v) = down_e(silu(gate_e(v)) * up_e(v)), each
    projection the strict linear (down
    with the canonical K partition ``down_segments``, as the dense FFN's down_proj, so tensor-parallel
    shards of I agree). The (token, slot) rows are grouped by expert in stable order (slot order inside a
    group) and each group runs through the strict linear's arithmetic (torch backend: torch.sort, one call
    per projection per expert, :func:`sorted_experts`; triton: a dispatch kernel and one grouped GEMM per
    projection, no host sync, rlalign.ops.triton_backend.moe.experts): a row's result does not depend on the
    group's size or order. Backward: the grouping is a permutation (its gradient a permutation, no
    scatter-add) and the k copies of a token's gradient are summed by one reduction over a fixed [T, k, H] view.
    """
    chk.ndim("moe_experts", "x", x, 2)
    chk.ndim("moe_experts", "experts", experts, 2)
    _check_expert_shapes(x, gate_w, up_w, down_w)
    if experts.shape[0] != x.shape[0]:
        raise fail("moe_experts", f"experts has {experts.shape[0]} rows but x has {x.shape[0]}")
    if as_profile(profile) is Profile.NATIVE:
        return sorted_experts(x, experts, gate_w, up_w, down_w, down_segments, profile=profile)
    chk.finite("moe_experts", "x", x)
    return strict_impl("moe_experts", x.device, profile)(x, experts, gate_w, up_w, down_w, down_segments)


@register("moe_experts", "torch")
def sorted_experts(x: torch.Tensor, experts: torch.Tensor, gate_w, up_w, down_w, down_segments,
                   profile=None) -> torch.Tensor:
    """The reference dispatch of :func:`moe_experts` (the torch backend; the native profile on every device):
    ids validated, the slots grouped by ``torch.sort(stable=True)``, x's rows gathered through a [T*k, H]
    copy, the backend's ``moe_expert_ffn``, one gather back to slot order. The triton backend does the same
    bookkeeping in a dispatch kernel (rlalign.ops.triton_backend.dispatch) and gives the same bits."""
    tokens, k = experts.shape
    hidden = x.shape[1]
    flat = experts.reshape(-1)
    if flat.numel():
        validate_expert_ids(flat, len(gate_w))
    order = torch.sort(flat, stable=True).indices       # slots grouped by expert, slot order inside a group
    rows = x.unsqueeze(1).expand(tokens, k, hidden).reshape(tokens * k, hidden).index_select(0, order)
    expert_of_row = flat.index_select(0, order)
    if as_profile(profile) is Profile.NATIVE:
        grouped = _native_expert_ffn(rows, expert_of_row, gate_w, up_w, down_w, down_segments, profile)
    else:
        grouped = strict_impl("moe_expert_ffn", x.device)(rows, expert_of_row, gate_w, up_w, down_w, down_segments)
    # back to slot order: position order[i] receives grouped row i (a permutation)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return grouped.index_select(0, inverse).view(tokens, k, hidden)


def _native_expert_ffn(rows, expert_of_row, gate_w, up_w, down_w, down_segments, profile) -> torch.Tensor:
    """Native: three grouped GEMMs (``torch._grouped_mm``, the group offsets found on the device: no host
    read, so a decode step holding them can be captured in a CUDA graph) where :func:`native_grouped_unavailable`
    allows, else the per-expert loop (one host read of the expert loads)."""
    if not rows.shape[0] or native_grouped_unavailable(rows, gate_w, up_w, down_w) is not None:
        return expert_ffn_loop(rows, expert_of_row, gate_w, up_w, down_w, down_segments, profile=profile)
    # rows are sorted by expert: group e ends at the number of rows whose expert is <= e
    ids = torch.arange(gate_w.shape[0], device=rows.device, dtype=expert_of_row.dtype)
    offs = torch.searchsorted(expert_of_row, ids, right=True).to(torch.int32)
    gate = torch._grouped_mm(rows, gate_w.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(rows, up_w.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(silu_mul(gate, up, profile=profile), down_w.transpose(-2, -1), offs=offs)


def native_grouped_unavailable(rows: torch.Tensor, gate_w, up_w, down_w) -> str | None:
    """Why the native experts cannot run as grouped GEMMs here (None: they can): they need stacked [E, N, K]
    weights of the rows' dtype, no autograd (training keeps the loop and its stacked gradients), and a torch
    whose ``_grouped_mm`` takes these tensors on this device (probed once per configuration: on CUDA it wants
    bfloat16 on sm90+ and 16-byte aligned strides)."""
    weights = (gate_w, up_w, down_w)
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
        return "per-expert weight lists (grouped GEMMs take stacked [E, N, K] tensors)"
    if any(w.dtype != rows.dtype for w in weights):
        return f"weights {gate_w.dtype} differ from the rows' {rows.dtype}"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (rows, *weights)):
        return "autograd (the per-expert loop keeps one stacked gradient per projection)"
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no _grouped_mm"
    return _grouped_probe(rows.device, rows.dtype, tuple((tuple(w.shape), w.stride()) for w in weights))


@functools.lru_cache(maxsize=None)
def _grouped_probe(device: torch.device, dtype: torch.dtype, layout: tuple) -> str | None:
    """One small call per (device, dtype, weight shapes and strides) on random weights of that layout, odd
    group sizes and an empty group (when E > 2), checked against per-group matmuls: a torch that refuses these
    tensors, or computes them wrong, is found here, not mid-run (never inside a capture: the engine's warm-up
    and its own check run first)."""
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        gate, _, down = (torch.empty_strided(shape, stride, device=device, dtype=dtype).copy_(
            torch.randn(shape, generator=gen, device=device)) for shape, stride in layout)
        n_experts, sizes = gate.shape[0], [1, 0, 3]
        sizes = (sizes + [2] * n_experts)[:n_experts] if n_experts > 2 else [1, 4][-n_experts:]
        ends = torch.tensor(sizes, device=device).cumsum(0)
        rows = torch.randn(int(ends[-1]), gate.shape[2], generator=gen, device=device).to(dtype)
        offs = ends.to(torch.int32)
        got = torch._grouped_mm(torch._grouped_mm(rows, gate.transpose(-2, -1), offs=offs), down.transpose(-2, -1),
                                offs=offs)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return probe_failure("_grouped_mm failed a probe call", exc)
    start, want = 0, []
    for e, n in enumerate(sizes):
        x = rows[start:start + n].double()
        want.append((x @ gate[e].double().T).to(dtype).double() @ down[e].double().T)
        start += n
    want = torch.cat(want)
    err = float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30)) if want.numel() else 0.0
    if not err < 5e-2:   # bf16 rounding of the intermediate and the output: ~1e-2 at most
        return f"_grouped_mm computed a probe call wrong (relative error {err:.3g})"
    return _capture_probe(rows, gate, offs) if device.type == "cuda" else None


def _capture_probe(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> str | None:
    """Whether a CUDA graph can hold the grouped GEMM (the reason the native experts use it)."""
    try:
        torch.cuda.synchronize(rows.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offs)
        graph.replay()
        torch.cuda.synchronize(rows.device)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return probe_failure("_grouped_mm cannot be captured in a CUDA graph", exc)
    return None


@register("moe_expert_ffn", "torch")
def expert_ffn_loop(rows: torch.Tensor, expert_of_row: torch.Tensor, gate_w, up_w, down_w, down_segments,
                    profile=None) -> torch.Tensor:
    """The experts' FFNs of rows sorted by expert (``expert_of_row`` non-decreasing): one strict linear per
    projection per expert that has rows (the torch backend; the triton backend runs the same arithmetic
    as grouped GEMMs, one launch per projection: rlalign.ops.triton_backend.moe). Reads the expert counts
    on the host (one sync). Stacked [E, ...] weights that need a gradient enter autograd as one input each
    (:class:`_StackedExpertLoop`); per-expert lists as E inputs each."""
    counts = torch.bincount(expert_of_row, minlength=len(gate_w)).tolist()
    weights = (gate_w, up_w, down_w)
    if (all(isinstance(w, torch.Tensor) for w in weights) and torch.is_grad_enabled() and rows.shape[0]
            and any(t.requires_grad for t in (rows, *weights))):
        return _StackedExpertLoop.apply(rows, gate_w, up_w, down_w, counts, down_segments, profile)
    return _loop(rows, counts, lambda proj, e: weights[proj][e], down_segments, profile)


def _loop(rows, counts, weight_of, down_segments, profile) -> torch.Tensor:
    """down_e(silu(gate_e(r)) * up_e(r)) of each expert's rows; ``weight_of(p, e)``: projection p's
    (0 gate, 1 up, 2 down) weight of expert e."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe = rows[start:start + n]
        act = silu_mul(linear(xe, weight_of(0, e), profile=profile), linear(xe, weight_of(1, e), profile=profile),
                       profile=profile)
        outs.append(linear(act, weight_of(2, e), k_segments=down_segments, profile=profile))
        start += n
    return torch.cat(outs) if outs else rows.new_zeros((0, rows.shape[1]))


class _StackedExpertLoop(torch.autograd.Function):
    """:func:`_loop` over stacked weights [E, N, K] as ONE autograd node, with ONE gradient per stacked tensor
    (not E views' gradients each summed into a full-size zero tensor). Forward runs the loop in a graph of
    its own, on leaves: the rows and each used expert's weight view ``w[e]``; backward differentiates that
    graph, so every gradient is the per-expert loop's, bit for bit, and the stacked dW holds dW_e at [e] and
    zeros for an expert without rows (as the grouped GEMM's dW)."""

    @staticmethod
    def forward(ctx, rows, gate_w, up_w, down_w, counts, down_segments, profile):
        stacked = (gate_w, up_w, down_w)
        views: dict[tuple[int, int], torch.Tensor] = {}

        def weight_of(proj: int, e: int) -> torch.Tensor:
            w = stacked[proj].detach()[e]
            if ctx.needs_input_grad[1 + proj]:
                w.requires_grad_(True)
                views[(proj, e)] = w
            return w

        with torch.enable_grad():
            leaf_rows = rows.detach().requires_grad_(ctx.needs_input_grad[0])
            out = _loop(leaf_rows, counts, weight_of, down_segments, profile)
        ctx.graph = (out, leaf_rows, views)
        ctx.shapes = [(w.shape, w.dtype, w.device) for w in stacked]
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        if ctx.graph is None:
            raise RuntimeError("moe_experts: the experts' backward ran twice (retain_graph is not supported)")
        (out, leaf_rows, views), ctx.graph = ctx.graph, None
        inputs = ([leaf_rows] if leaf_rows.requires_grad else []) + list(views.values())
        found = torch.autograd.grad(out, inputs, grad, allow_unused=True)   # frees the inner graph
        grad_rows = found[0] if leaf_rows.requires_grad else None
        grad_w: list[torch.Tensor | None] = [None, None, None]
        for proj, (shape, dtype, device) in enumerate(ctx.shapes):
            if ctx.needs_input_grad[1 + proj]:
                grad_w[proj] = torch.zeros(shape, dtype=dtype, device=device)
        for ((proj, e), _), g in zip(views.items(), found[len(inputs) - len(views):]):
            if g is not None:
                grad_w[proj][e] = g
        return (grad_rows, *grad_w, None, None, None)


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
    want = ((inter, hidden), (inter, hidden), (hidden, inter))
    stacked = [isinstance(w, torch.Tensor) for w in (gate_w, up_w, down_w)]
    if any(stacked) and not all(stacked):
        raise fail("moe_experts", "gate, up and down expert weights must all be stacked [E, ...] tensors or all "
                   "be lists of per-expert matrices")
    if all(stacked):
        shapes = (tuple(gate_w.shape[1:]), tuple(up_w.shape[1:]), tuple(down_w.shape[1:]))
        if gate_w.dim() != 3 or up_w.dim() != 3 or down_w.dim() != 3 or shapes != want:
            raise fail("moe_experts", f"stacked expert weights gate {tuple(gate_w.shape)}, up {tuple(up_w.shape)}, "
                       f"down {tuple(down_w.shape)} do not fit x {tuple(x.shape)} (want [E, I, H], [E, I, H], "
                       f"[E, H, I] with H={hidden}, I={inter})")
        return
    for e in range(n_experts):
        shapes = (tuple(gate_w[e].shape), tuple(up_w[e].shape), tuple(down_w[e].shape))
        if shapes != want:
            raise fail("moe_experts", f"expert {e}: gate {shapes[0]}, up {shapes[1]}, down {shapes[2]} do not fit "
                       f"x {tuple(x.shape)} (want [I, H], [I, H], [H, I] with H={hidden}, I={inter})")
