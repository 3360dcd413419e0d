"""Checkpoint directories: round trips (single file, sharded, bf16), interop with transformers,
atomic saves, the tokenizer, and one-line errors naming the tensor and the file."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlalign.models import (CheckpointError, ForwardBatch, TokenizerError, load_model, load_tokenizer, save_model,
                            weights_hash)
from rlalign.models import checkpoint as ckpt
from rlalign.models.testing import make_tiny_checkpoint, tiny_model
from tests.bitwise import assert_bitwise_equal, assert_close_report

SEQS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32, 79]]


def hidden(model):
    with torch.no_grad():
        return model.forward_hidden(ForwardBatch.packed(SEQS))


@pytest.mark.parametrize("family, dtype, tied", [("qwen3", "float32", True), ("qwen2", "bfloat16", False),
                                                 ("llama", "float32", False)])
def test_round_trip_single_and_sharded(tmp_path, family, dtype, tied):
    model = tiny_model(family, seed=2, dtype=dtype, init_std=0.1, norm_jitter=0.1, tie_word_embeddings=tied)
    ref = hidden(model)
    single = save_model(model, tmp_path / "single")
    sharded = save_model(model, tmp_path / "sharded", max_shard_bytes=20_000)
    assert (single / "model.safetensors").is_file()
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    assert ("lm_head.weight" in load_file(single / "model.safetensors")) == (not tied)
    for path in (single, sharded):
        loaded, config = load_model(path)
        assert config == model.config and loaded.dtype == model.dtype
        assert weights_hash(loaded) == weights_hash(model)
        assert_bitwise_equal(hidden(loaded), ref, f"{path.name} forward after reload")


def test_dtype_override_and_hash(tmp_path):
    model = tiny_model("qwen3", seed=4, dtype="bfloat16")
    path = save_model(model, tmp_path / "m")
    as_fp32, _ = load_model(path, dtype="float32")
    assert as_fp32.dtype == torch.float32
    for (name, p), (_, q) in zip(model.named_parameters(), as_fp32.named_parameters()):
        assert_bitwise_equal(q, p.float(), name)  # bf16 -> fp32 is exact
    assert weights_hash(as_fp32) != weights_hash(model)
    other = tiny_model("qwen3", seed=4, dtype="bfloat16")
    assert weights_hash(other) == weights_hash(model)
    with torch.no_grad():
        other.model.layers[1].mlp.up_proj.weight[3, 5] += 1
    assert weights_hash(other) != weights_hash(model)


@pytest.mark.parametrize("family, shard", [("qwen3", None), ("qwen2", 30_000), ("llama", None)])
def test_saved_model_loads_in_transformers(tmp_path, family, shard):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(family, seed=5, init_std=0.15, norm_jitter=0.2, tie_word_embeddings=family == "qwen3")
    path = save_model(model, tmp_path / "m", max_shard_bytes=shard)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert hf.config.tie_word_embeddings == (family == "qwen3")
    with torch.no_grad():
        ours = model.logits(hidden(model))
        theirs = torch.cat([hf(input_ids=torch.tensor([s])).logits[0] for s in SEQS])
    assert_close_report(ours, theirs, atol=1e-5, rtol=1e-5, what=f"{family} saved by rlalign, run by transformers")


def test_save_is_atomic(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    first = tiny_model("qwen3", seed=1)
    save_model(first, target)
    save_model(tiny_model("qwen3", seed=2), target)  # replaces
    assert weights_hash(load_model(target)[0]) == weights_hash(tiny_model("qwen3", seed=2))

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_write_tensors", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model(first, target)
    assert weights_hash(load_model(target)[0]) == weights_hash(tiny_model("qwen3", seed=2))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left behind


def test_tokenizer_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = make_tiny_checkpoint(tmp_path / "m")
    ours, theirs = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    for text in ["What is 12 + 7? The answer is 19.", "héllo wörld 世界 \n\t tabs", ""]:
        assert ours.encode(text) == theirs(text)["input_ids"]
        assert ours.decode(ours.encode(text)) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    expected = theirs.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ours.apply_chat_template(msgs) == expected
    assert ours.encode("hi", chat=True) == ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ours.eos_token_ids[0] == theirs.eos_token_id and set(ours.eos_token_ids) == {0, 2}


def test_tokenizer_errors(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer(path).encode("hi", chat=True)
    (path / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="missing tokenizer.json"):
        load_tokenizer(path)


# ---- errors -----------------------------------------------------------------------------------

@pytest.fixture
def ckpt_dir(tmp_path):
    return make_tiny_checkpoint(tmp_path / "m", "qwen3")


def rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "checksums.json").unlink(missing_ok=True)   # a hand-edited checkpoint: no sidecar to match


def expect_error(path, *fragments):
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_missing_config(ckpt_dir):
    (ckpt_dir / "config.json").unlink()
    expect_error(ckpt_dir, "missing config.json", str(ckpt_dir))


def test_unsupported_config(ckpt_dir):
    config = json.loads((ckpt_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (ckpt_dir / "config.json").write_text(json.dumps(config))
    expect_error(ckpt_dir, "config.json", "yarn")


def test_missing_tensor(ckpt_dir):
    rewrite(ckpt_dir, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    expect_error(ckpt_dir, "missing tensor 'model.layers.1.self_attn.k_norm.weight'")


def test_unexpected_tensor(ckpt_dir):
    rewrite(ckpt_dir, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    expect_error(ckpt_dir, "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'", "model.safetensors")


def test_shape_mismatch(ckpt_dir):
    rewrite(ckpt_dir, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(100, 64)}))
    expect_error(ckpt_dir, "'model.layers.0.mlp.up_proj.weight' has shape (100, 64)", "(128, 64)",
                 "model.safetensors")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_file(ckpt_dir, damage):
    f = ckpt_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
    expect_error(ckpt_dir, "model.safetensors", "cannot read safetensors file")


def test_sharded_errors(tmp_path):
    path = save_model(tiny_model("llama"), tmp_path / "m", max_shard_bytes=30_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    tensors = load_file(path / shard)
    tensors.pop(name)
    save_file(tensors, path / shard, metadata={"format": "pt"})
    expect_error(path, f"tensor {name!r} is listed in model.safetensors.index.json but not in the file", shard)
    (path / shard).unlink()
    expect_error(path, "missing shard", shard)


def test_tolerated_extras(ckpt_dir, tmp_path):
    """As in transformers: lm_head.weight of a tied model and old rotary inv_freq buffers are ignored."""
    tied = make_tiny_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    rewrite(tied, lambda t: t.update({"lm_head.weight": torch.ones(320, 64),
                                      "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    model, _ = load_model(tied)
    assert model.lm_head is None and model.lm_head_weight is model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head_weight, torch.ones(320, 64))


def test_no_weights(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m")
    (path / "model.safetensors").unlink()
    expect_error(path, "no model.safetensors")


def test_a_bare_cuda_device_stages_tensors_on_the_current_gpu(monkeypatch, tmp_path):
    """safetensors reads "cuda" as GPU 0; rank r of a multi-GPU job (model.device=cuda, current device r) must
    load onto its own GPU, so a bare "cuda" is made explicit as the current device before safetensors sees it."""
    import safetensors

    opened = []

    def fake_open(path, framework, device):
        opened.append(device)
        raise RuntimeError("stop here")

    monkeypatch.setattr(safetensors, "safe_open", fake_open)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    cases = [("cuda", "cuda:3"), (torch.device("cuda"), "cuda:3"), ("cuda:1", "cuda:1"), ("cpu", "cpu")]
    for device, _ in cases:
        with pytest.raises(CheckpointError, match="stop here"):
            ckpt._load_file(tmp_path / "model.safetensors", None, {}, set(), None, device)
    assert opened == [expected for _, expected in cases]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("start, moved", [("float32", torch.bfloat16), ("bfloat16", torch.float32)])
def test_a_moved_model_saves_and_reloads_in_its_new_dtype(tmp_path, family, start, moved):
    """``.to(dtype)`` updates config.dtype (what config.json records), so the checkpoint reloads with the tensors'
    dtype and the same bits, not the dtype the model was built with."""
    from rlalign.models.checkpoint import load_model, save_model, weights_hash
    from rlalign.models.testing import tiny_model
    model = tiny_model(family, dtype=start).to(moved)
    assert model.config.dtype == str(moved).removeprefix("torch.")
    save_model(model, tmp_path / "ckpt")
    loaded = load_model(tmp_path / "ckpt")[0]
    assert loaded.dtype == moved and weights_hash(loaded) == weights_hash(model)
