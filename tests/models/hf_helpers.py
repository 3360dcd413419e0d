"""Random-init transformers models for the agreement tests (transformers is a test dependency)."""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file

from rlalign.contract import use_profile
from rlalign.models import ForwardBatch
from rlalign.models.testing import tiny_hf_config


def hf_model(family: str, seed: int = 0, **overrides):
    """A transformers model of ``family`` in float64 (eager attention) with O(1)-scale random weights:
    matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), biases ~ N(0, 0.2^2), norm weights 1 + N(0, 0.2^2),
    so logits are O(1) and every parameter matters."""
    import transformers

    cfg_dict = tiny_hf_config(family, **overrides)
    cfg_dict.pop("architectures")
    model_type = cfg_dict.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg_dict)
    config._attn_implementation = "eager"
    sparse = "moe" in model_type or model_type == "deepseek_v3"
    extra = {"experts_implementation": "eager"} if sparse else {}   # float64: no grouped_mm
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", **extra)
    model = model.to(torch.float64).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))   # fan_in (3-D expert stacks: [E, out, in])
    return model


def round_weights_(model, dtype: torch.dtype):
    """Round every parameter to ``dtype`` in place (values stay float64)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
    return model


def hf_padded_logits(model, seqs: list[list[int]], side: str = "right") -> list[torch.Tensor]:
    """Logits [len, V] per sequence from one padded forward with an attention mask.

    Right padding runs eager attention; left padding runs SDPA (transformers' default), because
    eager leaves the fully masked rows of left pads NaN, which then leaks through 0 * NaN."""
    model.config._attn_implementation = "eager" if side == "right" else "sdpa"
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    pos = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[i, sl] = torch.tensor(s)
        mask[i, sl] = 1
        pos[i, sl] = torch.arange(len(s))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return [logits[i, :len(s)] if side == "right" else logits[i, width - len(s):] for i, s in enumerate(seqs)]


def assert_same_weight_file(theirs_dir, ours_dir) -> None:
    """The two folders' model.safetensors hold the same tensor names, dtypes and bytes."""
    theirs, ours = load_file(theirs_dir / "model.safetensors"), load_file(ours_dir / "model.safetensors")
    assert sorted(theirs) == sorted(ours)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name].view(torch.uint8), t.view(torch.uint8)), name


def assert_within_reference(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """max |got - ref| <= rel x |ref|max (the families' fp32-vs-float64 logits tolerance)."""
    err = (got - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max |diff| {err:.3g} vs |z|max {ref.abs().max().item():.3g}"


def strict_logits64(model, ids: list[int]) -> torch.Tensor:
    """rlalign's strict packed forward of one sequence, its final hidden states times the LM head in float64."""
    with use_profile("strict"), torch.no_grad():
        h = model.forward_hidden(ForwardBatch.packed([ids]))
    return h.double() @ model.lm_head_weight.double().T
