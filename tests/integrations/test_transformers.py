"""rlalign.integrations.transformers: a patched HF model gives rlalign's logprobs and gradients bit for bit."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from rlalign.models import ForwardBatch, load_model, next_token_targets
from rlalign.models.layout import checkpoint_split
from tests.bitwise import assert_bitwise_equal, assert_close_report

transformers = pytest.importorskip("transformers")

from rlalign.integrations.transformers import (  # noqa: E402
    UnsupportedInputError, UnsupportedModelError, from_pretrained, is_patched, patch, token_logprobs, unpatch)

CASES = [("qwen3", "float32", False), ("qwen2", "float32", True), ("llama", "float32", False),
         ("qwen3", "bfloat16", True), ("llama", "bfloat16", False),
         ("qwen3_moe", "float32", False), ("qwen3_moe", "bfloat16", True)]
ids_of = functools.partial(map, lambda c: f"{c[0]}-{c[1]}-{'tied' if c[2] else 'untied'}")


def _quiet():
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _sequences(lengths, seed=0, vocab=320):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _padded(seqs, left=False):
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, sl] = torch.tensor(s)
        mask[i, sl] = 1
    return ids, mask


def _reference(model, seqs, temperature=1.0, with_entropy=True):
    """rlalign's trainer path: packed batch, next-token targets; (logprob, entropy, has_target) [T]."""
    batch = ForwardBatch.packed(seqs)
    lp, ent = model.logprobs(batch, next_token_targets(seqs), temperature=temperature, with_entropy=with_entropy)
    keep = torch.ones(batch.num_tokens, dtype=torch.bool)
    keep[batch.cu_seqlens[1:].long() - 1] = False
    return lp, ent, keep


def _layouts(seqs):
    """The same sequences as right-padded, left-padded, packed (position_ids) and packed (cu_seq_lens_q) inputs."""
    right, left = _padded(seqs), _padded(seqs, left=True)
    flat = torch.tensor([t for s in seqs for t in s]).unsqueeze(0)
    batch = ForwardBatch.packed(seqs)
    return {"right-padded": dict(input_ids=right[0], attention_mask=right[1]),
            "left-padded": dict(input_ids=left[0], attention_mask=left[1]),
            "packed-positions": dict(input_ids=flat, position_ids=batch.positions.unsqueeze(0)),
            "packed-cu": dict(input_ids=flat, cu_seq_lens_q=batch.cu_seqlens)}


@functools.lru_cache(maxsize=None)
def _models(path):
    _quiet()
    rl, _ = load_model(path)
    return rl, from_pretrained(path)


@pytest.mark.parametrize("case", CASES, ids=list(ids_of(CASES)))
def test_logprobs_bitwise_for_every_layout(hf_checkpoints, case):
    rl, hf = _models(hf_checkpoints[case])
    assert hf.config._attn_implementation == "rlalign"
    seqs = _sequences((5, 70, 1, 13))
    with torch.no_grad():
        lp, ent, keep = _reference(rl, seqs, temperature=0.7)
        for name, inputs in _layouts(seqs).items():
            out = token_logprobs(hf, **inputs, temperature=0.7, with_entropy=True)
            mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
            assert torch.equal(out.mask[mask], keep), name
            assert_bitwise_equal(out.logprobs[mask][keep], lp[keep], f"{case} {name} logprobs")
            assert_bitwise_equal(out.entropy[mask][keep], ent[keep], f"{case} {name} entropy")
            assert not out.logprobs[~out.mask].any()


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=4), seed=st.integers(0, 2**16),
       left=st.booleans())
def test_random_padded_batches_bitwise(hf_checkpoints, lengths, seed, left):
    rl, hf = _models(hf_checkpoints[("qwen3", "bfloat16", True)])
    seqs = _sequences(lengths, seed)
    ids, mask = _padded(seqs, left=left)
    with torch.no_grad():
        lp, _, keep = _reference(rl, seqs, with_entropy=False)
        out = token_logprobs(hf, ids, mask)
    assert_bitwise_equal(out.logprobs[mask.bool()][keep], lp[keep], f"lengths {lengths}")


def test_explicit_targets(hf_checkpoints):
    rl, hf = _models(hf_checkpoints[("llama", "float32", False)])
    seqs = _sequences((9, 4))
    ids, mask = _padded(seqs)
    targets = torch.randint(0, 320, ids.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = token_logprobs(hf, ids, mask, targets=targets)
        lp, _ = rl.logprobs(ForwardBatch.packed(seqs), targets[mask.bool()], with_entropy=False)
    assert torch.equal(out.mask, mask.bool())
    assert_bitwise_equal(out.logprobs[mask.bool()], lp)


def _grads(params) -> dict:
    return {n: p.grad.clone() for n, p in params}


@pytest.mark.parametrize("case", CASES, ids=list(ids_of(CASES)))
def test_gradients_bitwise_equal_rlalign_trainer(hf_checkpoints, case):
    """Same loss on the same tokens: every parameter gradient of the patched HF model equals rlalign's."""
    _quiet()
    rl, _ = load_model(hf_checkpoints[case])
    hf = from_pretrained(hf_checkpoints[case])
    seqs = _sequences((7, 66, 12), seed=5)
    g = torch.Generator().manual_seed(1)
    lp, ent, keep = _reference(rl, seqs, temperature=0.9)
    adv = torch.randn(lp.shape, generator=g) * keep
    (-(lp * adv).sum() + 0.01 * (ent * keep).sum()).backward()

    ids, mask = _padded(seqs)
    out = token_logprobs(hf, ids, mask, temperature=0.9, with_entropy=True)
    adv_padded = torch.zeros(ids.shape)
    adv_padded[mask.bool()] = adv
    (-(out.logprobs * adv_padded).sum() + 0.01 * out.entropy.sum()).backward()

    hf_grads = {n: q.grad for n, q in hf.named_parameters()}
    rl_grads = {n: p.grad for n, p in rl.named_parameters()}
    for name, grad in checkpoint_split(rl, rl_grads):     # stacked experts: per expert, the checkpoint's names
        assert_bitwise_equal(_hf_grad(hf_grads, name), grad, f"{case} grad of {name}")


def _hf_grad(hf_grads: dict, name: str) -> torch.Tensor:
    """The gradient of rlalign's parameter ``name`` in the HF model (stacked MoE experts: the expert's slice)."""
    if ".mlp.experts." not in name:
        return hf_grads[name]
    prefix, rest = name.split(".mlp.experts.")
    expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
    if proj == "down_proj":
        return hf_grads[f"{prefix}.mlp.experts.down_proj"][expert]
    gate_up = hf_grads[f"{prefix}.mlp.experts.gate_up_proj"][expert]
    inter = gate_up.shape[0] // 2
    return gate_up[:inter] if proj == "gate_proj" else gate_up[inter:]


def test_patched_layers_rebuild_activations_with_the_same_gradient_bits(hf_checkpoints):
    """The patch shares blocks.py: its layers rebuild the norm / silu_mul outputs and (Qwen3's q/k norm) the roped
    q / k in the backward too (rlalign.models.recompute; fp32 on the CPU: 8 saves per layer), and the gradients
    keep their bits."""
    from rlalign.models import recompute
    path = hf_checkpoints[("qwen3", "float32", False)]
    _quiet()
    hf = from_pretrained(path)
    ids, mask = _padded(_sequences((20, 9, 33), seed=4))

    def grads(on: bool):
        hf.zero_grad(set_to_none=True)
        before = recompute.pack_count()
        with (recompute.disabled() if not on else torch.enable_grad()):
            out = token_logprobs(hf, ids, mask, with_entropy=False)
        packs = recompute.pack_count() - before
        (out.logprobs * torch.linspace(-1, 1, out.logprobs.numel()).view(out.logprobs.shape)).sum().backward()
        return packs, {n: q.grad.clone() for n, q in hf.named_parameters() if q.grad is not None}

    packs_on, on = grads(True)
    packs_off, off = grads(False)
    assert packs_on == 8 * hf.config.num_hidden_layers and packs_off == 0
    assert on.keys() == off.keys() and on
    for name in on:
        assert_bitwise_equal(on[name], off[name], name)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5.2x renames it activation_checkpointing
def test_gradient_checkpointing_and_packed_gradients(hf_checkpoints):
    path = hf_checkpoints[("qwen3", "float32", False)]
    _quiet()
    rl, _ = load_model(path)
    hf = from_pretrained(path)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.train()
    seqs = _sequences((20, 9), seed=2)
    lp, _, keep = _reference(rl, seqs, with_entropy=False)
    (lp * keep).sum().backward()
    inputs = _layouts(seqs)["packed-positions"]
    out = token_logprobs(hf, **inputs)
    out.logprobs.sum().backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in rl.named_parameters():
        assert_bitwise_equal(hf_grads[name].grad, p.grad, f"checkpointed grad of {name}")


def test_model_forward_still_returns_logits(hf_checkpoints):
    rl, hf = _models(hf_checkpoints[("qwen2", "float32", True)])
    seqs = _sequences((6, 11), seed=4)
    ids, mask = _padded(seqs)
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hidden = rl.forward_hidden(ForwardBatch.packed(seqs))
    assert out.logits.shape == (2, 11, 320)
    assert len(out.hidden_states) == rl.config.num_layers + 1
    assert_bitwise_equal(out.hidden_states[-1][mask.bool()], hidden, "final-norm hidden rows")


def test_unpatched_model_with_rlalign_attention_is_accurate(hf_checkpoints):
    """The registered attention function also serves an unpatched model (padded masks, packed position_ids)."""
    path = hf_checkpoints[("llama", "float32", False)]
    _quiet()
    from transformers import AutoModelForCausalLM
    ours = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="rlalign")
    sdpa = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa")
    assert not is_patched(ours)
    seqs = _sequences((10, 4), seed=6)
    ids, mask = _padded(seqs)
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        b = sdpa(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert_close_report(a, b, atol=1e-5, rtol=1e-5, what="rlalign attention vs sdpa (unpatched model)")
    flat = torch.tensor([t for s in seqs for t in s]).unsqueeze(0)
    pos = ForwardBatch.packed(seqs).positions.unsqueeze(0)
    with torch.no_grad():
        packed = ours(input_ids=flat, position_ids=pos).logits[0]
    assert_close_report(packed, b, atol=1e-5, rtol=1e-5, what="packed rows vs padded rows")


def _tiny_hf(cls_name: str, **overrides):
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16)
    base.update(overrides)
    return getattr(transformers, cls_name)(cfg_cls(**base))


def test_refuses_unsupported_models():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel is not supported; supported: .*Qwen3ForCausalLM"):
        patch(gpt2)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        patch(_tiny_hf("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=8, max_window_layers=0))
    with pytest.raises(UnsupportedModelError, match="attention_dropout"):
        patch(_tiny_hf("LlamaForCausalLM", attention_dropout=0.1))
    with pytest.raises(UnsupportedModelError, match="float16"):
        patch(_tiny_hf("Qwen3ForCausalLM").half())
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        patch(_tiny_hf("LlamaForCausalLM", hidden_act="gelu"))
    no_bias = _tiny_hf("Qwen2ForCausalLM")
    no_bias.model.layers[0].self_attn.k_proj.bias = None
    with pytest.raises(UnsupportedModelError, match=r"layers.0.self_attn.k_proj.bias: expected shape \(16,\), found None"):
        patch(no_bias)
    extra_bias = _tiny_hf("LlamaForCausalLM")
    extra_bias.model.layers[0].mlp.down_proj.bias = nn.Parameter(torch.zeros(32))
    with pytest.raises(UnsupportedModelError, match="layers.0.mlp.down_proj has a bias the family does not have"):
        patch(extra_bias)
    wrapped = _tiny_hf("Qwen3ForCausalLM")

    class LoraLinear(nn.Linear):
        pass
    old = wrapped.model.layers[0].self_attn.q_proj
    wrapped.model.layers[0].self_attn.q_proj = LoraLinear(old.in_features, old.out_features, bias=False)
    with pytest.raises(UnsupportedModelError, match="q_proj is not a plain nn.Linear"):
        patch(wrapped)
    assert not is_patched(wrapped)


def test_refuses_kv_cache_and_bad_inputs(hf_checkpoints):
    _, hf = _models(hf_checkpoints[("qwen3", "float32", False)])
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(UnsupportedInputError, match="RolloutEngine"):
        hf.generate(ids, max_new_tokens=2, do_sample=False)
    with pytest.raises(UnsupportedInputError, match="positions must count 0, 1, 2"):
        token_logprobs(hf, ids, position_ids=torch.tensor([[0, 1, 3, 4]]))
    with pytest.raises(UnsupportedInputError, match="2-D"):
        token_logprobs(hf, ids, attention_mask=torch.ones(1, 1, 4, 4))
    with pytest.raises(UnsupportedInputError, match="no tokens"):
        token_logprobs(hf, ids, attention_mask=torch.zeros(1, 4))
    with pytest.raises(UnsupportedModelError, match="not patched"):
        token_logprobs(_tiny_hf("Qwen3ForCausalLM"), ids)


def test_greedy_generate_without_cache_matches_rlalign(hf_checkpoints):
    path = hf_checkpoints[("qwen2", "float32", True)]
    rl, hf = _models(path)
    from rlalign.models import generate
    prompt = [11, 12, 13, 14]
    with torch.no_grad():
        ours = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, use_cache=False,
                           pad_token_id=0, eos_token_id=None)
    ref = generate(rl, [prompt], max_new_tokens=4, temperature=0.0, stop_token_ids=[])
    assert ours[0, len(prompt):].tolist() == ref[0].tokens


def test_unpatch_and_repatch(hf_checkpoints):
    path = hf_checkpoints[("llama", "bfloat16", False)]
    _quiet()
    from transformers import AutoModelForCausalLM
    stock = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="eager")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="eager")
    ids, mask = _padded(_sequences((8, 5), seed=8))
    patch(model, "native")
    assert patch(model, "strict") is model and model._rlalign_patch.profile.value == "strict"
    unpatch(model)
    assert not is_patched(model) and model.config._attn_implementation == "eager"
    with torch.no_grad():
        assert_bitwise_equal(model(input_ids=ids, attention_mask=mask).logits,
                             stock(input_ids=ids, attention_mask=mask).logits, "unpatched vs stock")


# ---- construction under meta, output flags, right-padded generate, module-class validation ------

def test_patched_under_meta_device_then_materialized(hf_checkpoints):
    """FSDP2's construct-on-meta, to_empty, load flow: the rotary tables must not stay on meta."""
    path = hf_checkpoints[("qwen3", "float32", False)]
    rl, _ = _models(path)
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = patch(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=torch.float32))
    model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(rl.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    seqs = _sequences((7, 3), seed=9)
    with torch.no_grad():
        lp, _, keep = _reference(rl, seqs, with_entropy=False)
        out = token_logprobs(model, **_layouts(seqs)["right-padded"])
    assert_bitwise_equal(out.logprobs[out.mask], lp[keep], "logprobs of a model patched on meta")


def test_output_flags_from_config_lists_and_cache(hf_checkpoints):
    rl, hf = _models(hf_checkpoints[("qwen3", "float32", False)])
    ids, mask = _padded(_sequences((6, 4), seed=10))
    assert hf.config.use_cache is False   # the patched model keeps no cache; its config says so
    hf.config.output_hidden_states = True
    try:
        with torch.no_grad():
            out = hf(input_ids=ids, attention_mask=mask)
        assert out.hidden_states is not None and len(out.hidden_states) == rl.config.num_layers + 1
    finally:
        hf.config.output_hidden_states = False
    with pytest.raises(UnsupportedInputError, match="output_hidden_states=.*list of layers"):
        hf(input_ids=ids, attention_mask=mask, output_hidden_states=[0])
    with pytest.raises(UnsupportedInputError, match="use_cache=True"):
        hf(input_ids=ids, attention_mask=mask, use_cache=True)


def test_generate_without_cache_on_right_padded_prompts(hf_checkpoints):
    """generate(use_cache=False) on right-padded prompts runs; transformers' position_ids there count on after
    the padding (prompt: cumsum - 1 with padding at 0, then + 1 per new token), and each row's valid tokens are
    still scored as one sequence, padding not shifting their positions (rlalign's logprobs, bit for bit)."""
    rl, hf = _models(hf_checkpoints[("qwen2", "float32", True)])
    from rlalign.models import generate
    prompts = [[11, 12, 13, 14, 15], [21, 22]]
    ids, mask = _padded(prompts)
    new = 3
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, use_cache=False,
                          pad_token_id=0, eos_token_id=None)
    ref = generate(rl, [prompts[0]], max_new_tokens=new, temperature=0.0, stop_token_ids=[])
    assert out[0, ids.shape[1]:].tolist() == ref[0].tokens          # the unpadded row: rlalign's greedy tokens
    full_mask = torch.cat([mask, torch.ones((2, new), dtype=mask.dtype)], dim=1)
    prompt_pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    position_ids = torch.cat([prompt_pos, prompt_pos[:, -1:] + torch.arange(1, new + 1)], dim=1)
    seqs = [row[m.bool()].tolist() for row, m in zip(out, full_mask)]
    with torch.no_grad():
        lp, _, keep = _reference(rl, seqs, with_entropy=False)
        scored = token_logprobs(hf, out, full_mask, position_ids=position_ids)
    assert_bitwise_equal(scored.logprobs[scored.mask], lp[keep], "right-padded generate layout vs packed sequences")


def test_validates_the_module_class_not_config_architectures():
    """A headless checkpoint (architectures ["Qwen3Model"]) loaded into Qwen3ForCausalLM is patched; a class the
    registry does not know is refused whatever its config says."""
    model = _tiny_hf("Qwen3ForCausalLM", architectures=["Qwen3Model"])
    assert is_patched(patch(model))
    headless = transformers.Qwen3Model(transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                                num_hidden_layers=1, num_attention_heads=2,
                                                                num_key_value_heads=1, head_dim=16,
                                                                architectures=["Qwen3ForCausalLM"]))
    with pytest.raises(UnsupportedModelError, match="Qwen3Model is not supported"):
        patch(headless)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=7), min_size=1, max_size=4), st.integers(0, 3))
def test_padded_layout_positions_count_valid_tokens(prompt_masks, new):
    """Any padding pattern (leading, interior, trailing) with transformers' generate-style position_ids
    (prompt: cumsum - 1, padding 0; then + 1 per appended token): every row is one sequence whose valid tokens
    get positions 0, 1, 2, ... (degenerate rows: all padding but the appended tokens, no appended tokens)."""
    from rlalign.integrations.transformers import _layout
    width = max(map(len, prompt_masks))
    mask = torch.zeros((len(prompt_masks), width + new), dtype=torch.int64)
    for i, m in enumerate(prompt_masks):
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.int64)
    mask[:, width:] = 1
    if not bool(mask.sum(1).all()):
        mask[:, -1] = 1 if new == 0 else mask[:, -1]
        mask[mask.sum(1) == 0, 0] = 1
    prompt = mask[:, :width]
    prompt_pos = (prompt.cumsum(-1) - 1).masked_fill(prompt == 0, 0)
    position_ids = torch.cat([prompt_pos, prompt_pos[:, -1:] + torch.arange(1, new + 1)], dim=1)
    layout = _layout(tuple(mask.shape), "cpu", attention_mask=mask, position_ids=position_ids)
    expected = torch.cat([torch.arange(int(n)) for n in mask.sum(1)])
    assert layout.batch.positions.tolist() == expected.tolist()
    assert layout.batch.cu_seqlens.tolist() == [0] + mask.sum(1).cumsum(0).tolist()

