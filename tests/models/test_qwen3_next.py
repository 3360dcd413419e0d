"""Qwen3-Next: config, weights and logits against transformers' Qwen3NextForCausalLM; the bitwise chunking contract
of its Gated-DeltaNet layers (packed == any chunked prefill / decode through the paged cache); refusals.

A tiny random-init ``Qwen3NextForCausalLM`` written by transformers itself (linear-attention layers with 2 value
heads per key head, gated full attention with partial rope, zero-centred norms drawn non-zero, A_log and dt_bias
drawn) loads in rlalign and gives transformers' fp32 logits within 1e-5 x |z|max (float64 reference: the
transformers model cast to float64, its pure-torch chunked rule); rlalign's save is byte-for-byte transformers'
tensors and loads back in transformers with the same logits.
"""

import dataclasses
import json
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign.contract import spec, use_profile
from rlalign.models import ForwardBatch, KVCache, load_model, save_model
from rlalign.models.attention_kinds import build_attention, layer_attention_kind
from rlalign.models.batch import contiguous_block_tables
from rlalign.models.gated_deltanet import GatedDeltaNet
from rlalign.models.qwen3_next import GatedAttention
from rlalign.models.config import ModelConfig, ModelConfigError
from rlalign.models.testing import tiny_hf_config, tiny_model
from tests.models.hf_helpers import assert_same_weight_file, assert_within_reference, strict_logits64
from tests.bitwise import assert_bitwise_equal

transformers = pytest.importorskip("transformers")

VOCAB = 320
C = spec.GDN_CHUNK


# sparse layers: 6 experts of 24, top-2, a shared expert of 40 (hidden 64)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)


def _hf_model(layer_types, seed: int = 0, **moe):
    """transformers' model (fp32, eager), dense MLPs unless ``moe`` gives the MoE keys (e.g. MOE, mlp_only_layers)."""
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=layer_types,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, max_position_embeddings=256, pad_token_id=0, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        **{"num_experts": 0, **moe})
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM._from_config(cfg, attn_implementation="eager",
                                                           experts_implementation="eager").float().eval()
    with torch.no_grad():   # zero-centred norms start at 0 and the gated norm at 1: draw them so that they count
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 1.0)   # O(1) router logits (clear top-k choices) and gates away from 1/2
    return model


@pytest.mark.parametrize("layer_types", [
    ["linear_attention", "full_attention"],
    ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    ["full_attention", "linear_attention"],
], ids=["LF", "LLLF", "FL"])
def test_logits_match_transformers(tmp_path, layer_types):
    hf = _hf_model(layer_types)
    hf.save_pretrained(tmp_path / "hf")
    model, config = load_model(tmp_path / "hf", dtype="float32")
    assert config.layer_types == tuple(layer_types) and config.rotary_dim == 8
    ids = torch.randint(3, VOCAB, (C + 37,), generator=torch.Generator().manual_seed(len(layer_types))).tolist()
    with torch.no_grad():
        ref = hf.double()(torch.tensor([ids])).logits[0]
    got = strict_logits64(model, ids)
    assert_within_reference(got, ref)


@pytest.mark.parametrize("layer_types, moe, want", [
    (["linear_attention", "full_attention"], dict(MOE), [0, 1]),
    (["linear_attention", "linear_attention", "full_attention"], dict(MOE, mlp_only_layers=[1], norm_topk_prob=False),
     [0, 2]),
    (["full_attention", "linear_attention", "linear_attention", "full_attention"],
     dict(MOE, decoder_sparse_step=2, num_experts_per_tok=3), [1, 3]),
], ids=["LF-all-sparse", "LLF-mlp-only-1-unnormalised", "FLLF-step-2-top-3"])
def test_sparse_logits_match_transformers(tmp_path, layer_types, moe, want):
    """Sparse layers (routed experts + the gated shared expert) mixed with dense ones by mlp_only_layers and
    decoder_sparse_step; the sparse layers are where transformers puts them and record their routing."""
    from rlalign.models.moe import SharedExpertMoE, record_routing, sparse_layer_indices
    hf = _hf_model(layer_types, seed=4, **moe)
    hf.save_pretrained(tmp_path / "hf")
    model, config = load_model(tmp_path / "hf", dtype="float32")
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "shared_expert_gate")] == want
    assert [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SharedExpertMoE)] == want
    assert sparse_layer_indices(config) == want
    ids = torch.randint(3, VOCAB, (C + 21,), generator=torch.Generator().manual_seed(len(layer_types))).tolist()
    with torch.no_grad():
        ref = hf.double()(torch.tensor([ids])).logits[0]
    with record_routing(keep_logits=False) as record:
        got = strict_logits64(model, ids)
    assert_within_reference(got, ref)
    assert record.layer_indices == want and record.expert_ids().shape == (len(ids), len(want), config.ffn_options[
        "num_experts_per_tok"])


def test_sparse_save_is_transformers_file_and_loads_back_in_transformers(tmp_path):
    """Per-expert tensors (what transformers 5 writes from its fused gate_up_proj), the router, the shared expert
    and its [1, hidden] gate: byte for byte; config.json's MoE keys back."""
    hf = _hf_model(["linear_attention", "full_attention"], **MOE, mlp_only_layers=[0])
    hf.save_pretrained(tmp_path / "hf")
    model, config = load_model(tmp_path / "hf", dtype="float32")
    save_model(model, tmp_path / "ours")
    assert_same_weight_file(tmp_path / "hf", tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert {k: written[k] for k in (*MOE, "mlp_only_layers", "norm_topk_prob")} == dict(MOE, mlp_only_layers=[0],
                                                                                       norm_topk_prob=True)
    again = ModelConfig.from_hf_dict(written)
    assert dataclasses.replace(again, extra={}) == dataclasses.replace(config, extra={})
    back = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32,
                                                             attn_implementation="eager",
                                                             experts_implementation="eager").eval()
    theirs = hf.state_dict()
    for name, t in back.state_dict().items():   # the same weights (the logits then agree up to GEMM layouts)
        assert torch.equal(t, theirs[name]), name
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        assert_within_reference(back(ids).logits, hf(ids).logits, rel=1e-6)


def test_save_is_transformers_file_and_loads_back_in_transformers(tmp_path):
    hf = _hf_model(["linear_attention", "full_attention"])
    hf.save_pretrained(tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf", dtype="float32")
    save_model(model, tmp_path / "ours")
    assert_same_weight_file(tmp_path / "hf", tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["model_type"] == "qwen3_next" and config["linear_num_value_heads"] == 4
    back = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    assert back.config.layer_types == hf.config.layer_types
    assert back.config.rope_parameters["partial_rotary_factor"] == 0.5
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)


def test_config_round_trip_keeps_every_feature():
    config = ModelConfig.from_hf_dict(tiny_hf_config("qwen3_next"))
    again = ModelConfig.from_hf_dict(config.to_hf_dict())
    assert again == config
    assert config.linear_attention == {"num_k_heads": 2, "num_v_heads": 4, "k_head_dim": 8, "v_head_dim": 8,
                                       "conv_kernel": 4}
    assert config.zero_centred_norms and config.attention_kind == "gated" and config.partial_rotary_factor == 0.5
    assert config.ffn_kind == "dense"


def test_moe_config_round_trip_and_transformers_defaults():
    config = ModelConfig.from_hf_dict(tiny_hf_config("qwen3_next_moe", mlp_only_layers=[1]))
    assert config.ffn_kind == "moe" and config.ffn_options == {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": [1]}
    again = ModelConfig.from_hf_dict(config.to_hf_dict())
    assert (again.ffn_kind, again.ffn_options) == (config.ffn_kind, config.ffn_options)
    assert again.to_hf_dict() == config.to_hf_dict()
    # keys left out take Qwen3NextConfig's defaults (512 experts of 512, top-10, a shared expert of 512)
    bare = {k: v for k, v in tiny_hf_config("qwen3_next").items() if k != "num_experts"}
    defaults = ModelConfig.from_hf_dict(bare).ffn_options
    hf_defaults = transformers.Qwen3NextConfig()
    assert {k: v for k, v in defaults.items() if k != "mlp_only_layers"} == {
        k: getattr(hf_defaults, k) for k in defaults if k != "mlp_only_layers"}


# ---- the chunking contract: packed == chunked prefill == decode, bit for bit -------------------------------------

_MODEL = {}


def _bitwise_model(dtype: str):
    if dtype not in _MODEL:
        _MODEL[dtype] = tiny_model("qwen3_next", seed=2, init_std=0.2, dtype=dtype,
                                   layer_types=["linear_attention", "full_attention", "linear_attention"],
                                   num_hidden_layers=3)
    return _MODEL[dtype]


_LENGTHS = st.one_of(st.sampled_from([1, C - 1, C, C + 1, 2 * C]), st.integers(1, 2 * C + 5))


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(_LENGTHS, min_size=1, max_size=3), cut_seed=st.integers(0, 2**16),
       page_size=st.sampled_from([1, 5, 16, 64, 128]), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_packed_equals_any_chunked_prefill_and_decode(lengths, cut_seed, page_size, dtype):
    """Each sequence is fed to the paged cache in random pieces (one-token decode steps, prefill chunks across and
    ending on chunk boundaries, several sequences per forward); every hidden row equals the packed forward's."""
    check_random_pieces(_bitwise_model(dtype), lengths, cut_seed, page_size)


def check_random_pieces(model, lengths, cut_seed: int, page_size: int) -> None:
    """The packed forward of random sequences of ``lengths`` vs feeding them to a paged cache in random pieces on
    the model's device (also tests/cuda/test_cuda_qwen3_next.py): hidden rows bit for bit."""
    rng = random.Random(cut_seed)
    device = model.device
    seqs = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    with use_profile("strict"), torch.no_grad():
        packed = model.forward_hidden(ForwardBatch.packed(seqs, device))
        tables = contiguous_block_tables(lengths, page_size)
        cache = KVCache.for_model(model.config, sum(len(t) for t in tables), page_size, model.dtype, device)
        done, pieces = [0] * len(seqs), [[] for _ in seqs]
        while any(d < n for d, n in zip(done, lengths)):
            live = [i for i, n in enumerate(lengths) if done[i] < n and rng.random() < 0.8] or \
                [next(i for i, n in enumerate(lengths) if done[i] < n)]
            new = [seqs[i][done[i]:done[i] + rng.choice([1, 1, 2, C - done[i] % C, C + 3, 40])] for i in live]
            hidden = model.forward_hidden(ForwardBatch.extend(new, [done[i] for i in live], cache,
                                                              [tables[i] for i in live], device=device))
            offset = 0
            for i, chunk in zip(live, new):
                pieces[i].append(hidden[offset:offset + len(chunk)])
                offset += len(chunk)
                done[i] += len(chunk)
    assert_bitwise_equal(torch.cat([torch.cat(p) for p in pieces]), packed, "paged pieces vs packed")


# ---- refusals ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5 must be between 1 and num_experts=4"),
    (dict(num_experts=4, num_experts_per_tok=0), "num_experts_per_tok=0 must be between 1"),
    (dict(num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=0),
     "shared_expert_intermediate_size=0 must be >= 1"),
    (dict(num_local_experts=4), "qwen3_next reads num_experts, not num_local_experts"),
    (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers is not a Qwen3-Next key"),
    (dict(layer_types=["linear_attention", "sliding_attention"]), "layer types \\['sliding_attention'\\]"),
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries for 2 layers"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
    (dict(partial_rotary_factor=0.1), "partial_rotary_factor=0.1 gives 1 rotary dims"),
    (dict(attention_bias=True), "attention_bias=true is not supported for qwen3_next"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim must be an integer >= 1"),
])
def test_config_refusals(change, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf_dict(tiny_hf_config("qwen3_next", **change))


def test_dense_when_mlp_only_layers_cover_every_layer():
    config = ModelConfig.from_hf_dict(tiny_hf_config("qwen3_next", num_experts=8, mlp_only_layers=[0, 1]))
    assert config.ffn_kind == "dense"


def test_partial_rotary_is_refused_for_other_families():
    with pytest.raises(ModelConfigError, match="partial_rotary_factor != 1 is not supported"):
        ModelConfig.from_hf_dict(tiny_hf_config("qwen3", partial_rotary_factor=0.5))


def test_transformers_patch_and_tensor_parallelism_are_refused():
    from rlalign.contract.errors import RLAlignError
    from rlalign.distributed.parallelize import check_tp
    from rlalign.integrations.transformers import UnsupportedModelError, patch
    with pytest.raises(UnsupportedModelError, match="Qwen3NextForCausalLM is not supported by the patch"):
        patch(_hf_model(["linear_attention", "full_attention"]))
    for variant in ("qwen3_next", "qwen3_next_moe"):
        config = ModelConfig.from_hf_dict(tiny_hf_config(variant))
        check_tp(config, 1)
        with pytest.raises(RLAlignError, match="tp=2: tensor parallelism is not implemented for qwen3_next models"):
            check_tp(config, 2)


def test_native_profile_is_refused_in_one_line():
    from rlalign.contract.errors import RLAlignError
    model = _bitwise_model("float32")
    with use_profile("native"), torch.no_grad(), pytest.raises(RLAlignError, match="native profile has no "
                                                                               "Gated-DeltaNet route"):
        model.forward_hidden(ForwardBatch.packed([[3, 4, 5]]))


@pytest.mark.parametrize("moe", [{}, dict(MOE, mlp_only_layers=[0])], ids=["dense", "sparse-layer-1"])
def test_gradients_match_transformers_float64_autograd(tmp_path, moe):
    """d(sum(w * logits)) by every weight of the model (the linear-attention layer's included: A_log, dt_bias, the
    conv, the gated norm; a sparse layer's router, experts, shared expert and its gate) against transformers' model
    in float64, over a sequence that crosses a chunk boundary."""
    hf = _hf_model(["linear_attention", "full_attention"], seed=3, **moe)
    hf.save_pretrained(tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf", dtype="float32")
    ids = torch.randint(3, VOCAB, (C + 9,), generator=torch.Generator().manual_seed(5)).tolist()
    w = torch.randn(len(ids), VOCAB, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    with use_profile("strict"):
        h = model.forward_hidden(ForwardBatch.packed([ids]))
        (h.double() @ model.lm_head_weight.double().T * w).sum().backward()
    hf = hf.double()
    (hf(torch.tensor([ids])).logits[0] * w).sum().backward()
    theirs = {name: p.grad for name, p in hf.named_parameters()}
    for name, grad in list(theirs.items()):   # transformers' fused experts.gate_up_proj [E, 2I, H]: gate rows first
        if name.endswith("experts.gate_up_proj"):
            prefix, half = name.removesuffix("gate_up_proj"), grad.shape[1] // 2
            theirs[prefix + "gate_proj"], theirs[prefix + "up_proj"] = grad[:, :half], grad[:, half:]
    for name, p in model.named_parameters():
        ref = theirs[name]
        err = (p.grad.double() - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), f"{name}: max |diff| {err:.3g} vs {ref.abs().max().item():.3g}"


def test_transformers_default_config_is_the_sparse_model():
    """Qwen3NextConfig()'s own config.json (the 80B-A3B shape: 48 layers, every 4th full attention, 512 experts,
    top-10, shared expert 512) parses to sparse layers everywhere; nothing is built."""
    from rlalign.models.moe import sparse_layer_indices
    config = ModelConfig.from_hf_dict(transformers.Qwen3NextConfig().to_dict())
    assert config.ffn_kind == "moe" and sparse_layer_indices(config) == list(range(48))
    assert config.ffn_options["num_experts"] == 512 and config.ffn_options["num_experts_per_tok"] == 10
    assert config.layer_types.count("full_attention") == 12 and config.rotary_dim == 64


def test_multi_token_prediction_tensors_are_ignored_on_load(tmp_path):
    """mtp.* tensors (mtp_num_hidden_layers > 0) are ignored, as transformers ignores
    them; without the key they are unexpected tensors."""
    from safetensors.torch import load_file, save_file
    from rlalign.models.checkpoint import CheckpointError
    model = tiny_model("qwen3_next_moe", seed=1)
    path = save_model(model, tmp_path / "m", checksums=False)
    tensors = load_file(path / "model.safetensors")
    tensors.update({"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.mlp.gate.weight": torch.zeros(8, 64)})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, mtp_num_hidden_layers=1)))
    again, _ = load_model(path)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert_bitwise_equal(a, b, name)
    (path / "config.json").write_text(json.dumps(dict(config, mtp_num_hidden_layers=0)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'mtp.fc.weight'"):
        load_model(path)


def test_each_layer_asks_the_attention_kind_registry():
    """Qwen3-Next's layers come from the registry: "linear" (Gated-DeltaNet, under ``linear_attn``) on the
    linear-attention layers, "gated" (under ``self_attn``) on the full-attention ones; an unknown kind is one line."""
    model = tiny_model("qwen3_next")
    config = model.config
    assert [layer_attention_kind(config, i) for i in range(config.num_layers)] == ["linear", "gated"]
    linear, full = model.model.layers
    assert linear.mixer_name == "linear_attn" and isinstance(linear.linear_attn, GatedDeltaNet)
    assert full.mixer_name == "self_attn" and isinstance(full.self_attn, GatedAttention)
    with pytest.raises(ModelConfigError, match="attention kind 'absorbed' is not implemented"):
        build_attention(dataclasses.replace(config, attention_kind="absorbed"), 1, torch.float32, "meta")
