"""LoRA adapters (rlalign.models.lora): the unmerged forward against a float64 reference, its batch invariance,
what trains (adapters only), the merged copy within its stated tolerance, the rollout engine's log-probs equal to
the trainer's packed forward bit for bit on every family, and the refusals."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign.models.batch import ForwardBatch
from rlalign.models.checkpoint import CheckpointError, save_model
from rlalign.models.lora import (TARGETS, LoRAError, LoRALinear, LoRASpec, adapter_parameters, apply_lora,
                                 dropout_seed, lora_linear, lora_modules, merged_copy)
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tests.bitwise import assert_bitwise_equal
from tests.models.test_three_paths import FAMILIES
from tests.rollout.test_engine_bitwise import assert_matches_trainer, make_prompts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def adapted(family="qwen3", *, rank=4, targets=TARGETS, dtype=torch.float32, seed=0, b_std=0.2, device="cpu",
            **overrides):
    """A tiny model of ``family`` with adapters whose B is non-zero (PEFT's init makes it 0: no effect to test)."""
    model = tiny_model(family, seed=seed, dtype=dtype, init_std=0.15, norm_jitter=0.2, device=device,
                       **{**FAMILIES[family], **overrides})
    apply_lora(model, LoRASpec(rank=rank, alpha=2.0 * rank, targets=tuple(targets)), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in adapter_parameters(model):
            if name.endswith("lora_B.weight"):
                p.copy_((torch.randn(p.shape, generator=gen) * b_std).to(p.dtype))
    return model


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(0, 9), fan_in=st.integers(1, 40), fan_out=st.integers(1, 40), rank=st.integers(1, 6),
       bias=st.booleans(), k_segments=st.sampled_from([None, 8]), dtype=st.sampled_from(list(DTYPES)),
       seed=st.integers(0, 2**16))
def test_lora_linear_against_float64_and_row_by_row(rows, fan_in, fan_out, rank, bias, k_segments, dtype, seed):
    """Accuracy: within the dtype's rounding of x W^T + b + s (x A^T) B^T computed in float64. Batch invariance:
    each row alone has the bits it has inside the batch (degenerate sizes included: 0 rows, rank 1, K=1)."""
    if k_segments is not None and fan_in % k_segments:
        fan_in = k_segments * max(1, fan_in // k_segments)
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]

    def rnd(*shape):
        return torch.randn(shape, generator=g).to(dt)
    x, w, a, b = rnd(rows, fan_in), rnd(fan_out, fan_in), rnd(rank, fan_in), rnd(fan_out, rank)
    bb = rnd(fan_out) if bias else None
    s = 1.5
    y = lora_linear(x, w, bb, a, b, s, k_segments=k_segments)
    assert y.dtype == dt and y.shape == (rows, fan_out)
    d = torch.float64
    want = x.to(d) @ w.to(d).T + (0 if bb is None else bb.to(d)) + s * (x.to(d) @ a.to(d).T) @ b.to(d).T
    # error bound: a few ulps of the magnitudes summed (|x||W| + s |x||A||B|), per element
    scale = x.to(d).abs() @ w.to(d).abs().T + s * (x.to(d).abs() @ a.to(d).abs().T) @ b.to(d).abs().T + 1
    tol = (1e-5 if dt == torch.float32 else 2e-2) * scale
    assert bool(((y.to(d) - want).abs() <= tol).all())
    for i in range(rows):
        assert_bitwise_equal(lora_linear(x[i:i + 1], w, bb, a, b, s, k_segments=k_segments)[0], y[i], f"row {i}")


@settings(max_examples=12, deadline=None)
@given(family=st.sampled_from(["qwen3", "qwen2", "llama"]), rank=st.integers(1, 5),
       targets=st.lists(st.sampled_from(TARGETS), min_size=1, max_size=7, unique=True),
       lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_adapted_model_trains_adapters_only_and_packs_invariantly(family, rank, targets, lengths, seed):
    """Only the targeted projections are adapted; a sequence's log-probs are the same bits alone and packed with
    others; the backward reaches every adapter factor and no base weight."""
    model = adapted(family, rank=rank, targets=targets, seed=seed)
    adapted_names = {name.rpartition(".")[2] for name, _ in lora_modules(model)}
    assert adapted_names == set(targets)
    assert len(lora_modules(model)) == len(targets) * model.config.num_layers
    rng = random.Random(seed)
    seqs = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in lengths]
    targets_all = torch.tensor([t for s in seqs for t in s[1:] + [0]])
    lp, _ = model.logprobs(ForwardBatch.packed(seqs, "cpu"), targets_all)
    lp.sum().backward()
    for name, p in model.named_parameters():
        is_adapter = name.endswith(("lora_A.weight", "lora_B.weight"))
        assert p.requires_grad == is_adapter, name
        assert (p.grad is not None) == is_adapter, name
    start = 0
    with torch.no_grad():
        for s in seqs:
            alone, _ = model.logprobs(ForwardBatch.packed([s], "cpu"), torch.tensor(s[1:] + [0]))
            assert_bitwise_equal(alone, lp.detach()[start:start + len(s)], f"sequence of {len(s)} tokens")
            start += len(s)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_merged_copy_equals_the_unmerged_forward_within_its_rounding(dtype):
    """The merged weight W + s B A is rounded once to the weight dtype: its forward equals the unmerged one within
    that rounding (fp32: 1e-4 of the logits' scale; bf16: 3e-2), the copy is plain, and the original keeps its
    adapters."""
    model = adapted("qwen3", dtype=DTYPES[dtype])
    merged = merged_copy(model)
    assert not lora_modules(merged) and lora_modules(model)
    assert {n for n, _ in merged.named_parameters()} == {n for n, _ in tiny_model("qwen3", **FAMILIES["qwen3"])
                                                          .named_parameters()}
    seqs = [[5, 9, 33, 71, 2, 100], [7, 8]]
    batch = ForwardBatch.packed(seqs, "cpu")
    with torch.no_grad():
        a = model.logits(model.forward_hidden(batch))
        b = merged.logits(merged.forward_hidden(batch))
    tol = 1e-4 if dtype == "fp32" else 3e-2
    assert (a - b).abs().max().item() <= tol * (1 + a.abs().max().item())


@pytest.mark.parametrize("family,dtype", [(f, d) for f in FAMILIES for d in DTYPES], ids=lambda p: str(p))
def test_engine_logprobs_equal_the_trainers_bitwise_with_adapters(family, dtype):
    """The rollout engine (paged KV, chunked prefill, continuous batching) on an adapted model: every sampled
    token's log-prob has the bits of the trainer's packed forward (the same unmerged modules); Qwen3-MoE adapts
    its attention (its sparse layer's experts are refused)."""
    targets = TARGETS if family != "qwen3_moe" else ("q_proj", "k_proj", "v_proj", "o_proj")
    model = adapted(family, rank=3, targets=targets, dtype=DTYPES[dtype]).eval()
    engine = RolloutEngine(model, RolloutConfig(page_size=8, max_num_seqs=5, max_num_batched_tokens=32,
                                                max_prefill_chunk=11))
    sampling = SamplingParams(n=2, temperature=0.9, max_new_tokens=8, seed=4)
    completions = engine.generate(make_prompts(3, count=4), sampling)
    assert sum(len(c.tokens) for c in completions) > 0
    assert_matches_trainer(model, completions, temperature=0.9)


def test_refusals_are_one_line():
    moe = tiny_model("qwen3_moe", **FAMILIES["qwen3_moe"])
    with pytest.raises(LoRAError, match="layers.0 has no dense gate_proj"):
        apply_lora(moe, LoRASpec(rank=2, alpha=4.0, targets=("q_proj", "gate_proj")))
    model = adapted("qwen3")
    with pytest.raises(LoRAError, match="already holds LoRA adapters"):
        apply_lora(model, LoRASpec(rank=2, alpha=4.0))
    with pytest.raises(CheckpointError, match="holds LoRA adapters; save rlalign.models.lora.merged_copy"):
        save_model(model, "/nonexistent/never-written")
    for bad, match in [(dict(rank=0), "rank must be an integer >= 1"), (dict(rank=2, dropout=1.0), "dropout"),
                       (dict(rank=2, targets=("qkv",)), "targets must be distinct names"),
                       (dict(rank=2, targets=("q_proj", "q_proj")), "targets must be distinct names")]:
        with pytest.raises(LoRAError, match=match):
            LoRASpec(alpha=1.0, **bad)


def test_dropout_only_where_a_gradient_is_taken():
    """Scoring and rollout forwards (no grad, or eval) never drop; a training forward's masks come from
    dropout_seed's generator: the same seed gives the same bits, whatever drew from torch's generator between."""
    model = adapted("qwen3", rank=2)
    for _, m in lora_modules(model):
        m.dropout = 0.5
    seqs = [[3, 4, 5, 6, 7, 8]]
    batch, tg = ForwardBatch.packed(seqs, "cpu"), torch.tensor(seqs[0][1:] + [0])
    model.train()
    with torch.no_grad():
        plain = model.logprobs(batch, tg)[0]
    model.eval()
    assert_bitwise_equal(model.logprobs(batch, tg)[0].detach(), plain, "eval forward with grad")
    model.train()
    with dropout_seed(7):
        first = model.logprobs(batch, tg)[0].detach()
    torch.rand(5)   # whatever else draws from the global generator in between
    with dropout_seed(7):
        assert_bitwise_equal(model.logprobs(batch, tg)[0].detach(), first, "same seed, same dropout mask")
    with dropout_seed(8):
        assert not torch.equal(model.logprobs(batch, tg)[0].detach(), first)
    assert not torch.equal(first, plain)
    assert isinstance(model.model.layers[0].self_attn.q_proj, LoRALinear)
