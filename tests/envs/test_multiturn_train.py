"""`rlalign train` with task.env: a multi-turn GRPO run whose every generated token agrees with the trainer."""

from __future__ import annotations

import dataclasses
import json

import torch

from rlalign.cli.main import main
from rlalign.configlib import load_config
from rlalign.train.config import TrainConfig
from rlalign.train.loop import Trainer, run_training
from rlalign.train.run.metrics import read_metrics


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


def test_the_step_record_carries_each_turn_and_per_turn_advantages_follow_it(tmp_path):
    """An episode's record: each token's turn (non-decreasing, observations on the turn they answer), each turn's
    return-to-go (turn 0's is the episode's reward, bit for bit), one weights version; ``algo.turn_advantage=turn``
    gives every token of a turn the same advantage, the per-episode one on turn 0 where every episode of a prompt
    has one turn only, and it survives ``select`` and a checkpoint's round trip."""
    from rlalign.train import advantages, sources
    from rlalign.train.samples import StepSamples
    from tests.bitwise import assert_bitwise_equal

    trainer = Trainer(load_config(TrainConfig, None, _overrides(tmp_path / "run", 1) + ["algo.turn_advantage=turn"]))
    try:
        samples, _ = trainer.sampler.draw_step(1)
        batch = trainer.train_batch(samples)
        lens, counts = samples.completion_lens.tolist(), samples.turn_counts.tolist()
        firsts = torch.cumsum(samples.turn_counts, 0) - samples.turn_counts
        assert_bitwise_equal(samples.turn_returns[firsts], samples.rewards)
        assert set(samples.versions.tolist()) == {trainer.engine.weights_version}
        for turns, n in zip(samples.turns.split(lens), counts):
            assert turns[0] == 0 and int(turns[-1]) == n - 1 and bool((turns.diff() >= 0).all())
        assert max(counts) > 1, "no episode took a second turn"
        adv = advantages.token_advantages(trainer.cfg.algo, samples, batch, None, None)[0]
        episode = advantages.token_advantages(
            dataclasses.replace(trainer.cfg.algo, turn_advantage="episode"), samples, batch, None, None)[0]
        key = batch.seq_ids * 16 + samples.turns
        for k in torch.unique(key[batch.mask]).tolist():
            assert torch.unique(adv[(key == k) & batch.mask]).numel() == 1
        single = torch.tensor([max(c for c, g in zip(counts, samples.group_ids.tolist()) if g == group) == 1
                               for group in samples.group_ids.tolist()])[batch.seq_ids]
        assert_bitwise_equal(adv[single], episode[single])
        assert not torch.equal(adv, episode)
        keep = torch.arange(len(samples)) % 3 != 1
        picked = samples.select(keep)
        assert picked.turn_returns.numel() == int(picked.turn_counts.sum()) == int(samples.turn_counts[keep].sum())
        again = StepSamples(**sources.samples_state(samples))
        assert all(torch.equal(getattr(again, f), getattr(samples, f)) for f in ("turns", "turn_returns", "turn_counts"))
    finally:
        trainer.close()
        trainer.run_lock.release()


def test_multi_turn_async_steps_verify_behaviour_bit_for_bit(tmp_path):
    """task.env with rollout.async_steps=1: the episodes of step t are drawn by version t - 2 in the worker thread;
    every generated token's behaviour log-prob equals a trainer forward under that version (0 differ), observation
    tokens are neither compared nor counted stale, and the per-turn advantages train on them."""
    run_dir = run_training(load_config(TrainConfig, None, _overrides(tmp_path / "run", 3) + [
        "rollout.async_steps=1", "run.verify_behaviour=true", "algo.turn_advantage=turn", "run.eval_every=3"]))
    steps = [r for r in read_metrics(run_dir) if "verify/behaviour_tokens" in r]
    assert [r["offpolicy/behaviour_version"] for r in steps] == [0, 0, 1]
    assert [r["offpolicy/staleness_max"] for r in steps] == [0, 1, 1]
    for r in steps:
        generated = round(16 * r["episodes/generated_tokens"])
        assert r["verify/behaviour_mismatch"] == 0 and r["verify/unverified_tokens"] == 0
        assert r["verify/behaviour_tokens"] == generated
    assert steps[0]["mismatch/tokens"] == round(16 * steps[0]["episodes/generated_tokens"]) and steps[0]["mismatch/count"] == 0
    assert steps[1]["mismatch/tokens"] == 0   # every sample stale: the agreement check has no fresh token
    assert any(r["offpolicy/weight_max"] != 1.0 for r in steps[1:]), "no stale token was reweighted"


def test_episode_advantages_reproduce_the_recorded_multi_turn_run(tmp_path):
    """configs/multi-turn-cpu.yaml (algo.turn_advantage=episode, the default): its evaluation and first two steps log
    every value of benchmarks/evidence/multi-turn-cpu/metrics.jsonl bit for bit (timings and memory aside)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(TrainConfig, root / "configs" / "multi-turn-cpu.yaml",
                      [f"run.dir={tmp_path / 'run'}", "run.progress=false", "run.stop_at_step=2",
                       "run.save_checkpoints=false"])
    got = read_metrics(run_training(cfg))
    recorded = {r["step"]: r for r in map(json.loads, (root / "benchmarks" / "evidence" / "multi-turn-cpu" /
                                                     "metrics.jsonl").read_text().splitlines())}
    assert [r["step"] for r in got] == [0, 1, 2]
    for r in got:
        want = {k: v for k, v in recorded[r["step"]].items() if not k.startswith(("time/", "tokens_per_s/", "memory/"))}
        assert {k: r.get(k) for k in want} == want, f"step {r['step']}"
