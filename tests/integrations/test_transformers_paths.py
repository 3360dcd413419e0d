"""Every public path of a patched transformers model, for every supported family, against the unpatched model.

A patched model must be a drop-in for the Hugging Face module: each path its callers use (``__call__`` with and
without labels, ``return_dict=False``, hidden states, padding, the MoE router outputs and auxiliary loss,
``generate`` with and without a cache, ``token_logprobs``) returns what the unpatched model returns -- the same
output class and fields, values within fp32 rounding -- or is refused with one line naming what to do instead.
Where the docs promise bits (final hidden rows, token logprobs, greedy tokens), the patched model equals
rlalign's own forward bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch

from rlalign.models import ForwardBatch, generate, load_model
from rlalign.models.moe import sparse_layer_indices
from tests.bitwise import assert_bitwise_equal, assert_close_report

transformers = pytest.importorskip("transformers")

from rlalign.integrations.transformers import (  # noqa: E402
    UnsupportedInputError, from_pretrained, token_logprobs, unpatch)

FAMILIES = [("qwen3", "float32", False), ("qwen2", "float32", True), ("llama", "float32", False),
            ("qwen3_moe", "float32", False)]
IDS = [f[0] for f in FAMILIES]
MOE = ("qwen3_moe", "float32", False)
TOL = dict(atol=2e-5, rtol=1e-4)            # fp32: the two sides round differently, nothing more


def _quiet():
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


@functools.lru_cache(maxsize=None)
def _models(path):
    """(rlalign model, patched HF model, unpatched HF model with sdpa attention) of one checkpoint."""
    _quiet()
    rl, _ = load_model(path)
    stock = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    return rl, from_pretrained(path).eval(), stock


def _seqs():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in (9, 4, 13)]


def _padded(seqs, left: bool):
    """input_ids, attention_mask and position_ids (0, 1, ... over each row's valid tokens)."""
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = torch.tensor(s), 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _pair(case, hf_checkpoints, left=False, **call):
    """Patched and unpatched outputs of the same padded batch (stock given the patched model's positions)."""
    rl, patched, stock = _models(hf_checkpoints[case])
    ids, mask, pos = _padded(_seqs(), left)
    with torch.no_grad():
        ours = patched(input_ids=ids, attention_mask=mask, **call)
        ref = stock(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **call)
    return ours, ref, mask.bool()


def _fields(out) -> set[str]:
    return {k for k, v in out.items() if v is not None}


@pytest.mark.parametrize("case", FAMILIES, ids=IDS)
@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_call_returns_the_unpatched_output(hf_checkpoints, case, left):
    """__call__ on a padded batch: same output class and fields as the unpatched model, logits within fp32
    rounding at the valid tokens, zeros nowhere they should not be."""
    ours, ref, valid = _pair(case, hf_checkpoints, left)
    assert type(ours) is type(ref)
    assert _fields(ours) == _fields(ref) == {"logits"}
    assert_close_report(ours.logits[valid], ref.logits[valid], **TOL, what=f"{case[0]} logits")


@pytest.mark.parametrize("case", FAMILIES, ids=IDS)
def test_call_with_labels_gives_the_unpatched_loss(hf_checkpoints, case):
    rl, patched, stock = _models(hf_checkpoints[case])
    ids, mask, pos = _padded(_seqs(), left=False)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ours = patched(input_ids=ids, attention_mask=mask, labels=labels)
        ref = stock(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels, use_cache=False)
    assert _fields(ours) == _fields(ref) == {"loss", "logits"}
    assert_close_report(ours.loss, ref.loss, **TOL, what=f"{case[0]} loss")


@pytest.mark.parametrize("case", FAMILIES, ids=IDS)
def test_return_dict_false_gives_the_tuple(hf_checkpoints, case):
    rl, patched, _ = _models(hf_checkpoints[case])
    ids, mask, _ = _padded(_seqs(), left=False)
    with torch.no_grad():
        as_tuple = patched(input_ids=ids, attention_mask=mask, return_dict=False)
        as_dict = patched(input_ids=ids, attention_mask=mask)
        backbone = patched.model(input_ids=ids, attention_mask=mask, return_dict=False)
    assert isinstance(as_tuple, tuple) and isinstance(backbone, tuple)
    assert_bitwise_equal(as_tuple[0], as_dict.logits, "tuple logits")
    assert_bitwise_equal(backbone[0], patched.model(input_ids=ids, attention_mask=mask).last_hidden_state)


@pytest.mark.parametrize("case", FAMILIES, ids=IDS)
def test_hidden_states_match_unpatched_and_final_rows_are_rlalign_bits(hf_checkpoints, case):
    ours, ref, valid = _pair(case, hf_checkpoints, output_hidden_states=True)
    assert len(ours.hidden_states) == len(ref.hidden_states)
    for i, (a, b) in enumerate(zip(ours.hidden_states, ref.hidden_states)):
        assert_close_report(a[valid], b[valid], **TOL, what=f"{case[0]} hidden_states[{i}]")
    rl, _, _ = _models(hf_checkpoints[case])
    with torch.no_grad():
        hidden = rl.forward_hidden(ForwardBatch.packed(_seqs()))
    assert_bitwise_equal(ours.hidden_states[-1][valid], hidden, "final-norm rows vs rlalign's forward")


@pytest.mark.parametrize("case", FAMILIES, ids=IDS)
def test_token_logprobs_agree_with_the_unpatched_logits(hf_checkpoints, case):
    """token_logprobs (bitwise rlalign's trainer: test_transformers.py) is log_softmax of the unpatched logits."""
    _, patched, _ = _models(hf_checkpoints[case])
    _, ref, valid = _pair(case, hf_checkpoints)
    ids, mask, _ = _padded(_seqs(), left=False)
    with torch.no_grad():
        out = token_logprobs(patched, ids, mask)
    expected = torch.log_softmax(ref.logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0].float()
    assert_close_report(out.logprobs[:, :-1][out.mask[:, :-1]], expected[out.mask[:, :-1]], **TOL,
                        what=f"{case[0]} token logprobs")


@pytest.mark.parametrize("case", FAMILIES, ids=IDS)
def test_generate_without_cache_gives_rlalign_and_unpatched_greedy_tokens(hf_checkpoints, case):
    rl, patched, stock = _models(hf_checkpoints[case])
    prompts = [[11, 12, 13, 14, 15], [21, 22]]
    ids, mask, _ = _padded(prompts, left=True)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        ours = patched.generate(ids, attention_mask=mask, use_cache=False, **kw)[:, ids.shape[1]:]
        theirs = stock.generate(torch.tensor(prompts[:1]), **kw)[:, len(prompts[0]):]   # with its KV cache
    for row, prompt in zip(ours, prompts):
        ref = generate(rl, [prompt], max_new_tokens=5, temperature=0.0, stop_token_ids=[])
        assert row.tolist() == ref[0].tokens
    assert ours[0].tolist() == theirs[0].tolist()


@pytest.mark.parametrize("case", FAMILIES, ids=IDS)
def test_generate_refusals_name_what_works(hf_checkpoints, case):
    """A KV cache (generate's default) and generation from inputs_embeds (transformers then always keeps a
    cache) are refused with one line whose advice applies to that call."""
    _, patched, _ = _models(hf_checkpoints[case])
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(UnsupportedInputError, match=r"use_cache=False"), torch.no_grad():
        patched.generate(ids, max_new_tokens=2, do_sample=False)
    embeds = patched.get_input_embeddings()(ids)
    with pytest.raises(UnsupportedInputError, match=r"^generate\(\) from inputs_embeds is not supported.*"
                                                    r"generate from input_ids with use_cache=False") as info, \
            torch.no_grad():
        patched.generate(inputs_embeds=embeds, max_new_tokens=2, do_sample=False, use_cache=False)
    assert "\n" not in str(info.value)
    with torch.no_grad():   # a plain forward from embeddings is fine
        out = patched(inputs_embeds=embeds)
        ref = patched(input_ids=ids)
    assert_bitwise_equal(out.logits, ref.logits, "inputs_embeds vs input_ids")


@pytest.mark.parametrize("case", FAMILIES, ids=IDS)
def test_attention_implementation_cannot_be_switched_silently(hf_checkpoints, case):
    """The config names the attention that runs: switching it while patched is refused, by the setter or (set by
    hand) at the next forward; after unpatch transformers' switch works again."""
    _quiet()
    patched = from_pretrained(hf_checkpoints[case])
    ids = torch.tensor([[5, 6, 7]])
    for owner in (patched, patched.model):
        with pytest.raises(UnsupportedInputError, match=r"set_attn_implementation\('sdpa'\).*unpatch"):
            owner.set_attn_implementation("sdpa")
    assert patched.config._attn_implementation == "rlalign"
    patched.set_attn_implementation("rlalign")             # what runs: accepted
    patched.config._attn_implementation = "eager"           # switched by hand: the next forward says so
    with pytest.raises(UnsupportedInputError, match=r"set to 'eager'.*always runs rlalign's attention"):
        patched(input_ids=ids)
    patched.config._attn_implementation = "rlalign"
    unpatch(patched)
    patched.set_attn_implementation("sdpa")                # unpatched: transformers' own switch again
    assert patched.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert patched(input_ids=ids).logits.shape == (1, 3, 320)


def test_moe_experts_implementation_names_what_runs(hf_checkpoints):
    """A patched MoE model's sparse blocks run rlalign's experts: the config says "rlalign", another experts
    implementation is refused, and unpatch restores transformers' choice."""
    _quiet()
    patched = from_pretrained(hf_checkpoints[MOE])
    assert patched.config._experts_implementation == "rlalign"
    with pytest.raises(UnsupportedInputError, match=r"set_experts_implementation\('grouped_mm'\).*experts.*unpatch"):
        patched.set_experts_implementation("grouped_mm")
    patched.config._experts_implementation = "eager"
    with pytest.raises(UnsupportedInputError, match=r"_experts_implementation was set to 'eager'"):
        patched(input_ids=torch.tensor([[5, 6, 7]]))
    patched.config._experts_implementation = "rlalign"
    unpatch(patched)
    assert patched.config._experts_implementation not in (None, "rlalign")
    patched.set_experts_implementation("eager")
    with torch.no_grad():
        assert patched(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 320)


@pytest.mark.parametrize("case", FAMILIES, ids=IDS)
def test_output_attentions_is_refused_in_one_line(hf_checkpoints, case):
    _, patched, _ = _models(hf_checkpoints[case])
    with pytest.raises(UnsupportedInputError, match=r"^output_attentions=True is not supported") as info:
        patched(input_ids=torch.tensor([[5, 6, 7]]), output_attentions=True)
    assert "\n" not in str(info.value)


# ---- the MoE router outputs --------------------------------------------------------------------------------


@pytest.mark.parametrize("via", ["argument", "config"])
def test_moe_router_logits_and_aux_loss_match_unpatched(hf_checkpoints, via):
    """output_router_logits (argument or config): one fp32 [batch * seq, experts] tensor per sparse layer, the
    unpatched router logits at the valid rows (padding rows 0), and the same auxiliary loss and total loss."""
    rl, patched, stock = _models(hf_checkpoints[MOE])
    ids, mask, pos = _padded(_seqs(), left=False)   # (left padding: the pad before a row's first token is scored)
    labels = ids.masked_fill(mask == 0, -100)
    call = dict(output_router_logits=True) if via == "argument" else {}
    for model in (patched, stock):
        model.config.output_router_logits = via == "config"
    try:
        with torch.no_grad():
            ours = patched(input_ids=ids, attention_mask=mask, labels=labels, **call)
            ref = stock(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels, use_cache=False, **call)
    finally:
        for model in (patched, stock):
            model.config.output_router_logits = False
    assert type(ours) is type(ref) and _fields(ours) == _fields(ref) == {"loss", "aux_loss", "logits", "router_logits"}
    assert len(ours.router_logits) == len(ref.router_logits) == len(sparse_layer_indices(rl.config))
    rows = mask.bool().reshape(-1)
    for a, b in zip(ours.router_logits, ref.router_logits):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert_close_report(a[rows], b[rows].float(), **TOL, what="router logits")
        assert not a[~rows].any()
    assert_close_report(ours.aux_loss, ref.aux_loss, **TOL, what="aux_loss")
    assert_close_report(ours.loss, ref.loss, **TOL, what="loss with the router auxiliary loss")


def test_moe_aux_loss_gradient_reaches_the_router_like_unpatched(hf_checkpoints):
    _quiet()
    path = hf_checkpoints[MOE]
    patched = from_pretrained(path)
    stock = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                              attn_implementation="sdpa")
    ids, mask, pos = _padded(_seqs(), left=False)
    patched(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss.backward()
    stock(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True,
          use_cache=False).aux_loss.backward()
    name = "model.layers.0.mlp.gate.weight"
    ours, ref = dict(patched.named_parameters())[name].grad, dict(stock.named_parameters())[name].grad
    assert ours is not None and ours.abs().sum() > 0
    assert_close_report(ours, ref, atol=1e-5, rtol=1e-3, what="router weight gradient of aux_loss")


def test_moe_router_logits_reach_an_enclosing_routing_record(hf_checkpoints):
    """Asking transformers for the router logits does not hide the routing from rlalign's own record."""
    from rlalign.models.moe import record_routing
    _, patched, _ = _models(hf_checkpoints[MOE])
    ids = torch.tensor([[5, 6, 7, 8]])
    with record_routing() as outer, torch.no_grad():
        out = patched(input_ids=ids, output_router_logits=True)
    assert outer.layer_indices == [0]
    assert_bitwise_equal(outer.layers[0][0][0], out.router_logits[0], "outer record vs router_logits")
