"""ModelConfig: the subset of a Hugging Face ``config.json`` the decoder needs, as feature fields.

The family (``model_type``) is looked up in :mod:`rlalign.models.architectures`, which maps its
config.json to the feature fields (``qkv_bias``, ``qk_norm``, ``ffn_kind``, ...) and back; the
decoder reads only the features. Registered: ``llama`` (Llama 2/3, rope scaling ``llama3``),
``qwen2`` (Qwen2/2.5: q/k/v bias), ``qwen3`` (dense Qwen3: q/k RMSNorm), ``qwen3_moe``, ``gpt_oss`` (sliding
windows, attention sinks, YaRN rope, its MoE: rlalign.models.gpt_oss), ``deepseek_v3`` (multi-head latent
attention, grouped sigmoid routing with shared experts: rlalign.models.deepseek_v3_family / deepseek_v3), and the
families registered elsewhere in rlalign.models. Anything the decoder would silently compute differently from the reference implementation (MoE, sliding window, other
rope scalings, extra biases, other activations, partial rotary) is refused with a
:class:`ModelConfigError` naming the feature. Every config.json key this module (or a family) reads is
type-checked first (:data:`KEY_RULES`): a string ``hidden_size``, a negative size, a float where an
integer belongs or a string where a bool belongs is one line naming the key, never a traceback from
deep inside the model's construction.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from rlalign.contract.errors import RLAlignError
from rlalign.models import architectures

_ROPE_TYPES = ("default", "llama3", "yarn")
# Keys this module owns: parsed on the way in, written canonically on the way out.
_OWNED_KEYS = {
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "tie_word_embeddings", "max_position_embeddings", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "attention_bias", "mlp_bias",
}


class ModelConfigError(RLAlignError, ValueError):
    """A config.json describes a model this decoder does not implement (message names the feature)."""


def _is_int(x, low: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, list) and all(check(v) for v in x)


_SIZE = ("an integer >= 1", lambda x: _is_int(x, 1))
_COUNT = ("an integer >= 0", lambda x: _is_int(x, 0))
_TOKEN_ID = ("a token id (an integer)", lambda x: _is_int(x, -2**63))   # some configs write -1 for "none"
_BOOL = ("true or false", lambda x: isinstance(x, bool))
_TEXT = ("a string", lambda x: isinstance(x, str))
_POSITIVE = ("a finite number > 0", _is_number)
_MAPPING = ("a mapping", lambda x: isinstance(x, dict))
# config.json keys read here or by a family (rlalign.models.architectures): (what they must be, the check); a null
# value counts as absent (its default applies, or a required key is missing)
KEY_RULES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    **{k: _SIZE for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "max_position_embeddings", "moe_intermediate_size",
                          "decoder_sparse_step", "linear_conv_kernel_dim", "linear_key_head_dim",
                          "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                          "full_attention_interval")},
    # no decoder layer (embedding, final norm, head) is a degenerate but valid model
    **{k: _COUNT for k in ("num_hidden_layers", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
                           "shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts", "mtp_num_hidden_layers")},
    **{k: _BOOL for k in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "norm_topk_prob")},
    **{k: _TEXT for k in ("model_type", "hidden_act", "torch_dtype", "dtype")},
    **{k: _TOKEN_ID for k in ("bos_token_id", "pad_token_id")},
    **{k: _POSITIVE for k in ("rms_norm_eps", "rope_theta", "partial_rotary_factor", "swiglu_alpha", "swiglu_limit")},
    "sliding_window": ("an integer >= 1", lambda x: _is_int(x, 1)),
    **{k: _MAPPING for k in ("rope_scaling", "rope_parameters")},
    "eos_token_id": ("a token id or a list of them", lambda x: _TOKEN_ID[1](x) or _list_of(_TOKEN_ID[1])(x)),
    "architectures": ("a list of strings", _list_of(lambda v: isinstance(v, str))),
    "layer_types": ("a list of strings", _list_of(lambda v: isinstance(v, str))),
    "mlp_only_layers": ("a list of layer indices (integers >= 0)", _list_of(lambda v: _is_int(v, 0))),
    # DeepSeek-V3 (rlalign.models.deepseek_v3_family); q_lora_rank null means no q low-rank path
    **{k: _SIZE for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                          "n_group", "topk_group", "moe_layer_freq")},
    **{k: _COUNT for k in ("first_k_dense_replace", "num_nextn_predict_layers")},
    "routed_scaling_factor": _POSITIVE,
    "rope_interleave": _BOOL,
}


def check_key_types(d: dict) -> None:
    """Raise :class:`ModelConfigError` (one line: the key, its rule, the value) for the first key of
    :data:`KEY_RULES` whose value breaks its rule."""
    if not isinstance(d, dict):
        raise ModelConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
    for key, (rule, check) in KEY_RULES.items():
        value = d.get(key)
        if value is not None and not check(value):
            raise ModelConfigError(f"{key} must be {rule}, got {value!r} ({type(value).__name__})")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str                    # a registered model_type (rlalign.models.architectures): names the
                                   # checkpoint format on save; the decoder reads only the features below
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # None (default rope) or the llama3 dict
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "float32"             # checkpoint dtype name ("float32", "bfloat16", ...)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict = dataclasses.field(default_factory=dict)  # other config.json keys, kept for round trips
    # -- features (set by the family's entry in rlalign.models.architectures)
    qkv_bias: bool = False         # biases on q/k/v projections (never on o_proj)
    qk_norm: bool = False          # RMSNorm over head_dim applied to q and k, before rope
    o_bias: bool = False           # a bias on o_proj (gpt-oss)
    attention_sinks: bool = False  # a learned sink logit per query head (``self_attn.sinks``, gpt-oss)
    sliding_window: int | None = None           # keys p - window < pos <= p on the "sliding_attention" layers
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" | "sliding_attention" (None: all full)
    ffn_kind: str = "dense"        # the FFN module kind (rlalign.models.ffn registry)
    ffn_options: dict = dataclasses.field(default_factory=dict)  # shape fields of non-dense FFN kinds
    zero_centred_norms: bool = False   # RMSNorm weights w scale by (1 + w) (Qwen3-Next)
    partial_rotary_factor: float = 1.0   # rope on the first head_dim * factor dims of each head
    linear_attention: dict = dataclasses.field(default_factory=dict)  # Gated-DeltaNet shape ("linear_attention" layers)
    attention_kind: str = "mha"    # the attention module kind (rlalign.models.attention_kinds registry: "mha",
                                   # "mla" DeepSeek-V3, "gated" Qwen3-Next's output-gated attention)
    attention_options: dict = dataclasses.field(default_factory=dict)  # shape fields of other attention kinds
    rope_head_dim: int | None = None   # rotated dims of each head where MLA rotates only its last ones

    @property
    def rotary_dim(self) -> int:
        """How many dims of each head the rope rotates: the leading head_dim * partial_rotary_factor, or MLA's
        rope_head_dim (qk_rope_head_dim, the last dims of its K head)."""
        return self.rope_head_dim or int(self.head_dim * self.partial_rotary_factor)

    def attention_window(self, layer_index: int) -> int | None:
        """The sliding window of layer ``layer_index``'s attention (None: full causal attention)."""
        if self.layer_types is None or self.layer_types[layer_index] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else (self.eos_token_id,)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Parse a Hugging Face config dict (transformers 4.x ``rope_theta``/``rope_scaling`` or 5.x
        ``rope_parameters`` layout); raise ModelConfigError for anything unsupported or of the wrong type
        (:func:`check_key_types`)."""
        check_key_types(d)
        family = _family(d)
        _reject_unsupported(d, family)
        try:
            features = family.features(d)
        except ValueError as exc:
            raise ModelConfigError(str(exc)) from None
        heads = _required(d, "num_attention_heads")
        hidden = _required(d, "hidden_size")
        # a family whose heads are not config.json's head_dim / num_key_value_heads (MLA) sets them in its features
        kv_heads = features.pop("num_kv_heads", None) or d.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = features.pop("head_dim", None) or d.get("head_dim") or (
            family.default_head_dim(d) if "head_dim" not in d else hidden // heads)
        theta, scaling = _rope(d, family)
        return cls(
            family=family.model_type,
            vocab_size=_required(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(d, "intermediate_size"),
            num_layers=_required(d, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            dtype=_dtype_name(d.get("dtype") or d.get("torch_dtype") or "float32"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            extra={k: v for k, v in d.items() if k not in _OWNED_KEYS},
            **features,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers 4.x and 5.x both load (legacy rope keys)."""
        family = architectures.get(self.family)
        out = dict(self.extra)
        out.update({
            "architectures": [family.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        })
        out.update(family.hf_keys(self))
        return out


def _required(d: dict, key: str):
    if d.get(key) is None:
        raise ModelConfigError(f"config.json is missing required key {key!r}")
    return d[key]


def _family(d: dict) -> architectures.Family:
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    if model_type is None and archs:
        found = architectures.by_architecture(archs[0])
        model_type = found.model_type if found else None
    if model_type not in architectures.names():
        found = f"model_type {d.get('model_type')!r}" + (f" (architectures {archs})" if archs else "")
        raise ModelConfigError(f"unsupported {found}: supported are {', '.join(architectures.names())} decoders")
    family = architectures.get(model_type)
    for arch in archs:
        if arch != family.architecture:
            raise ModelConfigError(f"unsupported architecture {arch!r} for model_type {model_type!r} "
                                   f"(supported: {', '.join(architectures.architectures())})")
    return family


def _reject_unsupported(d: dict, family: architectures.Family) -> None:
    """Features no family implements (family-specific ones are refused by the family's parser); sliding-window
    layers only where the family parses them (``Family.windows``)."""
    if d.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
    if family.windows:
        return
    if d.get("use_sliding_window"):
        raise ModelConfigError("sliding-window attention is not supported (use_sliding_window=true)")
    other_layers = sorted({t for t in (d.get("layer_types") or []) if t != "full_attention"})
    if other_layers:
        raise ModelConfigError(f"layer types {other_layers} are not supported (only 'full_attention')")


def _rope(d: dict, family: architectures.Family) -> tuple[float, dict | None]:
    """(theta, scaling-or-None) from either config layout; default and llama3 rope, and yarn for the families the
    integrations do not serve (gpt_oss: the transformers patch and the vLLM plugin build cos/sin without YaRN's
    attention factor)."""
    params = d.get("rope_parameters")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError("per-layer-type rope_parameters are not supported")
    scaling = dict(d.get("rope_scaling") or params or {})
    theta = float(scaling.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    partial = float(scaling.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if partial != 1.0 and not family.partial_rotary:
        raise ModelConfigError("partial_rotary_factor != 1 is not supported")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "yarn" and family.integrations:
        raise ModelConfigError(f"rope scaling type 'yarn' is not supported for {family.model_type} (only gpt_oss)")
    if kind not in _ROPE_TYPES:
        raise ModelConfigError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    if kind == "yarn":
        return theta, _yarn(scaling)
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if k not in scaling]
    if missing:
        raise ModelConfigError(f"llama3 rope scaling is missing {missing}")
    scaling.pop("type", None)
    scaling["rope_type"] = "llama3"
    return theta, scaling


def _yarn(scaling: dict) -> dict:
    """YaRN rope parameters (transformers' keys); factor and original_max_position_embeddings are required."""
    missing = [k for k in ("factor", "original_max_position_embeddings") if scaling.get(k) is None]
    if missing:
        raise ModelConfigError(f"yarn rope scaling is missing {missing}")
    known = {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
             "attention_factor", "mscale", "mscale_all_dim"}
    unknown = sorted(set(scaling) - known)
    if unknown:
        raise ModelConfigError(f"yarn rope scaling keys {unknown} are not supported")
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"):
        if scaling.get(key) is not None and not _is_number(scaling[key]):
            raise ModelConfigError(f"rope scaling {key} must be a finite number > 0, got {scaling[key]!r}")
    out = {k: v for k, v in scaling.items() if k != "type"}
    out["rope_type"] = "yarn"
    return out


def _dtype_name(value) -> str:
    name = str(value).removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16"}
    return aliases.get(name, name)
