"""The ``deepseek_v3`` family's config.json parser (``DeepseekV3ForCausalLM``; registered by
rlalign.models.architectures, which imports it: no import back).

Maps transformers' ``DeepseekV3Config`` keys (defaults for keys a config.json leaves out are transformers') to the
decoder's features: ``attention_kind="mla"`` (multi-head latent attention, rlalign.models.deepseek_v3) with its shape
in ``attention_options``; ``head_dim`` = qk_nope_head_dim + qk_rope_head_dim (the K head, what the attention ops take
per head: V is padded to it; the KV cache holds the compressed latent, rlalign.models.latent_cache),
``num_kv_heads`` = num_attention_heads (MLA expands K and V per query head),
``rope_head_dim`` = qk_rope_head_dim; ``ffn_kind="deepseek_moe"`` (dense layers first, then routed + shared experts
with DeepSeek's grouped sigmoid routing) with its shape in ``ffn_options``.

Refused in one line: quantized checkpoints, ``num_key_value_heads`` != ``num_attention_heads``, ``moe_layer_freq``
other than 1 (transformers ignores it: every layer from ``first_k_dense_replace`` on is sparse), rope scalings other
than default and yarn, shapes the routing or the strict attention cannot run (odd head dims, V wider than K,
groups of fewer than 2 experts, more experts per token than the kept groups hold), no shared expert.
``num_nextn_predict_layers`` (multi-token prediction layers): kept in config.json, their weights ignored on load
(as transformers does, rlalign.models.checkpoint).
"""

from __future__ import annotations

from typing import Any

# transformers' DeepseekV3Config defaults, for keys a config.json leaves out (or sets to null, except q_lora_rank,
# whose null means "no low-rank q")
_DEFAULTS = {"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
             "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 128,
             "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
             "norm_topk_prob": True, "rope_interleave": True, "attention_bias": False}
_Q_LORA_DEFAULT = 1536
ROPE_TYPES = ("default", "yarn")


def _options(d: dict) -> dict[str, Any]:
    o = {k: (d[k] if d.get(k) is not None else v) for k, v in _DEFAULTS.items()}
    if d.get("num_local_experts") is not None:   # transformers' attribute_map alias of n_routed_experts
        o["n_routed_experts"] = d["num_local_experts"]
    o["q_lora_rank"] = d["q_lora_rank"] if "q_lora_rank" in d else _Q_LORA_DEFAULT
    return o


def _check_shapes(d: dict, o: dict) -> None:
    heads = d.get("num_attention_heads")
    kv_heads = d.get("num_key_value_heads")
    if kv_heads is not None and heads is not None and kv_heads != heads:
        raise ValueError(f"num_key_value_heads={kv_heads} must equal num_attention_heads={heads} (multi-head latent "
                         "attention expands K and V for every query head)")
    if d.get("moe_layer_freq") not in (None, 1):
        raise ValueError(f"moe_layer_freq={d['moe_layer_freq']} is not supported (only 1: transformers makes every "
                         "layer from first_k_dense_replace on sparse)")
    qk = o["qk_nope_head_dim"] + o["qk_rope_head_dim"]
    if o["qk_rope_head_dim"] % 2 or qk % 2:
        raise ValueError(f"qk_rope_head_dim={o['qk_rope_head_dim']} and qk_nope_head_dim + qk_rope_head_dim={qk} "
                         "must be even")
    if o["v_head_dim"] > qk:
        raise ValueError(f"v_head_dim={o['v_head_dim']} wider than the K head ({qk}) is not supported")
    n, k, groups, keep = o["n_routed_experts"], o["num_experts_per_tok"], o["n_group"], o["topk_group"]
    if n < 1 or n % groups or n // groups < 2:
        raise ValueError(f"n_routed_experts={n} must split into n_group={groups} groups of at least 2 experts")
    if not 1 <= keep <= groups:
        raise ValueError(f"topk_group={keep} must be between 1 and n_group={groups}")
    if not 1 <= k <= keep * (n // groups):
        raise ValueError(f"num_experts_per_tok={k} must be between 1 and the {keep * (n // groups)} experts of the "
                         f"topk_group={keep} kept groups")
    if o["n_shared_experts"] < 1:
        raise ValueError("n_shared_experts=0 is not supported (DeepSeek-V3 adds a shared-expert MLP to every sparse "
                         "layer)")


def _rope_type(d: dict) -> str:
    scaling = d.get("rope_scaling") or d.get("rope_parameters") or {}
    return scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"


def features(d: dict) -> dict[str, Any]:
    """The decoder's feature fields of a DeepSeek-V3 config.json (see the module docstring); ValueError names what
    is not supported."""
    if d.get("quantization_config"):
        method = (d["quantization_config"] or {}).get("quant_method", "?")
        raise ValueError(f"quantized checkpoints are not supported (quantization_config: {method}); use a "
                         "bf16/fp32 (dequantized) checkpoint")
    kind = _rope_type(d)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported for deepseek_v3 (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    o = _options(d)
    _check_shapes(d, o)
    attention = {key: o[key] for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                         "v_head_dim", "rope_interleave")}
    attention["attention_bias"] = bool(o["attention_bias"])
    ffn = {"num_experts": int(o["n_routed_experts"]), "num_experts_per_tok": int(o["num_experts_per_tok"]),
           "moe_intermediate_size": int(o["moe_intermediate_size"]), "n_shared_experts": int(o["n_shared_experts"]),
           "routed_scaling_factor": float(o["routed_scaling_factor"]), "n_group": int(o["n_group"]),
           "topk_group": int(o["topk_group"]), "norm_topk_prob": bool(o["norm_topk_prob"]),
           "first_k_dense_replace": int(o["first_k_dense_replace"])}
    return {"qkv_bias": False, "qk_norm": False, "o_bias": attention["attention_bias"], "attention_kind": "mla",
            "attention_options": attention, "head_dim": o["qk_nope_head_dim"] + o["qk_rope_head_dim"],
            "num_kv_heads": d.get("num_attention_heads"), "rope_head_dim": o["qk_rope_head_dim"],
            "ffn_kind": "deepseek_moe", "ffn_options": ffn}


def hf_keys(cfg) -> dict[str, Any]:
    """The config.json keys that say the features back, under transformers' names (``head_dim`` as transformers
    writes it: qk_rope_head_dim)."""
    a, f = cfg.attention_options, cfg.ffn_options
    return {**{k: a[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                 "v_head_dim", "rope_interleave", "attention_bias")},
            "head_dim": a["qk_rope_head_dim"], "num_key_value_heads": cfg.num_heads,
            "n_routed_experts": f["num_experts"],
            **{k: f[k] for k in ("num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                                 "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
                                 "first_k_dense_replace")}}


__all__ = ["features", "hf_keys", "ROPE_TYPES"]
