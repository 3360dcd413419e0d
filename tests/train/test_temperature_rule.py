"""The trainer scores rollout tokens through the one temperature rule (rlalign.ops.temperature), the rule the
rollout engine's reported logprobs follow: with a wrong rule planted there (every token scored at T = 1
whatever it was sampled at) a strict step still has zero mismatches, because both sides read the planted
rule. A trainer that scored at ``rollout.temperature`` directly would disagree with the engine on every
token here (tests/rollout/test_sample_and_score_callers.py checks the engine's side)."""

from rlalign.configlib import load_config
from rlalign.ops import temperature as temperature_rule
from rlalign.train.config import TrainConfig
from rlalign.train.loop import Trainer
from tests.train.conftest import tiny_overrides


def test_trainer_and_rollout_share_the_planted_rule(arithmetic_model_dir, tmp_path, monkeypatch):
    scored_at = []

    def score_at_one(t):
        scored_at.append(t)
        return 1.0

    monkeypatch.setattr(temperature_rule, "logprob_temperature", score_at_one)
    cfg = load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / "run", 1)
                      + ["rollout.temperature=0.6"])
    trainer = Trainer(cfg)
    trainer.resume_if_asked()
    record = trainer.train_step(1)
    assert 0.6 in scored_at   # the rule was asked about the run's sampling temperature
    assert record["mismatch/tokens"] > 0 and record["mismatch/count"] == 0, record
