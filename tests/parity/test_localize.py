"""Planted defects: switch one op of one side to the native profile, or move one rounding point;
the tool must name that op/boundary and layer as the first divergence."""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from rlalign.contract.profiles import use_profile
from rlalign.integrations.transformers_parity import TransformersTrainer
from rlalign.models import load_model
from rlalign.parity.run import ParityOptions, ParityResult, compare_tokens, localize
from rlalign.parity.sides import RLAlignRollout, RLAlignTrainer

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [5, 6, 7, 20, 21, 22, 23, 24]]


def _native(module: torch.nn.Module) -> None:
    """Run ``module`` (and every op inside it) under the native profile."""
    strict_forward = module.forward

    def forward(*args, **kwargs):
        with use_profile("native"):
            return strict_forward(*args, **kwargs)
    module.forward = forward


def _two_roundings(norm: torch.nn.Module) -> None:
    """Move the rounding point of an RMSNorm: round x * inv_rms to the stream dtype, then multiply by
    the weight and round again (transformers' RMSNorm) instead of one rounding of x * inv_rms * weight."""
    def forward(x, residual=None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        out = (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + norm.eps)).to(x.dtype) * norm.weight
        return out if residual is None else (out, x)
    norm.forward = forward


def _run(rollout_model, trainer):
    rollout = RLAlignRollout(rollout_model)
    record = rollout.generate(PROMPTS, n=2, max_new_tokens=6, temperature=1.0, seed=3)
    tokens = compare_tokens(record, trainer)
    loc = localize(record, rollout, trainer, tokens.first)
    return record, tokens, loc


def _assert_first(loc, name: str, layer: int, op: str) -> None:
    """``name`` is the first boundary that differs, and every compared boundary before it is identical."""
    assert loc.verdict == "localized", loc.reason
    d = loc.first_divergence
    assert (d.name, d.layer, d.boundary) == (name, layer, op), loc.reason
    before = loc.boundaries[:[b.name for b in loc.boundaries].index(name)]
    assert any(b.compared for b in before) and all(b.mismatches == 0 for b in before)


def test_native_mlp_on_the_training_side(checkpoints):
    rollout_model, _ = load_model(checkpoints["qwen3-bf16"])
    train_model, _ = load_model(checkpoints["qwen3-bf16"])
    _native(train_model.model.layers[1].mlp)
    record, tokens, loc = _run(rollout_model, RLAlignTrainer(train_model))
    assert tokens.mismatches > 0
    _assert_first(loc, "layers.1.mlp", 1, "mlp")
    first = ParityResult(ParityOptions(localize=True), record, tokens, "", loc).first_divergence()
    localized = first["localized"]
    assert localized["boundary"] == "layers.1.mlp"
    seq = record.sequences[localized["sequence"]]
    assert seq.all_tokens[localized["position"]] == localized["token"]


def test_moved_rounding_point_in_a_norm(checkpoints):
    rollout_model, _ = load_model(checkpoints["qwen3-bf16"])
    train_model, _ = load_model(checkpoints["qwen3-bf16"])
    _two_roundings(train_model.model.layers[2].post_attention_layernorm)
    _, tokens, loc = _run(rollout_model, RLAlignTrainer(train_model))
    assert tokens.mismatches > 0
    _assert_first(loc, "layers.2.post_norm", 2, "post_norm")


def test_native_paged_attention_on_the_rollout_side(checkpoints, monkeypatch):
    """The rollout's paged attention goes native (the trainer's varlen attention stays strict)."""
    rollout_model, _ = load_model(checkpoints["llama"])
    train_model, _ = load_model(checkpoints["llama"])
    strict_paged = ops.attention_paged

    def native_paged(*args, **kwargs):
        return strict_paged(*args, **{**kwargs, "profile": "native"})
    monkeypatch.setattr(ops, "attention_paged", native_paged)
    _, tokens, loc = _run(rollout_model, RLAlignTrainer(train_model))
    _assert_first(loc, "layers.0.attn", 0, "attn")


def test_native_o_proj_in_the_transformers_trainer(checkpoints):
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    from rlalign.integrations.transformers import from_pretrained
    rollout_model, _ = load_model(checkpoints["qwen2"])
    hf = from_pretrained(checkpoints["qwen2"])
    _native(hf.model.layers[1].self_attn.o_proj)
    _, tokens, loc = _run(rollout_model, TransformersTrainer(hf))
    _assert_first(loc, "layers.1.o_proj", 1, "o_proj")


def test_no_defect_is_identical(checkpoints):
    rollout_model, _ = load_model(checkpoints["qwen2"])
    _, tokens, loc = _run(rollout_model, RLAlignTrainer(rollout_model))
    assert tokens.ok and loc.verdict == "identical", loc.reason


def test_no_defect_with_transformers_every_boundary_identical(checkpoints):
    """The patched transformers model taps the same tensors as rlalign's model: all compared, all equal."""
    pytest.importorskip("transformers")
    from rlalign.integrations.transformers import from_pretrained
    rollout_model, _ = load_model(checkpoints["qwen3"])
    _, tokens, loc = _run(rollout_model, TransformersTrainer(from_pretrained(checkpoints["qwen3"])))
    assert tokens.ok and loc.verdict == "identical", loc.reason
    compared = {b.name for b in loc.boundaries if b.compared}
    per_layer = {f"layers.{i}.{b}" for i in range(3) for b in
                 ("input_norm", "q", "k", "v", "attn", "o_proj", "residual", "post_norm", "mlp")}
    assert per_layer | {"embed", "final_norm"} <= compared, sorted(per_layer - compared)
