"""rlalign's decoder computes the same function as transformers' (the reference implementation).

For varied random-init configs of each family, transformers (float64, eager attention) on the
same weights is the reference. Checkpoints are written by transformers' ``save_pretrained`` and
read by ``load_model``; rlalign runs packed varlen batches in the strict profile and is compared
with transformers' right- and left-padded batches. Tolerances, on logits, relative to the largest
reference logit |z|max of the batch:

* fp32 model: max |Δ| <= 1e-5 * |z|max (measured ~4e-7 .. 5e-7 relative);
* bf16 model (reference = float64 on the bf16-rounded weights): max |Δ| <= 0.02 * |z|max
  (measured ~0.005 .. 0.007; transformers' own bf16 forward is at ~0.006 .. 0.011).
"""

from __future__ import annotations

import pytest
import torch

from rlalign.models import ForwardBatch, load_model
from rlalign.models.batch import next_token_targets
from tests.bitwise import assert_close_report
from tests.models.hf_helpers import hf_model, hf_padded_logits, round_weights_

transformers = pytest.importorskip("transformers")

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
LLAMA32 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
CONFIGS = {
    # qwen3: q/k norm; GQA 2:1, MQA, MHA; head_dim 16, 64, 128; tied and untied
    "qwen3-gqa2": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "qwen3-mqa-hd64-tied": ("qwen3", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                          tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3-mha-hd128": ("qwen3", dict(hidden_size=96, intermediate_size=160, num_attention_heads=3,
                                      num_key_value_heads=3, head_dim=128, rope_theta=5e5, rms_norm_eps=1e-5)),
    # qwen2: q/k/v bias, head_dim = hidden / heads
    "qwen2-gqa2": ("qwen2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "qwen2-gqa4-tied": ("qwen2", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2-hd64-3layers": ("qwen2", dict(hidden_size=128, intermediate_size=96, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=64, num_hidden_layers=3)),
    "qwen2-hd128": ("qwen2", dict(hidden_size=256, intermediate_size=128, num_attention_heads=2,
                                  num_key_value_heads=2, head_dim=128, num_hidden_layers=1)),
    # llama: default rope and llama3 scaling (strong and Llama-3.2-like), GQA 4:1, head_dim 128
    "llama-gqa4": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
    "llama-llama3-hd64": ("llama", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                        rope_theta=5e5, rope_scaling=LLAMA3)),
    "llama-llama32-hd128-tied": ("llama", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=128, tie_word_embeddings=True, rope_theta=5e5,
                                               rope_scaling=LLAMA32, num_hidden_layers=3)),
}
# 66 crosses the 64-position attention block; 1 is a lone token.
LENGTHS = (7, 66, 1, 20)
TOL = {torch.float32: 1e-5, torch.bfloat16: 0.02}


def _batch(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, dtype, tmp_path):
    family, overrides = CONFIGS[name]
    hf = round_weights_(hf_model(family, seed=len(name), **overrides), dtype)
    seqs = _batch(hf.config.vocab_size, seed=7)
    ref_right = hf_padded_logits(hf, seqs, "right")
    ref_left = hf_padded_logits(hf, seqs, "left")
    hf_low = hf_padded_logits(hf.to(dtype), seqs, "right")
    hf.save_pretrained(tmp_path)

    model, config = load_model(tmp_path)
    assert model.dtype == dtype and config.family == family
    with torch.no_grad():
        hidden = model.forward_hidden(ForwardBatch.packed(seqs))
        ours = model.logits(hidden)
    ref = torch.cat(ref_right)
    scale = float(ref.abs().max())
    hf_err = float((torch.cat(hf_low).double() - ref).abs().max())
    what = f"{name} {dtype} (transformers' own {dtype} error: {hf_err:.3g}, |z|max {scale:.3g})"
    assert_close_report(ours, ref, atol=TOL[dtype] * scale, rtol=0, what=what + " vs right-padded")
    assert_close_report(ours, torch.cat(ref_left), atol=TOL[dtype] * scale, rtol=0, what=what + " vs left-padded")


@pytest.mark.parametrize("name", ["qwen3-gqa2", "qwen2-gqa4-tied", "llama-llama3-hd64"])
def test_logprobs_match_transformers(name, tmp_path):
    """Fused logprob/entropy at temperature 0.7 vs float64 log_softmax of transformers' logits (fp32 model);
    tolerance 1e-5 + 4e-6 * |z|max (z = logits / 0.7)."""
    family, overrides = CONFIGS[name]
    hf = round_weights_(hf_model(family, seed=1, **overrides), torch.float32)
    seqs = _batch(hf.config.vocab_size, seed=3)
    ref_logits = torch.cat(hf_padded_logits(hf, seqs, "right")) / 0.7
    targets = next_token_targets(seqs)
    ref_logp = torch.log_softmax(ref_logits, -1)
    ref_lp = ref_logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    ref_ent = -(ref_logp.exp() * ref_logp).sum(-1)
    hf.to(torch.float32).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    with torch.no_grad():
        lp, ent = model.logprobs(ForwardBatch.packed(seqs), targets, temperature=0.7, with_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    atol = 1e-5 + 4e-6 * float(ref_logits.abs().max())  # a few fp32 ulps of the largest logit
    assert_close_report(lp, ref_lp, atol=atol, rtol=0, what=f"{name} logprob")
    assert_close_report(ent, ref_ent, atol=atol, rtol=0, what=f"{name} entropy")


def test_native_profile_matches_transformers(tmp_path):
    """The native profile (vendor kernels) computes the same function too."""
    from rlalign.contract import use_profile

    hf = round_weights_(hf_model("qwen3", seed=5), torch.float32)
    seqs = _batch(hf.config.vocab_size, seed=5)
    ref = torch.cat(hf_padded_logits(hf, seqs, "right"))
    hf.to(torch.float32).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    with torch.no_grad(), use_profile("native"):
        ours = model.logits(model.forward_hidden(ForwardBatch.packed(seqs)))
    assert_close_report(ours, ref, atol=1e-5 * float(ref.abs().max()), rtol=0, what="native profile")


@pytest.mark.parametrize("name", ["qwen3-mqa-hd64-tied", "qwen2-gqa2", "llama-llama3-hd64"])
def test_gradients_match_transformers(name, tmp_path):
    """Training path: d(sum of logprobs)/d(every parameter) through the strict ops (packed batch,
    fp32 model) vs transformers in float64; per tensor max |Δ| <= 1e-4 * max |grad| + 1e-6."""
    family, overrides = CONFIGS[name]
    hf = round_weights_(hf_model(family, seed=2, **overrides), torch.float32)
    seqs = _batch(hf.config.vocab_size, seed=9)[:3]
    targets = next_token_targets(seqs)
    hf.to(torch.float32).save_pretrained(tmp_path)
    hf = hf.to(torch.float64)
    for s, t in zip(seqs, torch.split(targets, [len(s) for s in seqs])):
        logp = torch.log_softmax(hf(input_ids=torch.tensor([s])).logits[0], -1)
        logp.gather(1, t.unsqueeze(1)).sum().backward()
    model, _ = load_model(tmp_path)
    lp, _ = model.logprobs(ForwardBatch.packed(seqs), targets)
    lp.sum().backward()
    ref = dict(hf.named_parameters())
    for pname, p in model.named_parameters():
        g_ref = ref[pname].grad
        assert p.grad is not None and g_ref is not None, pname
        scale = float(g_ref.abs().max())
        assert_close_report(p.grad, g_ref, atol=1e-4 * scale + 1e-6, rtol=0, what=f"{name} grad of {pname}")
