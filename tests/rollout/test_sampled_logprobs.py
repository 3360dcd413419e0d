"""The rollout engine's ``SamplingParams(logprobs="sampled")`` and ``min_p``: each reported log-prob equals the
trainer's ``ops.sampled_logprob`` on its packed forward, bit for bit, whatever the engine settings (decode graphs'
padded form and overlapped scheduling included: such requests sample eagerly); the tokens are those of
``logprobs="full"``; requests of both modes in flight at once each get their own."""

import pytest
import torch

from rlalign import ops
from rlalign.contract import use_profile
from rlalign.models.batch import ForwardBatch
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.rollout.errors import RequestError
from tests.bitwise import assert_bitwise_equal
from tests.rollout.test_engine_bitwise import assert_same_completions

SAMPLED = dict(n=2, temperature=0.7, top_k=30, top_p=0.8, min_p=0.02, max_new_tokens=7, seed=5, logprobs="sampled")


def trainer_sampled_logprobs(model, completions, sampling: SamplingParams) -> list[torch.Tensor]:
    """Per completion: ops.sampled_logprob of its tokens on ONE packed forward of every prompt + completion."""
    seqs = [c.prompt_tokens + c.tokens for c in completions]
    rows, targets, offset = [], [], 0
    for c, s in zip(completions, seqs):
        rows += range(offset + len(c.prompt_tokens) - 1, offset + len(s) - 1)
        targets += c.tokens
        offset += len(s)
    with use_profile("strict"), torch.no_grad():
        hidden = model.forward_hidden(ForwardBatch.packed(seqs, device=model.device))
        lp = ops.sampled_logprob(hidden[torch.tensor(rows)], model.lm_head_weight, torch.tensor(targets),
                                 temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                 min_p=sampling.min_p).logprob
    return list(lp.split([len(c.tokens) for c in completions]))


def assert_sampled_match_trainer(model, completions, sampling):
    for c, want in zip(completions, trainer_sampled_logprobs(model, completions, sampling)):
        assert_bitwise_equal(torch.tensor(c.logprobs, dtype=torch.float32), want,
                             f"prompt {c.prompt_index} sample {c.sample_index}: engine vs trainer sampled logprobs")


@pytest.mark.parametrize("config", [dict(), dict(page_size=3, max_num_batched_tokens=13, max_prefill_chunk=5),
                                    dict(decode_graphs="padded", overlap="on", page_size=8)],
                         ids=["default", "chunked", "padded-graphs-overlap"])
def test_engine_sampled_logprobs_equal_the_trainers(model, prompts, config):
    sampling = SamplingParams(**SAMPLED)
    got = RolloutEngine(model, RolloutConfig(**config)).generate(prompts, sampling)
    assert_sampled_match_trainer(model, got, sampling)
    full = RolloutEngine(model, RolloutConfig(**config)).generate(prompts, SamplingParams(**{**SAMPLED, "logprobs": "full"}))
    assert [c.tokens for c in got] == [c.tokens for c in full]
    assert any(a.logprobs != b.logprobs for a, b in zip(got, full)), "the kept set never bit"


def test_both_modes_in_flight_at_once(model, prompts):
    modes = [SamplingParams(**SAMPLED), SamplingParams(**{**SAMPLED, "logprobs": "full", "min_p": 0.0, "top_k": 0}),
             SamplingParams(**{**SAMPLED, "temperature": 0.0})]
    alone = [RolloutEngine(model, RolloutConfig()).generate(prompts[:2], s) for s in modes]
    engine = RolloutEngine(model, RolloutConfig())
    ids = [[engine.add_request(p, s, prompt_index=i) for i, p in enumerate(prompts[:2])] for s in modes]
    done = {}
    with torch.no_grad():
        while engine.has_unfinished():
            for out in engine.step():
                if out.completion is not None:
                    done[(out.request_id, out.sample_index)] = out.completion
    for s, rids, want in zip(modes, ids, alone):
        assert_same_completions([done[(rid, j)] for rid in rids for j in range(s.n)], want)
    assert_sampled_match_trainer(model, alone[0], modes[0])
    assert all(lp == 0.0 for c in alone[2] for lp in c.logprobs)   # greedy: a one-token kept set


@pytest.mark.parametrize("kw, message", [(dict(min_p=1.5), "min_p must be in"), (dict(logprobs="raw"), "logprobs must be")])
def test_bad_sampling_params_are_refused(kw, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kw)
