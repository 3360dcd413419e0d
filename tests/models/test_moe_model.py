"""Qwen3-MoE: the decoder agrees with transformers' Qwen3MoeForCausalLM, checkpoints round-trip, and
unsupported variants are refused with one line naming the key.

Tolerances as for the dense families (tests/models/test_hf_agreement.py), relative to the largest
reference logit: fp32 1e-5 (measured ~4e-7), bf16 0.02. The float64 reference routes on float64
probabilities; the random draws below have no near-ties, so both sides pick the same experts.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlalign.models import ForwardBatch, load_model
from rlalign.models.checkpoint import save_model
from rlalign.models.config import ModelConfig, ModelConfigError
from rlalign.models.moe import SparseMoE, record_routing
from rlalign.models.testing import tiny_hf_config, tiny_model
from tests.bitwise import assert_bitwise_equal, assert_close_report
from tests.models.hf_helpers import hf_model, hf_padded_logits, round_weights_

transformers = pytest.importorskip("transformers")

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CONFIGS = {
    "norm-topk": dict(MOE, norm_topk_prob=True),
    "no-norm-tied": dict(MOE, norm_topk_prob=False, tie_word_embeddings=True),
    "sparse-step2-3layers": dict(MOE, norm_topk_prob=True, decoder_sparse_step=2, num_hidden_layers=3),
    "mlp-only-top1": dict(MOE, num_experts_per_tok=1, mlp_only_layers=[0], norm_topk_prob=False),
    "16-experts-top4": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24, norm_topk_prob=True),
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 0.02}
SEQS = [[3, 5, 7, 9, 11, 13, 2] * 10, [4, 4, 4], [17], [8, 30, 31, 99, 100, 5, 6, 7, 250, 251, 2, 3, 4, 5, 6]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, dtype, tmp_path):
    hf = round_weights_(hf_model("qwen3_moe", seed=len(name), **CONFIGS[name]), dtype)
    ref = torch.cat(hf_padded_logits(hf, SEQS, "right"))
    hf.to(dtype).save_pretrained(tmp_path)
    hf_low = torch.cat(hf_padded_logits(hf, SEQS, "right"))     # transformers' own forward in ``dtype``
    model, config = load_model(tmp_path)
    assert model.dtype == dtype and config.family == "qwen3_moe" and config.ffn_kind == "moe"
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)]
    expected = [i for i in range(config.num_layers) if i not in CONFIGS[name].get("mlp_only_layers", [])
                and (i + 1) % CONFIGS[name].get("decoder_sparse_step", 1) == 0]
    assert sparse == expected
    with torch.no_grad():
        ours = model.logits(model.forward_hidden(ForwardBatch.packed(SEQS)))
    scale = float(ref.abs().max())
    if dtype == torch.float32:
        assert_close_report(ours, ref, atol=TOL[dtype] * scale, rtol=0.0, what=f"{name} {dtype}")
        return
    # bf16 activations flip near-tie top-k choices against the float64 reference, and a flipped token moves
    # the later tokens of its sequence through attention. transformers' own bf16 forward does the same
    # (measured: 0-9 of 89 tokens per config, ours 0-7): ours must be no worse than about that.
    def tokens_out(logits):
        return int(((logits.double() - ref).abs().amax(dim=-1) > TOL[dtype] * scale).sum())
    ours_out, theirs_out = tokens_out(ours), tokens_out(hf_low)
    assert ours_out <= max(3, 2 * theirs_out), (f"{name}: {ours_out} of {ref.shape[0]} tokens outside "
                                                f"{TOL[dtype]} * |z|max (transformers bf16: {theirs_out})")


def test_checkpoint_round_trip_and_transformers_reads_ours(tmp_path):
    model = tiny_model("qwen3_moe", seed=2, init_std=0.2, **CONFIGS["sparse-step2-3layers"])
    save_model(model, tmp_path / "ours")
    keys = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert keys["num_experts"] == 8 and keys["decoder_sparse_step"] == 2 and keys["model_type"] == "qwen3_moe"
    again, _ = load_model(tmp_path / "ours")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert_bitwise_equal(a, b, name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", experts_implementation="eager").eval()
    with torch.no_grad():
        ours = model.logits(model.forward_hidden(ForwardBatch.packed(SEQS[:2])))
    theirs = torch.cat(hf_padded_logits(hf, SEQS[:2], "right"))
    assert_close_report(ours, theirs, atol=1e-5 * float(theirs.abs().max()), rtol=0.0, what="transformers on our save")


@pytest.mark.parametrize("key,value,match", [
    ("shared_expert_intermediate_size", 64, "shared experts"),
    ("num_experts_per_tok", 9, "num_experts_per_tok=9"),
    ("mlp_bias", True, "mlp_bias"),
    ("attention_bias", True, "attention_bias"),
])
def test_unsupported_variants_are_refused_naming_the_key(key, value, match):
    cfg = tiny_hf_config("qwen3_moe", **{**MOE, key: value})
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf_dict(cfg)


def test_dense_families_refuse_moe_keys():
    with pytest.raises(ModelConfigError, match="num_experts"):
        ModelConfig.from_hf_dict(tiny_hf_config("qwen3", num_experts=8))


def test_routing_record_sees_every_sparse_layer_and_matches_the_taps():
    model = tiny_model("qwen3_moe", seed=1, init_std=0.2, **CONFIGS["sparse-step2-3layers"])
    with torch.no_grad(), record_routing() as record:
        model.forward_hidden(ForwardBatch.packed(SEQS))
    tokens = sum(len(s) for s in SEQS)
    assert sorted(record.layers) == [1]
    (logits, experts), = record.layers[1]
    assert logits.shape == (tokens, 8) and logits.dtype == torch.float32 and experts.shape == (tokens, 2)
    # a sequence alone routes exactly as in the packed batch (routing is per token)
    with torch.no_grad(), record_routing() as alone:
        model.forward_hidden(ForwardBatch.packed(SEQS[1:2]))
    start = len(SEQS[0])
    assert torch.equal(alone.layers[1][0][1], experts[start:start + len(SEQS[1])])


# ---- stacked experts: the model's layout vs the checkpoint's --------------------------------------------

def test_a_sparse_layer_holds_three_stacked_expert_tensors_and_the_router():
    model = tiny_model("qwen3_moe", **CONFIGS["sparse-step2-3layers"])
    sparse = model.model.layers[1].mlp
    assert isinstance(sparse, SparseMoE)
    assert len(list(sparse.parameters())) == 3 + 1
    assert [tuple(p.shape) for p in sparse.experts.parameters()] == [(8, 32, 64), (8, 32, 64), (8, 64, 32)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_is_per_expert_and_round_trips_byte_exact(tmp_path, dtype):
    """Save writes Hugging Face's per-expert tensors (views of the stacked parameters, unstacked), load stacks
    them back: the same bytes for every tensor and the same file bytes when saved again."""
    from safetensors import safe_open
    from rlalign.models.checkpoint import weights_hash
    model = tiny_model("qwen3_moe", seed=3, init_std=0.2, dtype=dtype, **CONFIGS["sparse-step2-3layers"])
    save_model(model, tmp_path / "a")
    with safe_open(str(tmp_path / "a" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
        assert not any(n.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")) for n in names)
        for e in range(8):
            assert_bitwise_equal(f.get_tensor(f"model.layers.1.mlp.experts.{e}.up_proj.weight"),
                                 model.model.layers[1].mlp.experts.up_proj[e], f"expert {e} up_proj")
    again, _ = load_model(tmp_path / "a")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert_bitwise_equal(a, b, name)
    save_model(again, tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert weights_hash(model) == weights_hash(again)

