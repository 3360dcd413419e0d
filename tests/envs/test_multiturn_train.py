"""`rlalign train` with task.env: a multi-turn GRPO run whose every generated token agrees with the trainer."""

from __future__ import annotations

import json

import torch

from rlalign.cli.main import main
from rlalign.configlib import load_config
from rlalign.train.config import TrainConfig
from rlalign.train.loop import Trainer, run_training


def _overrides(run_dir, steps=2):
    return ["task.env=retry_arithmetic", "task.max_turns=3", "task.max_episode_tokens=24", f"run.dir={run_dir}",
            f"run.steps={steps}", "run.eval_every=2", "run.save_checkpoints=false", "run.progress=false",
            "run.on_mismatch=stop", "run.eval_samples=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "task.eval_size=4", "optim.lr=1e-3"]


def test_multi_turn_run_has_zero_mismatches(tmp_path):
    run_dir = run_training(load_config(TrainConfig, None, _overrides(tmp_path / "run")))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "mismatch/count" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["mismatch/count"] == 0
        # every generated token compared, no observation token: 16 episodes x the mean generated tokens
        assert r["mismatch/tokens"] == round(16 * r["episodes/generated_tokens"])
        assert 1 <= r["episodes/turns"] <= 3 and r["episodes/observation_tokens"] >= 0
    assert {"eval/accuracy", "eval/return", "eval/return_greedy"} <= set(records[-1])


def test_observation_tokens_are_out_of_the_loss(tmp_path):
    trainer = Trainer(load_config(TrainConfig, None, _overrides(tmp_path / "run", 1)))
    try:
        samples, stats = trainer.sampler.draw_step(1)
        batch = trainer.train_batch(samples)
        assert torch.equal(batch.mask, samples.generated) and not bool(samples.generated.all())
        assert stats["episodes/observation_tokens"] > 0
        # an observation token's slot holds no rollout log-prob
        assert not batch.rollout_logprobs[~batch.generated].any()
    finally:
        trainer.close()
        trainer.run_lock.release()


def test_a_bad_env_is_one_cli_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "task.env=missing_env.py:Env", f"run.dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rlalign train: error: env 'missing_env.py:Env': file 'missing_env.py' not found")
