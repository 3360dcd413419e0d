"""The architecture registry: which Hugging Face model families the decoder implements, and how.

One :class:`Family` per ``model_type``: its ``*ForCausalLM`` architecture name, how its config.json
maps to :class:`~rlalign.models.config.ModelConfig`'s feature fields (``qkv_bias``, ``qk_norm``,
``ffn_kind`` / ``ffn_options``, ...) and back. Everything else in the code base asks the features,
never the family name; the integrations (transformers patch, vLLM plugin) look families up here
and keep no table of their own.

Adding a family = one :func:`register` call (below, or in the module that adds its new FFN kind).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rlalign.contract.errors import RLAlignError
from rlalign.models import deepseek_v3_family   # its config.json parser (a module of its own: MLA and its MoE)

# Config keys that describe a mixture-of-experts FFN; a dense family refuses any of them.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


class UnknownArchitectureError(RLAlignError, ValueError):
    """A model_type / architecture name that no registered family implements."""


@dataclasses.dataclass(frozen=True)
class Family:
    """``features(hf_dict)``: the ModelConfig feature fields of a config.json of this family (raises
    ValueError naming an unsupported feature); ``hf_keys(config)``: the family-specific config.json
    keys that say the same thing back; ``default_head_dim(hf_dict)``: head_dim when config.json has
    none (transformers' default for the family)."""

    model_type: str
    architecture: str                                    # the *ForCausalLM class name
    features: Callable[[dict], dict[str, Any]]
    hf_keys: Callable[[Any], dict[str, Any]]
    default_head_dim: Callable[[dict], int] = lambda d: d["hidden_size"] // d["num_attention_heads"]
    backbone_architecture: str | None = None             # the headless *Model class name
    windows: bool = False                                # its parser reads layer_types / sliding_window itself
    integrations: bool = True                            # the transformers patch and the vLLM plugin serve it
    partial_rotary: bool = False                         # its parser reads partial_rotary_factor itself


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.model_type in _FAMILIES:
        raise ValueError(f"family {family.model_type!r} is already registered")
    _FAMILIES[family.model_type] = family
    return family


def get(model_type: str) -> Family:
    family = _FAMILIES.get(model_type)
    if family is None:
        raise UnknownArchitectureError(f"unsupported model_type {model_type!r}: supported are "
                                       f"{', '.join(_FAMILIES)} decoders")
    return family


def names() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def architectures() -> tuple[str, ...]:
    """The ``*ForCausalLM`` class names of every registered family."""
    return tuple(f.architecture for f in _FAMILIES.values())


def integration_architectures() -> tuple[str, ...]:
    """The ``*ForCausalLM`` class names the transformers patch and the vLLM plugin serve (``Family.integrations``)."""
    return tuple(f.architecture for f in _FAMILIES.values() if f.integrations)


def by_architecture(architecture: str) -> Family | None:
    """The family whose ``*ForCausalLM`` (or headless ``*Model``) class is ``architecture``; None if none."""
    for family in _FAMILIES.values():
        if architecture in (family.architecture, family.backbone_architecture):
            return family
    return None


# ---- feature parsers shared by the families ------------------------------------------------------------

def dense_ffn(d: dict) -> dict[str, Any]:
    """FFN fields of a dense SiLU-gated MLP (refuses mixture-of-experts keys and biases)."""
    for key in MOE_KEYS:
        if d.get(key):
            raise ValueError(f"mixture-of-experts is not supported ({key}={d[key]!r})")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    return {"ffn_kind": "dense", "ffn_options": {}}


def _no_attention_bias(model_type: str, d: dict) -> None:
    if d.get("attention_bias"):
        raise ValueError(f"attention_bias=true is not supported for {model_type}")


def _llama_features(d: dict) -> dict[str, Any]:
    _no_attention_bias("llama", d)
    return {"qkv_bias": False, "qk_norm": False, **dense_ffn(d)}


def _qwen2_features(d: dict) -> dict[str, Any]:
    # Qwen2 always has q/k/v biases (not o); attention_bias is not read by transformers' Qwen2.
    return {"qkv_bias": True, "qk_norm": False, **dense_ffn(d)}


def _qwen3_features(d: dict) -> dict[str, Any]:
    _no_attention_bias("qwen3", d)
    return {"qkv_bias": False, "qk_norm": True, **dense_ffn(d)}


# transformers' Qwen3MoeConfig defaults, for keys a config.json leaves out
_QWEN3_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                       "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _qwen3_moe_features(d: dict) -> dict[str, Any]:
    _no_attention_bias("qwen3_moe", d)
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if d.get(key):
            raise ValueError(f"shared experts are not supported ({key}={d[key]!r})")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    d = dict(d)
    if d.get("num_local_experts") is not None:   # transformers 5 writes num_experts under this name
        if d.get("num_experts") is not None and d["num_experts"] != d["num_local_experts"]:
            raise ValueError(f"num_experts={d['num_experts']} and num_local_experts={d['num_local_experts']} differ")
        d["num_experts"] = d["num_local_experts"]
    o = {k: (d[k] if d.get(k) is not None else v) for k, v in _QWEN3_MOE_DEFAULTS.items()}
    n, k = int(o["num_experts"]), int(o["num_experts_per_tok"])
    if n < 1 or not 1 <= k <= n:
        raise ValueError(f"num_experts_per_tok={k} must be between 1 and num_experts={n}")
    if int(o["decoder_sparse_step"]) < 1 or int(o["moe_intermediate_size"]) < 1:
        raise ValueError(f"decoder_sparse_step={o['decoder_sparse_step']} and moe_intermediate_size="
                         f"{o['moe_intermediate_size']} must be >= 1")
    options = {"num_experts": n, "num_experts_per_tok": k, "moe_intermediate_size": int(o["moe_intermediate_size"]),
               "norm_topk_prob": bool(o["norm_topk_prob"]), "decoder_sparse_step": int(o["decoder_sparse_step"]),
               "mlp_only_layers": [int(i) for i in o["mlp_only_layers"]]}
    return {"qkv_bias": False, "qk_norm": True, "ffn_kind": "moe", "ffn_options": options}


# transformers' GptOssConfig defaults, for keys a config.json leaves out
_GPT_OSS_DEFAULTS = {"num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                     "sliding_window": 128}
_GPT_OSS_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gpt_oss_features(d: dict) -> dict[str, Any]:
    """gpt-oss: q/k/v/o biases (attention_bias, default true), a sink logit per query head, sliding-window
    layers alternating with full ones (``layer_types``; default: even layers sliding), every layer a MoE of
    ``intermediate_size`` experts (rlalign.models.gpt_oss). Quantized (MXFP4) checkpoints are refused."""
    if d.get("quantization_config"):
        method = (d["quantization_config"] or {}).get("quant_method", "?")
        raise ValueError(f"quantized checkpoints are not supported (quantization_config: {method}); use a "
                         "bf16/fp32 (dequantized) checkpoint")
    if d.get("num_experts") is not None and d.get("num_local_experts") is not None \
            and d["num_experts"] != d["num_local_experts"]:
        raise ValueError(f"num_experts={d['num_experts']} and num_local_experts={d['num_local_experts']} differ")
    d = dict(d, num_local_experts=d.get("num_local_experts", d.get("num_experts")))
    o = {k: (d[k] if d.get(k) is not None else v) for k, v in _GPT_OSS_DEFAULTS.items()}
    n, k = int(o["num_local_experts"]), int(o["num_experts_per_tok"])
    if n < 1 or not 1 <= k <= n:
        raise ValueError(f"num_experts_per_tok={k} must be between 1 and num_local_experts={n}")
    layers = int(d.get("num_hidden_layers") or 0)
    types = d.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    other = sorted(set(types) - set(_GPT_OSS_LAYER_TYPES))
    if other:
        raise ValueError(f"layer types {other} are not supported (only {', '.join(_GPT_OSS_LAYER_TYPES)})")
    bias = d.get("attention_bias")
    bias = True if bias is None else bool(bias)
    options = {"num_experts": n, "num_experts_per_tok": k, "swiglu_alpha": float(o["swiglu_alpha"]),
               "swiglu_limit": float(o["swiglu_limit"])}
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "attention_sinks": True,
            "sliding_window": int(o["sliding_window"]), "layer_types": tuple(types), "ffn_kind": "gpt_oss_moe",
            "ffn_options": options}


def _gpt_oss_keys(cfg) -> dict[str, Any]:
    o = cfg.ffn_options
    return {"attention_bias": cfg.qkv_bias, "sliding_window": cfg.sliding_window,
            "layer_types": list(cfg.layer_types), "num_local_experts": o["num_experts"],
            "num_experts_per_tok": o["num_experts_per_tok"], "swiglu_alpha": o["swiglu_alpha"],
            "swiglu_limit": o["swiglu_limit"]}


register(Family("llama", "LlamaForCausalLM", _llama_features,
                lambda cfg: {"attention_bias": False, "mlp_bias": False}, backbone_architecture="LlamaModel"))
register(Family("qwen2", "Qwen2ForCausalLM", _qwen2_features, lambda cfg: {},
                backbone_architecture="Qwen2Model"))
register(Family("qwen3", "Qwen3ForCausalLM", _qwen3_features, lambda cfg: {"attention_bias": False},
                default_head_dim=lambda d: 128, backbone_architecture="Qwen3Model"))

register(Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe_features,
                lambda cfg: {"attention_bias": False, **cfg.ffn_options},
                default_head_dim=lambda d: 128, backbone_architecture="Qwen3MoeModel"))


register(Family("gpt_oss", "GptOssForCausalLM", _gpt_oss_features, _gpt_oss_keys, default_head_dim=lambda d: 64,
                backbone_architecture="GptOssModel", windows=True, integrations=False))


register(Family("deepseek_v3", "DeepseekV3ForCausalLM", deepseek_v3_family.features, deepseek_v3_family.hf_keys,
                default_head_dim=lambda d: int(d.get("qk_rope_head_dim") or 64),
                backbone_architecture="DeepseekV3Model", integrations=False))

__all__ = ["Family", "register", "get", "names", "architectures", "integration_architectures", "by_architecture", "dense_ffn", "MOE_KEYS",
           "UnknownArchitectureError"]
