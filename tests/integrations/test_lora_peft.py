"""LoRA in PEFT's format, both ways, and PEFT-wrapped models under the transformers patch.

peft loads an adapter rlalign wrote onto the Hugging Face model and computes rlalign's outputs (within float
tolerance: other kernels); rlalign loads an adapter peft wrote; a patched PEFT model gives rlalign's trainer's
log-probs and adapter gradients bit for bit; what either side cannot run the same way is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from rlalign.models import ForwardBatch, load_model, next_token_targets
from rlalign.models.lora import (LoRAError, LoRASpec, adapter_parameters, apply_lora, load_adapter, read_adapter,
                                 save_adapter)
from rlalign.models.testing import tiny_model
from tests.bitwise import assert_bitwise_equal

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from rlalign.integrations.transformers import (  # noqa: E402
    UnsupportedModelError, from_pretrained, patch, token_logprobs)
from rlalign.integrations.transformers_parity import padded_batch  # noqa: E402

SEQS = [[5, 9, 33, 71, 2, 100, 17], [7, 8, 250], [44]]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]


def _quiet():
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _hf(path, dtype=torch.float32):
    _quiet()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def _randomize_b(named_params, seed=0, std=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_params:
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=g) * std).to(p.dtype))


def _ours(path, targets, rank=3, dtype="float32"):
    model, _ = load_model(path, dtype=dtype)
    apply_lora(model, LoRASpec(rank=rank, alpha=5.0, targets=tuple(targets)), seed=1)
    _randomize_b(adapter_parameters(model))
    return model


def _logits(model, seqs=SEQS):
    with torch.no_grad():
        return model.logits(model.forward_hidden(ForwardBatch.packed(seqs)))


def test_peft_loads_our_adapter_and_computes_our_outputs(hf_checkpoints, tmp_path):
    path = hf_checkpoints[("qwen3", "float32", False)]
    ours = _ours(path, ALL)
    save_adapter(ours, LoRASpec(rank=3, alpha=5.0, targets=tuple(ALL)), tmp_path / "adapter", base_model=str(path))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 3, 5.0)
    wrapped = peft.PeftModel.from_pretrained(_hf(path), str(tmp_path / "adapter"))
    ids, mask = padded_batch(SEQS, "cpu")
    with torch.no_grad():
        theirs = wrapped(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        with wrapped.disable_adapter():
            plain = wrapped(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    mine = _logits(ours)
    assert (theirs - plain).abs().max() > 1e-2, "the adapter changes nothing: the test would prove little"
    assert torch.allclose(theirs, mine, atol=1e-4, rtol=1e-4), (theirs - mine).abs().max()


@pytest.mark.parametrize("targets", [ATTN, ["q_proj", "v_proj"], ".*\\.(q_proj|down_proj)"])
def test_we_load_an_adapter_peft_wrote(hf_checkpoints, tmp_path, targets):
    path = hf_checkpoints[("llama", "float32", False)]
    wrapped = peft.get_peft_model(_hf(path), peft.LoraConfig(r=2, lora_alpha=7, target_modules=targets,
                                                            lora_dropout=0.0))
    _randomize_b(wrapped.named_parameters(), seed=3)
    wrapped.save_pretrained(str(tmp_path / "theirs"))
    spec, tensors = read_adapter(tmp_path / "theirs")
    names = ["q_proj", "down_proj"] if isinstance(targets, str) else targets
    assert (spec.rank, spec.alpha, sorted(spec.targets)) == (2, 7.0, sorted(names))
    model, _ = load_model(path)
    load_adapter(model, tmp_path / "theirs")
    ids, mask = padded_batch(SEQS, "cpu")
    with torch.no_grad():
        theirs = wrapped(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert torch.allclose(_logits(model), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case,targets", [(("qwen3", "float32", False), ALL), (("qwen3", "bfloat16", True), ALL),
                                          (("qwen3_moe", "float32", False), ATTN)], ids=str)
def test_patched_peft_model_equals_rlalign_trainer_bitwise(hf_checkpoints, tmp_path, case, targets):
    """One loss on the same tokens: the patched PEFT model's log-probs and adapter gradients have the bits of
    rlalign's adapted CausalLM (the same adapter loaded on both sides)."""
    path, dtype = hf_checkpoints[case], getattr(torch, case[1])
    ours = _ours(path, targets, dtype=case[1])
    save_adapter(ours, LoRASpec(rank=3, alpha=5.0, targets=tuple(targets)), tmp_path / "adapter")
    # autocast_adapter_dtype=False: PEFT would otherwise hold bf16 models' adapters in fp32 (other numbers)
    wrapped = patch(peft.PeftModel.from_pretrained(from_pretrained(path), str(tmp_path / "adapter"),
                                                   is_trainable=True, autocast_adapter_dtype=False))
    batch = ForwardBatch.packed(SEQS)
    lp, _ = ours.logprobs(batch, next_token_targets(SEQS), temperature=0.8)
    keep = torch.ones(batch.num_tokens, dtype=torch.bool)
    keep[batch.cu_seqlens[1:].long() - 1] = False
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2)) * keep
    (-(lp * adv).sum()).backward()
    ids, mask = padded_batch(SEQS, "cpu")
    out = token_logprobs(wrapped, ids, mask, temperature=0.8)
    assert_bitwise_equal(out.logprobs[mask.bool()][keep], lp.detach()[keep], f"{case} logprobs")
    adv_padded = torch.zeros(ids.shape)
    adv_padded[mask.bool()] = adv
    (-(out.logprobs * adv_padded).sum()).backward()
    theirs = {n.removeprefix("base_model.model.").replace(".default", "").replace(".base_layer", ""): p
              for n, p in wrapped.named_parameters()}
    trained = [n for n, p in theirs.items() if p.requires_grad]
    assert sorted(trained) == sorted(n for n, _ in adapter_parameters(ours))
    for name, p in adapter_parameters(ours):
        assert_bitwise_equal(theirs[name].grad, p.grad, f"{case} grad of {name}")


def test_wrapping_a_patched_model_is_caught_and_repatching_fixes_it(hf_checkpoints):
    """PEFT wrapping an already patched model would run its adapters on vendor kernels: the forward refuses in
    one line; patch() on the wrapped model binds the new layers."""
    path = hf_checkpoints[("qwen3", "float32", False)]
    wrapped = peft.get_peft_model(from_pretrained(path), peft.LoraConfig(r=2, target_modules=ATTN))
    ids, mask = padded_batch(SEQS, "cpu")
    with pytest.raises(UnsupportedModelError, match="layers.0.self_attn.q_proj was replaced after patch"):
        token_logprobs(wrapped, ids, mask)
    patch(wrapped)
    assert token_logprobs(wrapped, ids, mask).logprobs.isfinite().all()


def test_refusals(hf_checkpoints, tmp_path):
    path = hf_checkpoints[("qwen3", "float32", False)]
    dropout = peft.get_peft_model(_hf(path), peft.LoraConfig(r=2, target_modules=ATTN, lora_dropout=0.1))
    with pytest.raises(UnsupportedModelError, match="PEFT LoRA layer.*lora_dropout=0.1 .* strict profile forbids"):
        patch(dropout)
    patch(dropout, "native")   # native: no contract to break
    dora = peft.get_peft_model(_hf(path), peft.LoraConfig(r=2, target_modules=ATTN, use_dora=True))
    with pytest.raises(UnsupportedModelError, match="DoRA is not supported"):
        patch(dora)
    dora.save_pretrained(str(tmp_path / "dora"))
    with pytest.raises(LoRAError, match="use_dora=True is not supported"):
        read_adapter(tmp_path / "dora")
    with pytest.raises(LoRAError, match="is not a PEFT adapter folder"):
        read_adapter(tmp_path)
    ours = _ours(path, ATTN)
    save_adapter(ours, LoRASpec(rank=3, alpha=5.0, targets=tuple(ATTN)), tmp_path / "a")
    other = tiny_model("qwen3", head_dim=8)   # q/k/v/o of other sizes
    with pytest.raises(LoRAError, match="has shape"):
        load_adapter(other, tmp_path / "a")
    with pytest.raises(LoRAError, match="already exists and is not empty"):
        save_adapter(ours, LoRASpec(rank=3, alpha=5.0, targets=tuple(ATTN)), tmp_path / "a")
