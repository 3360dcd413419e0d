"""ModelConfig: parsing both Hugging Face config layouts, round trips, and clear refusals."""

from __future__ import annotations

import pytest

from rlalign.models import ModelConfig, ModelConfigError
from rlalign.models.testing import tiny_hf_config

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_round_trip(family):
    cfg = ModelConfig.from_hf_dict(tiny_hf_config(family, initializer_range=0.01, use_cache=True))
    assert cfg.family == family
    assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    again = ModelConfig.from_hf_dict(cfg.to_hf_dict())
    assert again == cfg
    assert again.extra["initializer_range"] == 0.01  # unknown keys survive


def test_legacy_and_v5_rope_layouts_agree():
    legacy = ModelConfig.from_hf_dict(tiny_hf_config("llama", rope_theta=5e5, rope_scaling=dict(LLAMA3)))
    v5 = tiny_hf_config("llama")
    v5.pop("rope_theta")
    v5["rope_parameters"] = dict(LLAMA3, rope_theta=5e5)
    parsed = ModelConfig.from_hf_dict(v5)
    assert (parsed.rope_theta, parsed.rope_scaling) == (legacy.rope_theta, legacy.rope_scaling) == (5e5, LLAMA3)
    old_style = dict(LLAMA3)
    old_style["type"] = old_style.pop("rope_type")
    assert ModelConfig.from_hf_dict(tiny_hf_config("llama", rope_scaling=old_style)).rope_scaling == LLAMA3
    default = ModelConfig.from_hf_dict(tiny_hf_config("qwen3", rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1e6}))
    assert default.rope_scaling is None and default.rope_theta == 1e6


def test_defaults_follow_transformers():
    d = tiny_hf_config("qwen3")
    for key in ("head_dim", "num_key_value_heads", "tie_word_embeddings"):
        d.pop(key)
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.tie_word_embeddings) == (128, cfg.num_heads, False)
    d = tiny_hf_config("llama", hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
    d.pop("head_dim")
    assert ModelConfig.from_hf_dict(d).head_dim == 32
    d = tiny_hf_config("qwen2", torch_dtype="bfloat16")
    d.pop("model_type")
    cfg = ModelConfig.from_hf_dict(d)  # family from architectures
    assert cfg.family == "qwen2" and cfg.dtype == "bfloat16"


def test_saved_by_transformers_parses():
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=12345.0,
                                  tie_word_embeddings=True, dtype="bfloat16")
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    assert (cfg.rope_theta, cfg.tie_word_embeddings, cfg.dtype, cfg.num_kv_heads) == (12345.0, True, "bfloat16", 2)
    back = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"})
    assert back.rope_parameters["rope_theta"] == 12345.0 and back.tie_word_embeddings


@pytest.mark.parametrize("overrides, message", [
    (dict(model_type="mistral", architectures=["MistralForCausalLM"]), "unsupported model_type 'mistral'"),
    (dict(model_type="mixtral", architectures=["MixtralForCausalLM"]), "unsupported model_type 'mixtral'"),
    (dict(architectures=["Qwen3ForSequenceClassification"]), "Qwen3ForSequenceClassification"),
    (dict(num_experts=8), "mixture-of-experts"),
    (dict(use_sliding_window=True), "sliding-window"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding_attention"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope scaling type 'yarn'"),
    (dict(rope_scaling=dict(type="linear", factor=2.0)), "rope scaling type 'linear'"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "llama3 rope scaling is missing"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias=true is not supported for qwen3"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
    (dict(vocab_size=None), "missing required key 'vocab_size'"),
])
def test_unsupported_features_are_named(overrides, message):
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig.from_hf_dict(tiny_hf_config("qwen3", **overrides))


@pytest.mark.parametrize("key", ["attention_bias", "mlp_bias"])
def test_llama_biases_refused(key):
    with pytest.raises(ModelConfigError, match=key):
        ModelConfig.from_hf_dict(tiny_hf_config("llama", **{key: True}))


def test_qwen2_attention_bias_flag_is_its_default():
    assert ModelConfig.from_hf_dict(tiny_hf_config("qwen2", attention_bias=True)).qkv_bias
