"""The rollout engine and the generate loop sample-and-score through the one owner (ops.sample_and_score),
which takes the temperature rule from its one definition (rlalign.ops.temperature).

A wrong rule planted there -- every token scored at T = 1 whatever it was sampled at, the classic bug --
must move both callers' reported logprobs to exactly the planted scoring (the trainer's packed forward at
T = 1, bit for bit) and leave their tokens alone; and every other reader of the rule (SamplingParams,
the train config, a rollout record) must follow it. A caller with its own copy of sample-and-score or of
the rule would keep the honest logprobs and fail here. The vLLM sampler hook is checked the same way in
tests/integrations/vllm/plugin_checks.py; the trainer's scoring in tests/train/test_temperature_rule.py.
"""

import pytest
import torch

from rlalign.models import generate
from rlalign.ops import temperature as temperature_rule
from rlalign.parity.replay import RolloutRecord
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.train.config import RolloutSection
from tests.bitwise import assert_bitwise_equal
from tests.rollout.test_engine_bitwise import trainer_logprobs

T = 0.7
SAMPLING = dict(n=2, temperature=T, top_k=20, top_p=0.95, max_new_tokens=6, seed=3)


def plant_score_at_one(monkeypatch):
    monkeypatch.setattr(temperature_rule, "logprob_temperature", lambda t: 1.0)


def engine_run(model, prompts):
    return RolloutEngine(model, RolloutConfig()).generate(prompts, SamplingParams(**SAMPLING))


def generate_run(model, prompts):
    return generate(model, prompts, **SAMPLING)


@pytest.mark.parametrize("caller", [engine_run, generate_run], ids=["engine", "generate"])
def test_a_planted_rule_moves_the_callers_logprobs_not_their_tokens(model, prompts, monkeypatch, caller):
    prompts = prompts[:3]
    honest = caller(model, prompts)
    plant_score_at_one(monkeypatch)
    planted = caller(model, prompts)
    assert [c.tokens for c in planted] == [c.tokens for c in honest]
    assert any(c.logprobs != h.logprobs for c, h in zip(planted, honest)), "the planted rule changed nothing"
    for temperature, run in ((T, honest), (1.0, planted)):
        for k, (c, want) in enumerate(zip(run, trainer_logprobs(model, run, temperature))):
            assert_bitwise_equal(torch.tensor(c.logprobs, dtype=torch.float32), want,
                                 f"completion {k}: reported logprobs vs the trainer's at T={temperature}")


def test_every_reader_of_the_rule_follows_it(monkeypatch):
    record = RolloutRecord(sequences=[], weights_hash="0" * 64, sampling={"temperature": T})
    readers = {"SamplingParams": lambda: SamplingParams(temperature=T).logprob_temperature,
               "train config rollout section": lambda: RolloutSection(temperature=T).logprob_temperature,
               "rollout record without logprob_temperature": lambda: record.logprob_temperature}
    assert {name: read() for name, read in readers.items()} == dict.fromkeys(readers, T)
    plant_score_at_one(monkeypatch)
    assert {name: read() for name, read in readers.items()} == dict.fromkeys(readers, 1.0)


@pytest.mark.parametrize("sampling, scored", [(0.0, 1.0), (1.0, 1.0), (0.25, 0.25)])
def test_readers_apply_the_greedy_rule(sampling, scored):
    assert SamplingParams(temperature=sampling).logprob_temperature == scored
    record = RolloutRecord(sequences=[], weights_hash="0" * 64, sampling={"temperature": sampling})
    assert record.logprob_temperature == scored


def test_requests_of_different_temperatures_share_steps_without_changing_a_bit(model, prompts):
    """Greedy, T=0.7 (top-k/top-p) and T=1 requests in flight together: each step samples and scores rows of
    several logprob temperatures in one call of the owner; every completion equals its request run alone
    and the trainer's logprobs at its own logprob temperature."""
    samplings = [SamplingParams(n=2, temperature=0.0, max_new_tokens=5, seed=1),
                 SamplingParams(**SAMPLING),
                 SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=2)]
    engine = RolloutEngine(model, RolloutConfig())
    ids = [engine.add_request(p, s, prompt_index=i) for i, (p, s) in enumerate(zip(prompts, samplings))]
    together = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.completion is not None:
                together[(out.request_id, out.sample_index)] = out.completion
    for i, (rid, prompt, sampling) in enumerate(zip(ids, prompts, samplings)):
        mixed = [together[(rid, j)] for j in range(sampling.n)]
        alone = RolloutEngine(model, RolloutConfig()).generate([prompt], sampling, prompt_indices=[i])
        assert [c.tokens for c in mixed] == [c.tokens for c in alone], f"request {i}: tokens"
        for k, (c, want) in enumerate(zip(mixed, trainer_logprobs(model, mixed, sampling.logprob_temperature))):
            assert_bitwise_equal(torch.tensor(c.logprobs, dtype=torch.float32), want, f"request {i} sample {k}")
            assert c.logprobs == alone[k].logprobs, f"request {i} sample {k}: logprobs vs alone"
