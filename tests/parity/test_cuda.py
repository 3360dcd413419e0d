"""On a GPU (strict ops on the device's backend): the patched transformers model equals rlalign bit for bit
-- logprobs and every parameter gradient -- and ``rlalign parity`` is green in strict, red in native."""

from __future__ import annotations

import pytest
import torch

from rlalign.models import ForwardBatch, load_model, next_token_targets
from rlalign.parity.run import ParityOptions, run_parity
from tests.bitwise import assert_bitwise_equal

pytestmark = pytest.mark.cuda

SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qwen3_shape(tmp_path_factory):
    """Qwen3-0.6B layer shapes (4 layers), bf16, random init."""
    from rlalign.models.testing import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cuda") / "qwen3", family="qwen3", dtype="bfloat16", **SHAPE)


def test_patched_transformers_logprobs_and_grads_cuda(qwen3_shape):
    pytest.importorskip("transformers")
    from rlalign.integrations.transformers import from_pretrained, token_logprobs
    rl, _ = load_model(qwen3_shape, device="cuda")
    hf = from_pretrained(qwen3_shape, device="cuda")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in (50, 200, 17)]
    batch = ForwardBatch.packed(seqs, device="cuda")
    lp, ent = rl.logprobs(batch, next_token_targets(seqs).cuda(), with_entropy=True)
    keep = torch.ones_like(lp)
    keep[batch.cu_seqlens[1:].long() - 1] = 0
    adv = torch.randn(lp.shape, generator=g).cuda() * keep
    (-(lp * adv).sum() + 0.01 * (ent * keep).sum()).backward()

    width = max(map(len, seqs))
    ids = torch.zeros((3, width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    ids, mask = ids.cuda(), mask.cuda()
    out = token_logprobs(hf, ids, mask, with_entropy=True)
    adv_padded = torch.zeros(ids.shape, device="cuda")
    adv_padded[mask.bool()] = adv
    (-(out.logprobs * adv_padded).sum() + 0.01 * out.entropy.sum()).backward()

    assert_bitwise_equal(out.logprobs[mask.bool()][keep.bool()], lp[keep.bool()], "logprobs")
    hf_params = dict(hf.named_parameters())
    for name, p in rl.named_parameters():
        assert_bitwise_equal(hf_params[name].grad, p.grad, f"grad of {name}")


@pytest.mark.parametrize("train", ["rlalign", "transformers"])
def test_parity_strict_green_native_red_cuda(qwen3_shape, train):
    if train == "transformers":
        pytest.importorskip("transformers")
    strict = run_parity(ParityOptions(model=str(qwen3_shape), train=train, prompts=4, samples=2, max_new_tokens=16,
                                      device="cuda"))
    assert strict.ok and strict.tokens.tokens_compared > 0, strict.summary()
    native = run_parity(ParityOptions(model=str(qwen3_shape), train=train, profile="native", prompts=4, samples=2,
                                      max_new_tokens=16, device="cuda"))
    assert native.tokens.mismatches > 0, native.summary()
