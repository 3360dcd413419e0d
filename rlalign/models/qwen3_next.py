"""Qwen3-Next (``model_type: qwen3_next``): the family, its gated full-attention layers and zero-centred norms.

A hybrid decoder: ``layer_types`` says per layer "linear_attention" (Gated-DeltaNet,
:mod:`rlalign.models.gated_deltanet`) or "full_attention" (below). Per full-attention layer (Hugging Face's
``Qwen3NextAttention``)::

    q|gate = q_proj(x)   viewed [H, 2D]: per head the query then its gate
    q, k   = q_norm(q), k_norm(k)                 zero-centred RMSNorm over D: x_hat * (1 + w)
    q, k   = rope of the first rot = D * partial_rotary_factor dims, the rest passed through
    a      = strict causal attention (packed varlen / paged), scale D^-1/2
    h      = o_proj(a * sigmoid(gate))            the gate product in fp32, rounded once

Every other RMSNorm of the model (input/post-attention, final) is zero-centred too; the linear layers' gated norm is
not. FFN (``ffn_kind="moe"`` when a layer is sparse, else "dense"): a sparse layer (i not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``, num_experts > 0) is Qwen3-MoE's routed experts (softmax top-k,
``norm_topk_prob``) plus a shared expert MLP of ``shared_expert_intermediate_size`` scaled by
sigmoid(``shared_expert_gate``(x)) (rlalign.models.moe.SharedExpertMoE); the others the dense SiLU MLP of
``intermediate_size``. Not served: the transformers patch and
the vLLM plugin (``Family.integrations=False``), tensor parallelism, the native profile for the linear-attention
layers (refused in one line by their ops); on CUDA the rule runs the Triton backend's chunk kernel. Multi-token-prediction layers (``mtp_num_hidden_layers``,
the ``mtp.*`` tensors): kept in config.json, their weights ignored on load as transformers ignores them.
"""

from __future__ import annotations

from typing import Any

import torch

from rlalign import ops
from rlalign.contract import spec
from rlalign.models import architectures, moe
from rlalign.models.attention_kinds import register_attention
from rlalign.models.blocks import PagedAttend
from rlalign.models.modules import Linear, RMSNorm
from rlalign.models.taps import layer_tap, tap
from rlalign.ops import gated_delta as gd

_LAYER_TYPES = ("linear_attention", "full_attention")
# transformers' Qwen3NextConfig defaults, for keys a config.json leaves out
_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
             "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
             "partial_rotary_factor": 0.25, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
             "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "norm_topk_prob": True}


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm whose stored ``weight`` w scales by (1 + w) (Qwen3-Next): ``ops.rms_norm`` with the weight 1 + w
    (added in the weight's dtype)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, 1.0 + self.weight, self.eps, residual=residual)


@register_attention("gated")
class GatedAttention(torch.nn.Module):
    """Qwen3-Next's full-attention layer (module docstring), weights under Hugging Face's names."""

    def __init__(self, cfg, layer_index: int, dtype, device):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Linear(h, 2 * cfg.num_heads * d, False, dtype, device)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, False, dtype, device)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, False, dtype, device)
        self.o_proj = Linear(cfg.num_heads * d, h, False, dtype, device, k_segments=spec.K_SEGMENTS)
        self.q_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.k_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        t, hq, hk, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qg = self.q_proj(x).view(t, hq, 2 * d)
        q, gate = qg[..., :d].contiguous(), qg[..., d:].reshape(t, hq * d)
        k, v = self.k_proj(x).view(t, hk, d), self.v_proj(x).view(t, hk, d)
        q, k = partial_rope(self.q_norm(q), cos, sin), partial_rope(self.k_norm(k), cos, sin)
        if isinstance(attend, PagedAttend):
            b = attend.batch
            ops.write_kv_cache(k, v, b.kv_cache.k[self.layer_index], b.kv_cache.v[self.layer_index], b.slot_mapping)
        tap(layer_tap(self.layer_index, "q"), q), tap(layer_tap(self.layer_index, "k"), k)
        out = attend(q, k, v, self.layer_index, d ** -0.5).reshape(t, hq * d)
        out = tap(layer_tap(self.layer_index, "attn"), gd.gate_sigmoid(out, gate))
        return tap(layer_tap(self.layer_index, "o_proj"), self.o_proj(out))


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope of the first 2 * cos.shape[-1] dims of each head of x [T, H, D]; the others unchanged."""
    rot = 2 * cos.shape[-1]
    if rot == x.shape[-1]:
        return ops.rope(x, cos, sin)
    return torch.cat([ops.rope(x[..., :rot].contiguous(), cos, sin), x[..., rot:]], dim=-1)


# ---- config.json <-> features ---------------------------------------------------------------------------------

def _option(d: dict, key: str):
    return d[key] if d.get(key) is not None else _DEFAULTS[key]


def _partial_rotary_factor(d: dict) -> float:
    for holder in (d.get("rope_parameters"), d.get("rope_scaling"), d):
        if isinstance(holder, dict) and holder.get("partial_rotary_factor") is not None:
            return float(holder["partial_rotary_factor"])
    return _DEFAULTS["partial_rotary_factor"]


def _features(d: dict) -> dict[str, Any]:
    """Qwen3-Next's features; refuses (ValueError, one line) biases, sliding windows, DeepSeek's MTP key."""
    if d.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for qwen3_next")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if d.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported (use_sliding_window=true)")
    if d.get("num_nextn_predict_layers"):   # Qwen3-Next's MTP key is mtp_num_hidden_layers (its mtp.* tensors are
        # ignored on load, as transformers ignores them: rlalign.models.checkpoint)
        raise ValueError("qwen3_next: num_nextn_predict_layers is not a Qwen3-Next key (its multi-token-prediction "
                         "layers are mtp_num_hidden_layers)")
    layers = int(d.get("num_hidden_layers") or 0)
    types = d.get("layer_types")
    if types is None:
        every = int(_option(d, "full_attention_interval"))
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    other = sorted(set(types) - set(_LAYER_TYPES))
    if other:
        raise ValueError(f"layer types {other} are not supported (only {', '.join(_LAYER_TYPES)})")
    linear = {"num_k_heads": int(_option(d, "linear_num_key_heads")),
              "num_v_heads": int(_option(d, "linear_num_value_heads")),
              "k_head_dim": int(_option(d, "linear_key_head_dim")),
              "v_head_dim": int(_option(d, "linear_value_head_dim")),
              "conv_kernel": int(_option(d, "linear_conv_kernel_dim"))}
    if min(linear.values()) < 1 or linear["num_v_heads"] % linear["num_k_heads"]:
        raise ValueError(f"linear_num_value_heads={linear['num_v_heads']} must be a multiple of "
                         f"linear_num_key_heads={linear['num_k_heads']} (all linear sizes >= 1)")
    factor = _partial_rotary_factor(d)
    head_dim = d.get("head_dim") or 256
    rot = int(head_dim * factor)
    if not 0 < factor <= 1 or rot < 2 or rot % 2:
        raise ValueError(f"partial_rotary_factor={factor} gives {rot} rotary dims of head_dim={head_dim}; "
                         "they must be even and >= 2")
    return {"qkv_bias": False, "qk_norm": True, **_ffn(d, layers), "layer_types": tuple(types),
            "zero_centred_norms": True, "attention_kind": "gated", "partial_rotary_factor": factor,
            "linear_attention": linear}


def _ffn(d: dict, layers: int) -> dict[str, Any]:
    """ffn_kind "moe" with the sparse block's options (a gated shared expert on every sparse layer) when some layer
    is sparse (rlalign.models.moe.is_sparse_layer: transformers' rule), else the dense MLP on every layer."""
    if d.get("num_local_experts") is not None:
        raise ValueError("qwen3_next reads num_experts, not num_local_experts (transformers' Qwen3NextConfig has no "
                         "such key); write num_experts")
    o = {k: int(_option(d, k)) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                         "shared_expert_intermediate_size", "decoder_sparse_step")}
    o["norm_topk_prob"] = bool(_option(d, "norm_topk_prob"))
    o["mlp_only_layers"] = [int(i) for i in d.get("mlp_only_layers") or []]
    if not any(moe.is_sparse_layer(o, i) for i in range(layers)):
        return {"ffn_kind": "dense", "ffn_options": {}}
    n, k = o["num_experts"], o["num_experts_per_tok"]
    if not 1 <= k <= n:
        raise ValueError(f"num_experts_per_tok={k} must be between 1 and num_experts={n}")
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if o[key] < 1:
            raise ValueError(f"{key}={o[key]} must be >= 1 on a qwen3_next model with sparse layers")
    return {"ffn_kind": "moe", "ffn_options": o}


def _hf_keys(cfg) -> dict[str, Any]:
    o = cfg.linear_attention
    return {**cfg.ffn_options, "attention_bias": False, "layer_types": list(cfg.layer_types),
            "partial_rotary_factor": cfg.partial_rotary_factor, "linear_num_key_heads": o["num_k_heads"],
            "linear_num_value_heads": o["num_v_heads"], "linear_key_head_dim": o["k_head_dim"],
            "linear_value_head_dim": o["v_head_dim"], "linear_conv_kernel_dim": o["conv_kernel"]}


architectures.register(architectures.Family(
    "qwen3_next", "Qwen3NextForCausalLM", _features, _hf_keys, default_head_dim=lambda d: 256,
    backbone_architecture="Qwen3NextModel", windows=True, integrations=False, partial_rotary=True))


__all__ = ["GatedAttention", "ZeroCentredRMSNorm", "partial_rope"]
