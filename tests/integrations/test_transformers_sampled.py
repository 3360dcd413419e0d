"""The transformers patch scores sampled log-probs: ``token_logprobs(..., sampled=settings)`` of a patched Hugging Face
model equals the rlalign engine's ``SamplingParams(logprobs="sampled")`` log-probs bit for bit, and its gradients
equal rlalign's trainer (``ops.sampled_logprob`` on the packed forward) bit for bit."""

import pytest
import torch

from rlalign import ops
from rlalign.integrations.transformers import from_pretrained, token_logprobs
from rlalign.integrations.transformers_parity import padded_batch
from rlalign.models import load_model
from rlalign.models.batch import ForwardBatch
from rlalign.models.testing import make_tiny_checkpoint
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tests.bitwise import assert_bitwise_equal

SETTINGS = dict(temperature=0.8, top_k=50, top_p=0.8, min_p=0.01)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sampled") / "qwen3", family="qwen3", dtype="float32",
                                norm_jitter=0.1)


def test_patched_model_scores_the_engines_sampled_logprobs(checkpoint):
    rl, _ = load_model(checkpoint)
    hf = from_pretrained(checkpoint)
    prompts = [[5, 9, 31, 7], [100, 3], [44, 45, 46, 47, 48, 49]]
    completions = RolloutEngine(rl, RolloutConfig()).generate(
        prompts, SamplingParams(n=2, max_new_tokens=6, seed=4, logprobs="sampled", **SETTINGS))
    seqs = [c.prompt_tokens + c.tokens for c in completions]
    ids, mask = padded_batch(seqs, "cpu")
    out = token_logprobs(hf, ids, mask, sampled=SETTINGS, with_entropy=True)
    assert bool((out.logprobs[out.mask] == float("-inf")).any())   # prompt tokens outside the kept set: -inf
    for i, c in enumerate(completions):
        p = len(c.prompt_tokens)
        assert_bitwise_equal(out.logprobs[i, p - 1:p - 1 + len(c.tokens)], torch.tensor(c.logprobs),
                             f"completion {i}: patched HF vs engine sampled log-probs")

    # gradients: the same loss on the completion tokens, rlalign's trainer path vs the patched model
    g = torch.Generator().manual_seed(2)
    adv = [torch.randn(len(c.tokens), generator=g) for c in completions]
    rows, targets, offset = [], [], 0
    for c, s in zip(completions, seqs):
        rows += range(offset + len(c.prompt_tokens) - 1, offset + len(s) - 1)
        targets += c.tokens
        offset += len(s)
    hidden = rl.forward_hidden(ForwardBatch.packed(seqs))
    lp = ops.sampled_logprob(hidden[torch.tensor(rows)], rl.lm_head_weight, torch.tensor(targets), **SETTINGS).logprob
    (-(lp * torch.cat(adv)).sum()).backward()
    weights = torch.zeros(ids.shape)
    for i, c in enumerate(completions):
        p = len(c.prompt_tokens)
        weights[i, p - 1:p - 1 + len(c.tokens)] = adv[i]
    scored = weights != 0   # completion positions (a prompt position's -inf times 0 would be NaN)
    (-(torch.where(scored, out.logprobs, 0.0) * weights).sum()).backward()
    hf_grads = dict(hf.named_parameters())
    for name, param in rl.named_parameters():
        theirs = hf_grads.get(name)
        if theirs is None:
            continue
        assert_bitwise_equal(theirs.grad, param.grad, f"gradient of {name}")
