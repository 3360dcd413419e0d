"""The same model checks on a CUDA device (strict ops dispatch to the triton backend there):
packed vs prefill vs decode bitwise, agreement with transformers, and generation invariance.
Skipped without CUDA."""

from __future__ import annotations


import pytest
import torch

from rlalign.models import ForwardBatch, generate, load_model, load_tokenizer
from rlalign.models.batch import next_token_targets
from rlalign.models.testing import make_tiny_checkpoint
from tests.bitwise import assert_bitwise_equal, assert_close_report
from tests.models import test_three_paths as three

pytestmark = pytest.mark.cuda

@pytest.fixture(scope="module", params=[(f, d) for f in three.FAMILIES for d in three.DTYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def cuda_setup(request):
    family, dtype = request.param
    return three.make_setup(family, three.DTYPES[dtype], "cuda")


@torch.no_grad()
def test_three_paths_cuda(cuda_setup):
    three.check_every_path(cuda_setup, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3-mqa-hd64-tied", "qwen2-gqa4-tied", "llama-llama32-hd128-tied",
                                  "qwen3-mha-hd128"])
def test_logits_match_transformers_cuda(name, dtype, tmp_path):
    pytest.importorskip("transformers")
    from tests.models.hf_helpers import hf_model, hf_padded_logits, round_weights_
    from tests.models.test_hf_agreement import CONFIGS, _batch

    family, overrides = CONFIGS[name]
    hf = round_weights_(hf_model(family, seed=len(name), **overrides), dtype)
    seqs = _batch(hf.config.vocab_size, seed=7)
    ref = torch.cat(hf_padded_logits(hf, seqs, "right"))
    hf.to(dtype).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, device="cuda")
    with torch.no_grad():
        ours = model.logits(model.forward_hidden(ForwardBatch.packed(seqs, "cuda"))).cpu()
    # fp32 GEMMs on the GPU are bf16x3 (x = hi + lo, three bf16 products: ~1e-5 relative per dot
    # product, docs/design/fp32-as-bf16x3.md), compounded over the layers: 1e-4 of the largest logit (the CPU test's
    # fp32 bound is 1e-5; measured worst on the H200: 1.1e-5 of max, 2026-11-30). bf16: the CPU bound.
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.02}[dtype] * float(ref.abs().max())
    assert_close_report(ours, ref, atol=tol, rtol=0, what=f"cuda {name} {dtype}")


def test_generate_cuda(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=7, init_std=0.3, dtype="bfloat16")
    model, _ = load_model(path, device="cuda")
    tok = load_tokenizer(path)
    prompts = ["What is 3 + 4?", "hello world", "Count the letters."]
    kw = dict(temperature=0.8, top_p=0.9, top_k=40, seed=99, max_new_tokens=10)
    full = {(c.prompt, c.sample_index): (c.tokens, c.logprobs) for c in generate(model, prompts, tokenizer=tok, n=2, **kw)}
    part = generate(model, prompts[::-1][:2], tokenizer=tok, n=1, **kw)
    for c in part:
        assert (c.tokens, c.logprobs) == full[(c.prompt, c.sample_index)]
    completions = generate(model, prompts, tokenizer=tok, n=1, **kw)
    seqs = [c.prompt_tokens + c.tokens for c in completions]
    with torch.no_grad():
        lp, _ = model.logprobs(ForwardBatch.packed(seqs, "cuda"), next_token_targets(seqs).cuda(), temperature=0.8)
    lp, start = lp.cpu(), 0
    for c, seq in zip(completions, seqs):
        got = torch.tensor(c.logprobs, dtype=torch.float32)
        assert_bitwise_equal(got, lp[start + len(c.prompt_tokens) - 1: start + len(seq) - 1], f"cuda {c.prompt!r}")
        start += len(seq)
