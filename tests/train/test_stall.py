"""Why a run ends early (rlalign/train/stall.py): a warning once every advantage has been 0 for a few steps, and
``run.stop_when_stalled`` to end such a run; a segment's end at ``run.stop_at_step`` or ``run.max_minutes``."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from rlalign.configlib import ConfigError, load_config
from rlalign.train.config import TrainConfig
from rlalign.train.loop import run_training
from rlalign.train.run.metrics import read_metrics
from rlalign.train.stall import WARN_AFTER, StallWatch, segment_end, stalled

from .conftest import tiny_overrides

CONSTANT_REWARD = f"{Path(__file__).with_name('rewards.py')}:constant"
FLAT = {"advantage/mean": 0.0, "advantage/std": 0.0, "entropy": 0.0}
LIVE = {"advantage/mean": 0.0, "advantage/std": 0.9, "entropy": 3.0}


def test_a_step_is_stalled_only_when_every_advantage_is_zero():
    assert stalled(FLAT)
    assert not stalled(LIVE)
    assert not stalled({"advantage/mean": 0.1, "advantage/std": 0.0})   # a constant non-zero advantage moves the policy
    assert not stalled({})                                               # a record without advantages (e.g. step 0)


def test_the_watch_warns_once_per_stall_and_stops_after_its_limit():
    watch = StallWatch(stop_after=WARN_AFTER + 2)
    lines = [watch.update(FLAT) for _ in range(WARN_AFTER + 1)]
    assert lines[:WARN_AFTER - 1] == [None] * (WARN_AFTER - 1) and lines[WARN_AFTER] is None
    assert "collapsed" in lines[WARN_AFTER - 1] and "optim.lr" in lines[WARN_AFTER - 1]
    assert watch.stop_reason() is None
    watch.update(FLAT)
    assert "stop_when_stalled" in watch.stop_reason()
    watch.update(LIVE)                       # a live step ends the stall
    assert watch.streak == 0 and watch.stop_reason() is None
    assert [watch.update(FLAT) for _ in range(WARN_AFTER)][-1] is not None   # a new stall warns again
    assert StallWatch(None).stop_reason() is None


def test_a_constant_reward_run_warns_and_stops_when_stalled(arithmetic_model_dir, tmp_path, rlalign_log):
    steps = WARN_AFTER + 1
    cfg = load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / "run", steps=20) +
                      [f"task.reward={CONSTANT_REWARD}", f"run.stop_when_stalled={steps}"])
    rows = [r for r in read_metrics(run_training(cfg)) if "reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "the run must end after the stalled steps"
    assert all(r["reward/zero_std_frac"] == 1.0 and stalled(r) for r in rows)
    warnings = [m for m in rlalign_log.messages if "no learning signal" in m]
    assert len(warnings) == 1 and "same reward" in warnings[0]


def test_stop_when_stalled_must_be_a_positive_step_count():
    with pytest.raises(ConfigError, match="stop_when_stalled"):
        load_config(TrainConfig, None, ["run.stop_when_stalled=0"])


def test_max_minutes_ends_before_a_step_that_would_pass_it():
    """run.max_minutes ends the segment when the next step, estimated as long as the last, would end past the
    limit -- not one step late; stop_at_step first; nothing without a limit."""
    run = SimpleNamespace(stop_at_step=None, max_minutes=1.0)
    assert segment_end(run, 3, elapsed_s=40.0, step_s=10.0) is None          # 50 s < 60 s
    assert "would end past it" in segment_end(run, 4, elapsed_s=50.5, step_s=10.0)
    assert "reached" in segment_end(run, 5, elapsed_s=61.0, step_s=0.0)
    assert segment_end(SimpleNamespace(stop_at_step=None, max_minutes=None), 9, 1e9, 1e9) is None
    assert "stop_at_step" in segment_end(SimpleNamespace(stop_at_step=2, max_minutes=1.0), 2, 100.0, 50.0)
