"""Partial rollouts in asynchronous steps (``rollout.partial_tokens``): the generation of step ``s > k`` samples each
sample's first N tokens with version ``s - 1 - k`` and the rest with ``s - k``; every token's recorded behaviour
log-prob equals the trainer's forward under its own version's weights (``run.verify_behaviour``: 0 differ); the cut is
a function of the config and the tokens (two runs, one of them resumed, give the same bits)."""

from types import SimpleNamespace

import pytest

from rlalign.configlib import ConfigError, load_config
from rlalign.integrations.ray.compare import metric_differences, weight_differences
from rlalign.train import offpolicy
from rlalign.train.config import TrainConfig
from rlalign.train.loop import Trainer, run_training
from rlalign.train.run.metrics import read_metrics
from rlalign.train.setup import SetupError
from tests.train.conftest import tiny_overrides

PARTIAL = ("rollout.async_steps=1", "rollout.partial_tokens=2", "rollout.max_new_tokens=5", "rollout.ignore_eos=true",
           "run.verify_behaviour=true", "run.on_mismatch=stop")


def _cfg(model_dir, run_dir, steps, *extra):
    return load_config(TrainConfig, None, tiny_overrides(model_dir, run_dir, steps=steps, dense_reward=True) + [
        "optim.warmup_steps=1", *extra])


def test_switch_schedule_and_config_rules():
    assert [offpolicy.switch_version(s, 1) for s in range(1, 5)] == [None, 1, 2, 3]
    assert [offpolicy.switch_version(s, 2) for s in range(1, 6)] == [None, None, 1, 2, 3]
    with pytest.raises(ConfigError, match="partial_tokens=2 cuts the samples generated ahead .* async_steps >= 1"):
        load_config(TrainConfig, None, ["rollout.partial_tokens=2"])
    with pytest.raises(ConfigError, match="partial_tokens=6 cuts no sample \\(max_new_tokens=6\\)"):
        load_config(TrainConfig, None, ["rollout.async_steps=1", "rollout.partial_tokens=6"])
    with pytest.raises(ConfigError, match="rollout.partial_tokens"):
        load_config(TrainConfig, None, ["rollout.partial_tokens=-1"])
    with pytest.raises(SetupError, match="rollout.partial_tokens does not support an engine that records MoE routing"):
        offpolicy.check_partial(SimpleNamespace(routing=object()))
    offpolicy.check_partial(SimpleNamespace(routing=None))


def test_k1_partial_rollouts_verify_every_token_under_its_version(arithmetic_model_dir, tmp_path):
    """3 steps at k = 1 with each sample cut after 2 of its 5 tokens: from step 2 on every sample spans versions
    s - 2 and s - 1 (its last 3 tokens sampled by the trainer's current weights, so the agreement check compares them
    too); 0 behaviour log-probs differ, none unverified; a second run, stopped after step 2 and resumed (its
    checkpoint holds step 3's samples, cut at version 2), gives the same bits."""
    first, second = tmp_path / "a", tmp_path / "b"
    run_training(_cfg(arithmetic_model_dir, first, 3, *PARTIAL))
    run_training(_cfg(arithmetic_model_dir, second, 3, *PARTIAL, "run.stop_at_step=2"))
    assert len(read_metrics(second)) == 3
    run_training(_cfg(arithmetic_model_dir, second, 3, *PARTIAL, "run.resume=true"))
    assert metric_differences(first, second) == [] and weight_differences(first, second) == []
    records = read_metrics(first)[1:]
    tokens = [4 * 4 * 5] * 3
    assert [r["verify/behaviour_tokens"] for r in records] == tokens
    assert all(r["verify/behaviour_mismatch"] == 0 and r["verify/unverified_tokens"] == 0 for r in records)
    assert [r["offpolicy/staleness_max"] for r in records] == [0, 1, 1]
    assert [r["offpolicy/staleness_min"] for r in records] == [0, 0, 0]
    assert [r["offpolicy/stale_token_frac"] for r in records] == [0.0, 0.4, 0.4]   # 2 of each sample's 5 tokens
    assert [r["mismatch/tokens"] for r in records] == [80, 48, 48] and all(r["mismatch/count"] == 0 for r in records)
    assert [r["weights_version"] for r in records] == [0, 1, 2]


def test_the_versions_of_a_spanning_sample_change_mid_sample(arithmetic_model_dir, tmp_path):
    trainer = Trainer(_cfg(arithmetic_model_dir, tmp_path / "run", 3, *PARTIAL))
    trainer.resume_if_asked()
    try:
        trainer.train_step(1)
        trainer.step = 1
        trainer.source._wait_all()   # step 2's samples: 2 tokens by version 0, then 3 by version 1
        samples = trainer.source._ready[2][0]
        assert samples.versions.tolist() == [0, 0, 1, 1, 1] * len(samples)
    finally:
        trainer.close()
        trainer.run_lock.release()
