"""``rollout.logprobs=sampled``: a short GRPO run from the CLI has zero log-prob mismatches (raw bits) with the
kept-set log-probs, the on-policy ratio is exactly 1 before the update, the metrics carry both log-probs and the
kept-set sizes; settings that cannot honour it are refused in one line."""

import json

import pytest
import torch

from rlalign.cli.main import main
from rlalign.configlib import load_config
from rlalign.contract import use_profile
from rlalign.train.config import TrainConfig
from rlalign.train.loop import Trainer
from tests.bitwise import assert_bitwise_equal
from tests.train.conftest import tiny_overrides

SAMPLED = ["rollout.logprobs=sampled", "rollout.top_p=0.8"]


def test_cli_grpo_run_has_no_mismatch_and_logs_both_logprobs(arithmetic_model_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["train", *tiny_overrides(arithmetic_model_dir, run, steps=2), *SAMPLED]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == 2
    for r in steps:
        assert r["mismatch/tokens"] > 0 and r["mismatch/count"] == 0, r
        assert r["kl/ppo"] == 0.0 and r["clip_frac"] == 0.0, r   # one mini-batch: ratio 1 before the optimizer step
        assert r["logprob/sampled_mean"] >= r["logprob/full_mean"], r
        assert 0.0 < r["logprob/full_over_sampled_ratio_mean"] <= 1.0, r
        assert 1 <= r["kept/min"] <= r["kept/mean"] <= r["kept/max"], r
    assert max(r["kept/max"] for r in steps) >= 2, "every kept set had one token: the test proves nothing"
    assert min(r["logprob/full_over_sampled_ratio_mean"] for r in steps) < 1.0, "top_p=0.8 never truncated"


def test_ratio_is_exactly_one_before_the_update(arithmetic_model_dir, tmp_path):
    cfg = load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / "run", 1) + SAMPLED)
    trainer = Trainer(cfg)
    try:
        trainer.resume_if_asked()
        with use_profile("strict"):
            samples, _ = trainer.sampler.draw_step(1)
            batch = trainer.train_batch(samples)
            lp, _ = batch.score(trainer.policy, temperature=cfg.rollout.logprob_temperature,
                                sampled=cfg.rollout.sampled_scoring)
            full, _ = batch.score(trainer.policy, temperature=cfg.rollout.logprob_temperature)
        assert_bitwise_equal(lp, batch.rollout_logprobs, "trainer vs engine sampled log-probs")
        assert bool((torch.exp(lp - batch.rollout_logprobs) == 1.0).all())
        assert bool((full <= lp).all()) and bool((full < lp).any()), "the full softmax never differed"
    finally:
        trainer.close()
        if trainer.run_lock is not None:
            trainer.run_lock.release()


@pytest.mark.parametrize("extra, message", [
    (["run.profile=native"], "rollout.logprobs=sampled needs run.profile=strict and no parallel.tp"),
    (["parallel.tp=2"], "rollout.logprobs=sampled needs run.profile=strict and no parallel.tp"),
    (["rollout.engine=vllm"], "logprobs=sampled and min_p need engine=rlalign"),
    (["algo.mini_batches=2"], "needs algo.mini_batches=1, algo.ppo_epochs=1 and run.policy_kl=false"),
    (["algo.ppo_epochs=2"], "needs algo.mini_batches=1, algo.ppo_epochs=1 and run.policy_kl=false"),
    (["run.policy_kl=true"], "needs algo.mini_batches=1, algo.ppo_epochs=1 and run.policy_kl=false"),
    (["rollout.async_steps=1"], "rollout.logprobs=sampled needs rollout.async_steps=0"),
])
def test_unsupported_combinations_are_one_line(extra, message, capsys):
    assert main(["train", "--dry-run", *SAMPLED, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlalign train: error: ") and "\n" not in err and message in err, err


def test_vllm_engine_refuses_sampled_logprobs_and_min_p():
    from rlalign.integrations.vllm.engine import check_sampling   # no vLLM needed: the check runs before it
    from rlalign.integrations.vllm.errors import UnsupportedVLLMConfigError
    from rlalign.rollout import SamplingParams
    check_sampling(SamplingParams())
    for kw in (dict(logprobs="sampled"), dict(min_p=0.1)):
        with pytest.raises(UnsupportedVLLMConfigError, match="reports full-softmax log-probs without min-p") as err:
            check_sampling(SamplingParams(**kw))
        assert "\n" not in str(err.value)
