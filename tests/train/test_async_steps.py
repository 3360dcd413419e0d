"""Asynchronous steps (rollout.async_steps, rlalign.train.offpolicy and .sources): the schedule is the config's, not
the threads'; the generation of step t + k really runs while step t trains; k = 1 runs are bitwise reproducible, across a
kill + resume too (the checkpoint holds the samples generated ahead); the async machinery with no lookahead gives
the synchronous run's metrics and weights bit for bit; run.verify_behaviour recomputes the behaviour log-probs under
the recorded version (0 differ) and catches a one-bit change; the staleness bound is enforced."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rlalign.configlib import ConfigError, load_config
from rlalign.contract.errors import RLAlignError
from rlalign.integrations.ray.compare import metric_differences, weight_differences
from rlalign.train import offpolicy, sources
from rlalign.train.agreement import MismatchError
from rlalign.train.config import TrainConfig
from rlalign.train.loop import Trainer, run_training
from rlalign.train.run.checkpoint_files import load_latest_checkpoint
from rlalign.train.run.metrics import read_metrics
from tests.train.conftest import tiny_overrides

VOLATILE = ("time/", "tokens_per_s/", "memory/")


def _cfg(model_dir, run_dir, steps, *extra):
    return load_config(TrainConfig, None, tiny_overrides(model_dir, run_dir, steps=steps, dense_reward=True) + [
        "optim.warmup_steps=1", *extra])


def _trainer(model_dir, run_dir, *extra):
    trainer = Trainer(_cfg(model_dir, run_dir, 4, *extra))
    trainer.resume_if_asked()
    return trainer


def sync_and_k0_async(model_dir, tmp_path, *extra):
    """Two trainers of one config: the synchronous source (shared engine) and the asynchronous source with k = 0
    (an engine copy drawing in the worker thread)."""
    sync = _trainer(model_dir, tmp_path / "sync", *extra)
    piped = _trainer(model_dir, tmp_path / "piped", *extra, "rollout.share_weights=false")
    piped.source = sources.AsynchronousSource(piped.cfg, piped.sampler, piped.engine, piped._push)
    return sync, piped


def _finish(trainer):
    trainer.close()
    trainer.run_lock.release()


def test_schedule_and_staleness_bound():
    assert [offpolicy.behaviour_version(t, 0) for t in range(1, 5)] == [0, 1, 2, 3]
    assert [offpolicy.behaviour_version(t, 2) for t in range(1, 6)] == [0, 0, 0, 1, 2]
    offpolicy.check_staleness(5, torch.tensor([2, 2, 3]), 2)
    offpolicy.check_staleness(5, torch.zeros(0, dtype=torch.int64), 0)
    with pytest.raises(offpolicy.StalenessError, match="3 versions older than the trainer's \\(4\\), more than "
                                                       "rollout.max_staleness=2"):
        offpolicy.check_staleness(5, torch.tensor([2, 1, 3]), 2)
    with pytest.raises(ConfigError, match="async_steps=2 would train on samples 2 versions old, more than max_staleness=1"):
        load_config(TrainConfig, None, ["rollout.async_steps=2", "rollout.max_staleness=1"])
    with pytest.raises(ConfigError, match="rollout.async_steps"):
        load_config(TrainConfig, None, ["rollout.async_steps=-1"])


def test_a_resume_needs_the_checkpoint_of_its_own_async_steps():
    """The asynchronous source resumes only from a checkpoint holding exactly the steps it would have generated
    ahead (a synchronous run's checkpoint holds none); the synchronous source keeps nothing of its own."""
    cfg = SimpleNamespace(rollout=SimpleNamespace(async_steps=2, max_staleness=None),
                          run=SimpleNamespace(profile="strict"))
    source = sources.AsynchronousSource(cfg, sampler=None, engine=None, push=None)
    try:
        for checkpoint, held in (({}, "none"), ({sources.STATE_KEY: {"async_steps": 1, "ready": {4: {}}}}, "\\[4\\]"),
                                 ({sources.STATE_KEY: {"async_steps": 2, "ready": {4: {}, 6: {}}}}, "\\[4, 6\\]")):
            with pytest.raises(RLAlignError, match=f"checkpoint of step 3 holds the samples of steps {held} generated "
                                                   "ahead, but rollout.async_steps=2 needs steps \\[4, 5\\]"):
                source.load_state_dict(checkpoint, 3)
    finally:
        source.close()
    assert sources.SynchronousSource(sampler=None, push=None).state_dict() == {}


def test_a_sample_older_than_max_staleness_stops_the_step(arithmetic_model_dir, tmp_path):
    """The bound is checked on the samples themselves: a step whose samples claim an older version is refused."""
    trainer = _trainer(arithmetic_model_dir, tmp_path / "run", "rollout.async_steps=1")
    try:
        trainer.train_step(1)
        trainer.step = 1
        trainer.source._wait_all()   # step 2's samples, drawn by version 0, claim version -1 instead
        samples, stats, t = trainer.source._ready[2]
        trainer.source._ready[2] = (samples.__class__(**{**sources.samples_state(samples),
                                                           "versions": samples.versions - 1}), stats, t)
        with pytest.raises(offpolicy.StalenessError, match="step 2: a sample of weights version -1 is 2 versions older"):
            trainer.train_step(2)
    finally:
        _finish(trainer)


def test_generation_of_the_next_step_runs_while_this_step_trains(arithmetic_model_dir, tmp_path):
    """k = 1: step 2's draw starts before step 1's update ends. Each side waits for the other to have started: run
    one after the other, they would wait forever (the waits time out and the test fails)."""
    trainer = _trainer(arithmetic_model_dir, tmp_path / "run", "rollout.async_steps=1")
    drawing, updating, threads = threading.Event(), threading.Event(), {}
    real_draw, real_update = trainer.sampler.draw_step, trainer.update.run

    def draw_step(step):
        threads[step] = threading.current_thread().name
        if step == 2:
            drawing.set()
            assert updating.wait(60), "step 1's update never started while step 2 was being drawn"
        return real_draw(step)

    def run(*args, **kw):
        if not updating.is_set():
            updating.set()
            assert drawing.wait(60), "step 2's draw did not start while step 1 trained"
        return real_update(*args, **kw)

    trainer.sampler.draw_step, trainer.update.run = draw_step, run
    try:
        trainer.train_step(1)
        assert drawing.is_set() and updating.is_set()
        assert threads[1].startswith("rlalign-rollout") and threads[2].startswith("rlalign-rollout")
    finally:
        _finish(trainer)


def test_async_machinery_without_lookahead_equals_the_synchronous_run(arithmetic_model_dir, tmp_path):
    """The asynchronous source with k = 0 (each step's samples drawn in the worker thread by the trainer's current
    weights, an engine copy, the decoupled weights, which are exactly 1) against the synchronous source (shared
    engine): every metric both log and every weight, bit for bit."""
    sync, piped = sync_and_k0_async(arithmetic_model_dir, tmp_path)
    try:
        updated = 0
        for step in (1, 2, 3):
            a, b = sync.train_step(step), piped.train_step(step)
            sync.step = piped.step = step
            a.update(sync.evaluate())
            b.update(piped.evaluate())
            assert b["offpolicy/staleness_max"] == 0 and b["offpolicy/weight_min"] == b["offpolicy/weight_max"] == 1.0
            # weights_version: the engine's after the step; the asynchronous source updates it when it next draws
            assert (a["weights_version"], b["weights_version"]) == (step, step - 1)
            common = sorted(k for k in a if k in b and not k.startswith(VOLATILE) and k != "weights_version")
            assert len(common) > 20
            assert {k: a[k] for k in common} == {k: b[k] for k in common}, step
            updated += a["grad_norm"] > 0
        assert updated >= 2
        for (name, p), (_, q) in zip(sync.policy.named_parameters(), piped.policy.named_parameters()):
            assert torch.equal(p, q), name
    finally:
        _finish(sync)
        _finish(piped)


def _cli(model_dir, run_dir, steps, *extra):
    args = tiny_overrides(model_dir, run_dir, steps=steps, dense_reward=True) + ["optim.warmup_steps=1", *extra]
    return subprocess.Popen([sys.executable, "-m", "rlalign.cli.main", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def test_k1_runs_are_bitwise_reproducible_also_across_a_kill_and_resume(arithmetic_model_dir, tmp_path):
    """Two k = 1 runs of 5 steps, and a third killed (SIGKILL) after its step 2 record and resumed: its checkpoint
    holds the samples generated ahead (drawn by a version older than its weights) and, for run.verify_behaviour,
    that version's weights. Every metric value and the final weights equal."""
    extra = ("rollout.async_steps=1", "run.verify_behaviour=true")
    first, second, cut = tmp_path / "a", tmp_path / "b", tmp_path / "cut"
    run_training(_cfg(arithmetic_model_dir, first, 5, *extra))
    run_training(_cfg(arithmetic_model_dir, second, 5, *extra))
    killed = _cli(arithmetic_model_dir, cut, 5, *extra)
    metrics, deadline = cut / "metrics.jsonl", time.time() + 600
    while time.time() < deadline and killed.poll() is None:
        if metrics.exists() and any(json.loads(line).get("step") == 2 for line in metrics.read_text().splitlines()
                                    if line.strip()):
            break
        time.sleep(0.02)
    assert killed.poll() is None, "the run ended before it could be killed: " + killed.stderr.read()[-500:]
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    assert 1 <= load_latest_checkpoint(cut)["step"] < 5
    resumed = _cli(arithmetic_model_dir, cut, 5, *extra, "run.resume=true")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()[-2000:]
    assert metric_differences(first, second) == [] and weight_differences(first, second) == []
    assert metric_differences(first, cut) == [] and weight_differences(first, cut) == []
    records = read_metrics(first)[1:]
    assert [r["offpolicy/staleness_max"] for r in records] == [0, 1, 1, 1, 1]
    assert [r["offpolicy/behaviour_version"] for r in records] == [0, 0, 1, 2, 3]
    assert all(r["verify/behaviour_mismatch"] == 0 and r["verify/behaviour_tokens"] > 0 for r in records)
    assert sum(r["grad_norm"] > 0 for r in records) >= 3
    assert any(r["offpolicy/weight_max"] != 1.0 for r in records[1:]), "no stale sample was reweighted"
    assert all(r["verify/unverified_tokens"] == 0 for r in read_metrics(cut)[1:])   # the versions came from the checkpoint


def test_verify_behaviour_catches_one_flipped_bit(arithmetic_model_dir, tmp_path):
    """Flip the lowest bit of one recorded behaviour log-prob of step 2 (drawn by version 0, trained at version 1):
    the recompute under version 0 names exactly that one token."""
    trainer = _trainer(arithmetic_model_dir, tmp_path / "run", "rollout.async_steps=1", "run.verify_behaviour=true",
                       "run.on_mismatch=stop")
    try:
        assert trainer.train_step(1)["verify/behaviour_mismatch"] == 0
        trainer.step = 1
        trainer.source._wait_all()
        samples, stats, t = trainer.source._ready[2]
        flipped = samples.logprobs.clone()
        flipped.view(torch.int32)[5] ^= 1
        trainer.source._ready[2] = (samples.__class__(**{**sources.samples_state(samples), "logprobs": flipped}),
                                      stats, t)
        with pytest.raises(MismatchError, match="step 2: 1 of \\d+ behaviour log-probs differ .*first: token 5, version 0"):
            trainer.train_step(2)
    finally:
        _finish(trainer)


def test_unsupported_settings_are_refused_in_one_line(arithmetic_model_dir, tmp_path):
    from rlalign.train.engines import WeightsSharingError, weights_path
    cfg = _cfg(arithmetic_model_dir, tmp_path / "r", 2, "rollout.async_steps=1", "rollout.share_weights=true")
    with pytest.raises(WeightsSharingError, match="rollout.async_steps=1 samples from an older weights version"):
        weights_path(cfg)
    assert not weights_path(_cfg(arithmetic_model_dir, tmp_path / "r", 2, "rollout.async_steps=1")).shared
    with pytest.raises(Exception, match="rollout.partial_tokens=2 does not support task.env"):
        Trainer(_cfg(arithmetic_model_dir, tmp_path / "g", 2, "rollout.async_steps=1", "rollout.partial_tokens=2",
                     "task.env=retry_arithmetic", "task.reward=builtin"))
