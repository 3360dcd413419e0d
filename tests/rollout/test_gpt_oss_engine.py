"""gpt-oss through the rollout engine: the engine's log-probs are the trainer's packed forward's, bit for bit,
and tokens and log-probs do not depend on the engine's configuration (page size, chunked prefill, batch
composition, prefix sharing) -- fp32 and bf16, with sliding windows shorter than the sequences (3 and 8: decode steps
whose window starts inside a page and inside a 64-position key block), sinks and the gpt-oss MoE."""

from __future__ import annotations


import pytest

from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tests.rollout.test_engine_bitwise import assert_matches_trainer, assert_random_engine_config_agrees, make_prompts

SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3)


@pytest.fixture(scope="module", params=[(3, "float32"), (8, "bfloat16")], ids=["window3-fp32", "window8-bf16"])
def model(request):
    window, dtype = request.param
    return tiny_model("gpt_oss", seed=1, init_std=0.2, sliding_window=window, dtype=dtype)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(7, count=4)


@pytest.fixture(scope="module")
def reference(model, prompts):
    return RolloutEngine(model, RolloutConfig(num_pages=256)).generate(prompts, SAMPLING)


def test_engine_logprobs_equal_the_trainers(model, reference):
    assert_matches_trainer(model, reference, SAMPLING.logprob_temperature)
    assert max(len(c.prompt_tokens) + len(c.tokens) for c in reference) > model.config.sliding_window


@pytest.mark.parametrize("seed", range(3))
def test_completions_do_not_depend_on_the_engine_configuration(model, prompts, reference, seed):
    assert_random_engine_config_agrees(model, prompts, reference, SAMPLING, seed)
