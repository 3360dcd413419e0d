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


def test_the_docs_env_runs_on_the_default_model(tmp_path, monkeypatch):
    """docs/agents.md's my_env.py, as written there, plays episodes on the embedded default model."""
    import re
    from pathlib import Path

    from rlalign.envs import EpisodeLimits, load_env, run_episodes
    from rlalign.models import load_model
    from rlalign.models.tokenizer import load_tokenizer
    from rlalign.rollout import RolloutEngine, SamplingParams
    from rlalign.tasks import ArithmeticTask
    from rlalign.train.setup import DEFAULT_MODEL_DIR

    doc = (Path(__file__).parents[2] / "docs" / "agents.md").read_text()
    (tmp_path / "my_env.py").write_text(re.search(r"```python\n# my_env.py\n(.*?)```", doc, re.S).group(1))
    monkeypatch.chdir(tmp_path)
    model, tokenizer = load_model(DEFAULT_MODEL_DIR)[0], load_tokenizer(DEFAULT_MODEL_DIR)
    rows = ArithmeticTask().train_problems(0, 3)
    episodes = run_episodes(RolloutEngine(model, tokenizer=tokenizer), tokenizer,
                            [tokenizer.encode(r.prompt) for r in rows], rows, load_env("my_env.py:GuessTheSum",
                                                                                      {"tries": 3}),
                            SamplingParams(n=4, seed=2), EpisodeLimits(3, 32, 6))
    assert len(episodes) == 12 and all(1 <= e.num_turns <= 3 for e in episodes)
    assert any(e.num_turns > 1 and e.generated.count(False) for e in episodes)   # a retry saw the problem again
    for e in episodes:
        assert e.episode_return == (1.0 if e.finish_reason == "done" and e.turn_rewards[-1] == 1.0 else 0.0)
