"""DeepSeek-V3's layers on rlalign's ops: multi-head latent attention (``attention_kind="mla"``) and its
mixture of experts (``ffn_kind="deepseek_moe"``), as transformers' ``DeepseekV3ForCausalLM`` computes them.

Attention, per token x [hidden] (H heads; dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim,
D = dn + dr)::

    q          = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))          [H, D] = [q_nope | q_rot]
    c, k_rot   = split(kv_a_proj_with_mqa(x), [kv_lora_rank, dr])             k_rot: one head, shared by all
    k_nope, v  = split(kv_b_proj(kv_a_layernorm(c)), [dn, dv])  per head
    q_rot, k_rot = rope(q_rot), rope(k_rot)       rope_interleave: pairs (x0, x1), (x2, x3), ... -- the columns are
                                                  first reordered evens-then-odds (a permutation: exact), which is
                                                  transformers' output layout, then rotate-half rope
    a          = attend([q_nope | q_rot], [k_nope | k_rot], [v | 0]) , scale = D ** -0.5 (times YaRN's
                 mscale(factor, mscale_all_dim) ** 2 with yarn rope)        [H, D]; the first dv columns kept
    out        = o_proj(a[:, :dv])

V is padded with D - dv zero columns so that K and V share the head width the strict attention ops take (exact: a
zero column's output is a sum of exact zeros; the other columns' bits do not change with the width in rollout vs
trainer, which see the same width). The expansion (kv_b_proj, the K and padded V) is one function,
:func:`expand_kv`, that every path runs.

The paged KV cache holds per token and layer the compressed latent ``[latent | k_rot]`` (kv_lora_rank + dr values;
rlalign.models.latent_cache, the default) or, with ``mla_cache="expanded"``, the expanded K and padded V (2 x H x D).
With the latent cache each paged call re-expands its sequences' earlier tokens from their cached rows with
:func:`expand_kv` -- "one form for both, compressed storage": the attention sees the expanded form's keys and values
bit for bit, so packed training, chunked prefill and paged decode agree as with the expanded cache, at the cost of
kv_b_proj over the whole earlier context at every call.

Not the absorbed form (W_UK folded into the query, scores and outputs computed in the latent space): it reorders
the arithmetic -- q_nope . (W_UK c) rounded per head as K, versus (q_nope W_UK) . c, a different reduction over
different rounded intermediates -- so its bits are not the expanded form's and prefill (expanded) would not equal
decode (absorbed). It would have to be the one form of every path, the trainer's included, to keep the contract.

MoE (layers >= first_k_dense_replace; the others are the dense MLP of intermediate_size)::

    logits     = router_logits(x, gate.weight)                                  fp32 [T, E]
    experts, w = moe_route_grouped_sigmoid(logits, gate.e_score_correction_bias, k, n_group, topk_group, ...)
    out        = moe_combine(experts_ffn(x), w, experts) + shared_experts(x)     (one rounding of the sum)

``gate.e_score_correction_bias`` (transformers' fp32 buffer) is held as a frozen fp32 parameter (requires_grad
False, read detached, kept fp32 when the model is cast): the checkpoint, the engine's weight sync and the hashes
carry it like any weight, the optimizer never sees it. The routed experts are the Qwen3-MoE stacked experts
(checkpoint names ``mlp.experts.{e}.{gate,up,down}_proj.weight``, what transformers saves).

On CUDA the same ops run on the Triton backend (the strict attention takes K heads of 192 and V heads of 128);
with the latent cache the engine decodes eagerly (the scratch pages are planned on the host per call).

Not here: tensor parallelism (no ``tp_plan``: refused by the distributed layer's plan check), multi-token-prediction layers (their weights are ignored on load).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rlalign import ops
from rlalign.contract import spec
from rlalign.models.attention_kinds import register_attention
from rlalign.models.blocks import PagedAttend
from rlalign.models.config import ModelConfig
from rlalign.models.ffn import MLP, register_ffn
from rlalign.models.latent_cache import context_plan, scratch_rows, write_latent
from rlalign.models.modules import Linear, RMSNorm
from rlalign.models.moe import StackedExperts, add_shared_expert, current_routing_record, shared_expert_mlp
from rlalign.models.taps import layer_tap, tap

# q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: ModelConfig) -> float:
    """D ** -0.5, times mscale(factor, mscale_all_dim) ** 2 with a yarn rope that sets mscale_all_dim
    (transformers' ``yarn_apply_mscale``)."""
    a = cfg.attention_options
    scale = (a["qk_nope_head_dim"] + a["qk_rope_head_dim"]) ** -0.5
    rope = cfg.rope_scaling or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
        scale = scale * m * m
    return scale


@register_attention("mla")
class MLAttention(nn.Module):
    """Multi-head latent attention (module docstring), weights under transformers' names."""

    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, device):
        super().__init__()
        a, h = cfg.attention_options, cfg.hidden_size
        self.layer_index, self.num_heads = layer_index, cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]
        self.latent, self.interleave = a["kv_lora_rank"], bool(a["rope_interleave"])
        qk, bias = self.nope + self.rope_dim, bool(a["attention_bias"])
        if a["q_lora_rank"] is None:
            self.q_proj = Linear(h, cfg.num_heads * qk, False, dtype, device)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(h, a["q_lora_rank"], bias, dtype, device)
            self.q_a_layernorm = RMSNorm(a["q_lora_rank"], LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = Linear(a["q_lora_rank"], cfg.num_heads * qk, False, dtype, device)
        self.kv_a_proj_with_mqa = Linear(h, self.latent + self.rope_dim, bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS, dtype, device)
        self.kv_b_proj = Linear(self.latent, cfg.num_heads * (self.nope + self.v_dim), False, dtype, device)
        self.o_proj = Linear(cfg.num_heads * self.v_dim, h, bias, dtype, device, k_segments=spec.K_SEGMENTS)
        self.scale = softmax_scale(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        return mla_block(self, x, cos, sin, attend)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """rope of x [T, heads, dr]; interleaved pairs are first reordered evens-then-odds (exact)."""
        if self.interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return ops.rope(x.contiguous(), cos, sin)


def mla_block(attn: MLAttention, x: torch.Tensor, cos, sin, attend) -> torch.Tensor:
    """o_proj(attention) of rows ``x`` [T, hidden] (module docstring); taps q, k, v (v unpadded), attn."""
    t, heads, layer = x.shape[0], attn.num_heads, attn.layer_index
    q = attn.q_proj(x) if attn.q_proj is not None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(t, heads, attn.nope + attn.rope_dim)
    compressed = attn.kv_a_proj_with_mqa(x)
    latent = attn.kv_a_layernorm(compressed[:, :attn.latent].contiguous())
    k_rot = attn.rotate(compressed[:, attn.latent:].reshape(t, 1, attn.rope_dim), cos, sin)
    q = torch.cat([q[..., :attn.nope], attn.rotate(q[..., attn.nope:], cos, sin)], dim=-1)
    k, v = expand_kv(attn, latent, k_rot)
    tap(layer_tap(layer, "q"), q), tap(layer_tap(layer, "k"), k), tap(layer_tap(layer, "v"), v[..., :attn.v_dim])
    if isinstance(attend, PagedAttend) and layer in attend.batch.kv_cache.latent:
        out = latent_paged_attention(attn, q, k, v, torch.cat([latent, k_rot.view(t, attn.rope_dim)], dim=1),
                                     attend.batch)
    else:
        if isinstance(attend, PagedAttend):   # the expanded cache: this call's K and padded V
            b = attend.batch
            ops.write_kv_cache(k, v, b.kv_cache.k[layer], b.kv_cache.v[layer], b.slot_mapping)
        out = attend(q, k, v, layer, attn.scale)
    out = tap(layer_tap(layer, "attn"), out[..., :attn.v_dim].reshape(t, heads * attn.v_dim))
    return tap(layer_tap(layer, "o_proj"), attn.o_proj(out))


def expand_kv(attn: MLAttention, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K [N, H, D], V zero-padded to D [N, H, D]) of N tokens from their normed latent [N, kv_lora_rank] and
    roped shared rotary key [N, 1, dr]: the one expansion every path runs (packed, and the paged call's new and
    re-expanded tokens alike). kv_b_proj is the strict linear: a token's row has the same bits whatever the rows
    beside it."""
    n, heads, qk = latent.shape[0], attn.num_heads, attn.nope + attn.rope_dim
    kv = attn.kv_b_proj(latent).view(n, heads, attn.nope + attn.v_dim)
    k = torch.cat([kv[..., :attn.nope], k_rot.expand(n, heads, attn.rope_dim)], dim=-1)
    v = torch.nn.functional.pad(kv[..., attn.nope:], (0, qk - attn.v_dim))   # zero columns up to K's width (exact)
    return k, v


def latent_paged_attention(attn: MLAttention, q, k, v, rows: torch.Tensor, batch) -> torch.Tensor:
    """Paged attention with the latent cache (rlalign.models.latent_cache): the earlier tokens' rows are read back
    onto scratch pages and re-expanded there (:func:`expand_kv`), the new tokens' ``k``, ``v`` written beside them,
    their latent ``rows`` [T, kv_lora_rank + dr] cached; the attention reads the scratch pages."""
    cache = batch.kv_cache.latent[attn.layer_index]
    plan = context_plan(batch)
    earlier = scratch_rows(cache, plan)
    k_pages, v_pages = expand_kv(attn, earlier[:, :attn.latent], earlier[:, attn.latent:].view(-1, 1, attn.rope_dim))
    shape = (plan.num_pages, batch.kv_cache.page_size, attn.num_heads, attn.nope + attn.rope_dim)
    k_pages, v_pages = k_pages.view(shape), v_pages.view(shape)
    ops.write_kv_cache(k, v, k_pages, v_pages, plan.new_local)   # its key check first: a refused row is not cached
    write_latent(cache, rows, batch.slot_mapping)
    return ops.attention_paged(q, k_pages, v_pages, plan.block_table, batch.seq_lens, batch.cu_seqlens,
                               scale=attn.scale)


class DeepseekRouter(nn.Module):
    """``weight`` [E, hidden] and ``e_score_correction_bias`` [E] (fp32, frozen: module docstring)."""

    def __init__(self, num_experts: int, hidden: int, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty((num_experts, hidden), dtype=dtype, device=device))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32, device=device),
                                                    requires_grad=False)

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.bfloat16()`` move the bias but keep it fp32 (transformers keeps it in fp32 too)."""
        bias = self.e_score_correction_bias.data   # the tensor, not the Parameter (whose .data _apply rebinds)
        out = super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if moved.dtype != torch.float32:
            moved.data = bias.to(device=moved.device)
        return out


class DeepseekMoE(nn.Module):
    """``gate`` (:class:`DeepseekRouter`), ``experts`` (stacked), ``shared_experts`` (a dense MLP of
    moe_intermediate_size * n_shared_experts); forward: the module docstring."""

    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, device):
        super().__init__()
        o = cfg.ffn_options
        self.layer_index, self.options = layer_index, o
        self.gate = DeepseekRouter(o["num_experts"], cfg.hidden_size, dtype, device)
        self.experts = StackedExperts(o["num_experts"], cfg.hidden_size, o["moe_intermediate_size"], dtype, device)
        self.shared_experts = shared_expert_mlp(cfg, layer_index, o["moe_intermediate_size"] * o["n_shared_experts"],
                                                dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o, layer = self.options, self.layer_index
        logits = tap(layer_tap(layer, "router"), ops.router_logits(x, self.gate.weight))
        experts, weights = ops.moe_route_grouped_sigmoid(
            logits, self.gate.e_score_correction_bias.detach(), o["num_experts_per_tok"], n_group=o["n_group"],
            topk_group=o["topk_group"], normalize=o["norm_topk_prob"], scaling=o["routed_scaling_factor"])
        tap(layer_tap(layer, "routing"), experts)
        record = current_routing_record()
        if record is not None:
            record.add(layer, logits, experts)
        routed = ops.moe_combine(self.experts(x, experts), weights, experts)
        return add_shared_expert(routed, x, self.shared_experts)


@register_ffn("deepseek_moe")
def build_deepseek_ffn(cfg: ModelConfig, layer_index: int, dtype, device) -> nn.Module:
    """The dense MLP on the first ``first_k_dense_replace`` layers, :class:`DeepseekMoE` after them."""
    if layer_index < cfg.ffn_options["first_k_dense_replace"]:
        return MLP(cfg, layer_index, dtype, device)
    return DeepseekMoE(cfg, layer_index, dtype, device)


__all__ = ["MLAttention", "mla_block", "expand_kv", "latent_paged_attention", "DeepseekMoE", "DeepseekRouter",
           "build_deepseek_ffn", "softmax_scale"]
