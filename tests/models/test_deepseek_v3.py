"""DeepSeek-V3: config, weights and logits against transformers' DeepseekV3ForCausalLM; refusals.

Random tiny configs (hypothesis: q_lora_rank null or set, interleaved rope or not, dense-only or with MoE layers,
1-4 expert groups, V heads narrower than K heads, attention biases, default or YaRN rope with mscale_all_dim)
written by transformers itself, with O(1) random weights and a non-zero ``e_score_correction_bias``, load in
rlalign and give transformers' logits within 1e-5 x |z|max in fp32 (float64 reference: the transformers model in
float64 on the same fp32-representable weights); rlalign's save is byte-for-byte transformers' file and loads back
in transformers with the same logits.
"""

from __future__ import annotations

import json
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from rlalign.models import ForwardBatch, load_model, save_model
from rlalign.models.checkpoint import CheckpointError
from rlalign.models.config import ModelConfig, ModelConfigError
from rlalign.models.deepseek_v3 import DeepseekMoE, MLAttention
from rlalign.models.testing import tiny_hf_config, tiny_model
from rlalign.contract import use_profile
from tests.bitwise import assert_bitwise_equal, assert_close_report
from tests.models.hf_helpers import assert_same_weight_file, hf_model, hf_padded_logits, round_weights_

transformers = pytest.importorskip("transformers")

SEQS = [[3, 5, 7, 9, 11, 13, 2] * 6, [4, 4, 4], [17], [8, 30, 31, 99, 100, 5, 6, 7, 250, 251, 2, 3, 4, 5, 6]]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}


def hf_deepseek(seed: int, **overrides):
    """transformers' model (float64) with hf_model's O(1) weights, score-correction biases ~ N(0, 0.3^2), every
    value fp32-representable."""
    model = hf_model("deepseek_v3", seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_((0.3 * torch.randn(buf.shape, generator=gen)).double())
    return round_weights_(model, torch.float32)


@st.composite
def configs(draw):
    layers = draw(st.integers(1, 3))
    n_group, size = draw(st.integers(1, 4)), draw(st.integers(2, 4))
    topk_group = draw(st.integers(1, n_group))
    nope, rope = draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from([2, 4, 8]))
    return dict(
        num_hidden_layers=layers, first_k_dense_replace=draw(st.integers(0, layers)), hidden_size=32,
        num_attention_heads=(heads := draw(st.sampled_from([1, 2, 4]))), num_key_value_heads=heads,
        q_lora_rank=draw(st.sampled_from([None, 8, 24])), kv_lora_rank=draw(st.sampled_from([4, 12])),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, head_dim=rope, v_head_dim=draw(st.integers(1, nope + rope)),
        rope_interleave=draw(st.booleans()), attention_bias=draw(st.booleans()), intermediate_size=40,
        n_routed_experts=n_group * size, n_group=n_group, topk_group=topk_group,
        num_experts_per_tok=draw(st.integers(1, topk_group * size)), moe_intermediate_size=16,
        n_shared_experts=draw(st.integers(1, 2)), norm_topk_prob=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
        rope_scaling=draw(st.sampled_from([None, YARN])), max_position_embeddings=64)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), seed=st.integers(0, 1000))
def test_logits_match_transformers(cfg, seed):
    hf = hf_deepseek(seed, **cfg)
    ref = torch.cat(hf_padded_logits(hf, SEQS, "right"))
    with tempfile.TemporaryDirectory() as tmp:
        hf.float().save_pretrained(tmp)
        model, config = load_model(tmp, dtype="float32")
    assert config.attention_kind == "mla" and config.head_dim == cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, DeepseekMoE)]
    assert sparse == list(range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]))
    with use_profile("strict"), torch.no_grad():
        ours = model.logits(model.forward_hidden(ForwardBatch.packed(SEQS)))
    assert_close_report(ours, ref, atol=1e-5 * float(ref.abs().max()), rtol=0.0, what=str(cfg))


def test_save_is_transformers_file_and_loads_back_in_transformers(tmp_path):
    hf = hf_deepseek(3, q_lora_rank=None, rope_interleave=False).float()
    hf.save_pretrained(tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf", dtype="float32")
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, MLAttention) and attn.q_proj is not None and attn.q_a_proj is None
    save_model(model, tmp_path / "ours")
    assert_same_weight_file(tmp_path / "hf", tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["q_lora_rank"] is None and config["head_dim"] == 8
    assert ModelConfig.from_hf_dict(config) == model.config
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32,
                                                              attn_implementation="eager",
                                                              experts_implementation="eager").eval()
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)


def test_bf16_keeps_the_correction_bias_fp32_through_save_and_load(tmp_path):
    model = tiny_model("deepseek_v3", seed=2, init_std=0.2, dtype="bfloat16")
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and not bias.requires_grad
    save_model(model, tmp_path / "m")
    stored = load_file(tmp_path / "m" / "model.safetensors")
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    again, _ = load_model(tmp_path / "m")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert_bitwise_equal(a, b, name)
    cast = tiny_model("deepseek_v3", seed=2, init_std=0.2).to(torch.bfloat16)
    assert_bitwise_equal(cast.model.layers[1].mlp.gate.e_score_correction_bias, bias, "bias after .to(bfloat16)")


def test_multi_token_prediction_layers_are_ignored_on_load(tmp_path):
    model = tiny_model("deepseek_v3", seed=1)
    path = save_model(model, tmp_path / "m", checksums=False)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)        # the MTP layer after the last one
    tensors["model.layers.2.mlp.gate.weight"] = torch.zeros(8, 64)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    for mtp, loads in ((1, True), (0, False)):
        (path / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=mtp)))
        if loads:
            again, _ = load_model(path)
            assert_bitwise_equal(again.lm_head_weight, model.lm_head_weight, "lm head")
        else:
            with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.2"):
                load_model(path)


@pytest.mark.parametrize("change, message", [
    (dict(num_key_value_heads=2), "num_key_value_heads=2 must equal num_attention_heads=4"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantized checkpoints are not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(qk_rope_head_dim=3), "must be even"),
    (dict(v_head_dim=40), "v_head_dim=40 wider than the K head"),
    (dict(n_group=3), "n_routed_experts=8 must split into n_group=3"),
    (dict(n_group=8), "groups of at least 2"),
    (dict(topk_group=3), "topk_group=3 must be between 1 and n_group=2"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 must be between 1 and the 4 experts"),
    (dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope scaling type 'llama3' is not supported"),
    (dict(q_lora_rank=0), "q_lora_rank must be an integer >= 1"),
])
def test_config_refusals(change, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf_dict(tiny_hf_config("deepseek_v3", **change))


def test_tensor_parallelism_and_the_integrations_are_refused():
    from rlalign.contract.errors import RLAlignError
    from rlalign.distributed.parallelize import check_tp
    from rlalign.integrations.transformers import UnsupportedModelError, patch
    from rlalign.models import architectures
    config = ModelConfig.from_hf_dict(tiny_hf_config("deepseek_v3"))
    check_tp(config, 1)
    with pytest.raises(RLAlignError, match="tp=2: tensor parallelism is not implemented for deepseek_v3 models"):
        check_tp(config, 2)
    assert "DeepseekV3ForCausalLM" not in architectures.integration_architectures()
    with pytest.raises(UnsupportedModelError, match="DeepseekV3ForCausalLM is not supported by the patch"):
        patch(hf_deepseek(0, num_hidden_layers=1))
