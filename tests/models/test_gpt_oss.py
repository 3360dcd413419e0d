"""gpt-oss: config, weights and logits against transformers' GptOssForCausalLM; refusals.

A tiny random-init ``GptOssForCausalLM`` written by transformers itself (sliding-window layers shorter than
the sequence, learned sinks, q/k/v/o, router and expert biases drawn non-zero, YaRN rope) loads in rlalign
and gives transformers' fp32 logits within 1e-5 x |z|max (float64 reference: the transformers model cast to
float64); rlalign's save is tensor-for-tensor and byte-for-byte transformers' file and loads back in
transformers with the same logits.
"""

import json

import pytest
import torch

from rlalign.models import load_model, save_model
from rlalign.models.config import ModelConfig, ModelConfigError
from rlalign.models.testing import tiny_hf_config
from tests.models.hf_helpers import assert_same_weight_file, assert_within_reference, strict_logits64

transformers = pytest.importorskip("transformers")

VOCAB = 320


def _hf_model(window: int, layers: int = 3, bias: bool = True, seed: int = 0):
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
        attention_bias=bias, max_position_embeddings=256, pad_token_id=0, eos_token_id=2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM._from_config(cfg, attn_implementation="eager",
                                                        experts_implementation="eager").float().eval()
    with torch.no_grad():   # transformers initialises biases to 0: draw them so that they count
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("window, bias", [(5, True), (70, False)])
def test_logits_match_transformers(tmp_path, window, bias):
    hf = _hf_model(window, bias=bias)
    hf.save_pretrained(tmp_path / "hf")
    model, config = load_model(tmp_path / "hf", dtype="float32")
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert config.attention_window(0) == window and config.attention_window(1) is None
    ids = torch.randint(3, VOCAB, (90,), generator=torch.Generator().manual_seed(window)).tolist()
    with torch.no_grad():
        ref = hf.double()(torch.tensor([ids])).logits[0]
    got = strict_logits64(model, ids)
    assert_within_reference(got, ref)


def test_save_is_transformers_file_and_loads_back_in_transformers(tmp_path):
    hf = _hf_model(6)
    hf.save_pretrained(tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf", dtype="float32")
    save_model(model, tmp_path / "ours")
    assert_same_weight_file(tmp_path / "hf", tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["sliding_window"] == 6
    back = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32,
                                                          attn_implementation="eager",
                                                          experts_implementation="eager").eval()
    assert back.config.layer_types == hf.config.layer_types
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("change, message", [
    (dict(quantization_config={"quant_method": "mxfp4"}), "quantized checkpoints are not supported"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer types \\['chunked_attention'\\]"),
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries for 2 layers"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 must be between 1 and num_local_experts=4"),
    (dict(sliding_window=0), "sliding_window must be an integer >= 1"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn rope scaling is missing"),
])
def test_config_refusals(change, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf_dict(tiny_hf_config("gpt_oss", **change))


def test_yarn_and_windows_are_refused_for_other_families():
    with pytest.raises(ModelConfigError, match="rope scaling type 'yarn' is not supported for qwen3"):
        ModelConfig.from_hf_dict(tiny_hf_config("qwen3", rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}))
    with pytest.raises(ModelConfigError, match="layer types \\['sliding_attention'\\] are not supported"):
        ModelConfig.from_hf_dict(tiny_hf_config("qwen3", layer_types=["sliding_attention", "full_attention"]))


def test_transformers_patch_refuses_gpt_oss():
    from rlalign.integrations.transformers import UnsupportedModelError, patch
    with pytest.raises(UnsupportedModelError, match="GptOssForCausalLM is not supported by the patch"):
        patch(_hf_model(4, layers=2))


def test_tensor_parallelism_is_refused():
    from rlalign.contract.errors import RLAlignError
    from rlalign.distributed.parallelize import check_tp
    config = ModelConfig.from_hf_dict(tiny_hf_config("gpt_oss"))
    check_tp(config, 1)
    with pytest.raises(RLAlignError, match="tp=2: tensor parallelism is not implemented for gpt_oss models"):
        check_tp(config, 2)
