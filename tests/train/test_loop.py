"""The RL loop end to end on a tiny random model: metrics, zero mismatches, report, errors."""

import json
import subprocess
import sys

import pytest
import torch

from rlalign.configlib import load_config
from rlalign.train.config import TrainConfig
from rlalign.train.loop import MismatchError, Trainer, run_training
from rlalign.train.run.report import write_report
from rlalign.train.run.metrics import read_metrics
from tests.bitwise import assert_bitwise_equal
from tests.train.conftest import tiny_overrides

REQUIRED = ["step", "reward/mean", "reward/std", "mismatch/tokens", "mismatch/count", "mismatch/max_abs",
            "mismatch/mean_abs", "rollout_corr/kl_k3", "loss/policy", "loss/kl", "entropy", "clip_frac", "grad_norm",
            "time/rollout_s", "time/train_s", "tokens_per_s/rollout", "memory/peak_mb"]


def test_strict_run_has_zero_mismatches_and_full_metrics(arithmetic_model_dir, tmp_path):
    cfg = load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / "run") + ["algo.kl_coef=0.01"])
    run_dir = run_training(cfg)
    records = read_metrics(run_dir)
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert set(REQUIRED) <= set(r), set(REQUIRED) - set(r)
        assert r["mismatch/count"] == 0 and r["mismatch/tokens"] > 0
        assert r["mismatch/max_abs"] == 0.0
    assert records[0]["step"] == 0 and "eval/accuracy" in records[0]
    assert "eval/accuracy" in steps[1] and "eval/accuracy" in steps[2]
    png, md = write_report(run_dir)
    assert png.stat().st_size > 10_000 and "mismatches: 0 of" in md.read_text()
    policy = run_dir / "policy"
    assert (policy / "config.json").exists() and (policy / "tokenizer.json").exists()
    # the trained policy loads in transformers and in `rlalign generate`
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(policy)
    assert hf.config.model_type == "qwen3"
    out = _cli("generate", "--model", str(policy), "--prompt", "12+34=", "--max-new-tokens", "4", "--json")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["completions"][0]["tokens"]) >= 1


def test_native_profile_reports_and_corrects(arithmetic_model_dir, tmp_path):
    over = tiny_overrides(arithmetic_model_dir, tmp_path / "run", steps=1) + [
        "run.profile=native", "algo.mismatch_correction=token_tis"]
    records = read_metrics(run_training(load_config(TrainConfig, None, over)))
    step = records[-1]
    assert step["mismatch/tokens"] > 0 and "rollout_corr/truncated_frac" in step


@pytest.mark.parametrize("algo", [["algo.advantage=rloo", "algo.policy_loss=gspo", "algo.loss_agg=seq-mean-token-mean"],
                                  ["algo.advantage=dr_grpo", "algo.policy_loss=cispo", "algo.entropy_coef=0.01"],
                                  ["algo.advantage=reinforce_pp", "algo.dual_clip=3.0", "algo.overlong_filter=true",
                                   "algo.loss_agg=seq-mean-token-sum-norm"],
                                  ["algo.advantage=gae", "algo.kl_coef=0.05", "algo.kl_in_reward=true",
                                   "optim.activation_checkpointing=true"],
                                  ["algo.dynamic_sampling=true", "algo.kl_coef=0.05", "algo.kl_estimator=k2"]],
                         ids=["rloo-gspo", "drgrpo-cispo-entropy", "rpp-dualclip-overlong", "ppo-gae-klreward-ckpt",
                              "dapo-dynamic-sampling"])
def test_algorithm_variants_run(arithmetic_model_dir, tmp_path, algo):
    records = read_metrics(run_training(load_config(TrainConfig, None,
                                                    tiny_overrides(arithmetic_model_dir, tmp_path / "r", 1) + algo)))
    last = records[-1]
    assert last["mismatch/count"] == 0 and torch.isfinite(torch.tensor(last["loss/policy"]))
    if "algo.advantage=gae" in algo:
        assert torch.isfinite(torch.tensor(last["loss/value"]))
    if "algo.dynamic_sampling=true" in algo:
        assert last["dynamic_sampling/kept_groups"] <= 4 and last["dynamic_sampling/drawn_groups"] >= 4


def test_activation_checkpointing_gives_the_same_bits(arithmetic_model_dir, tmp_path):
    """Recomputing layers in backward runs the same ops on the same inputs: identical update."""
    def weights(extra, name):
        trainer = Trainer(load_config(TrainConfig, None,
                                      tiny_overrides(arithmetic_model_dir, tmp_path / name, 1, dense_reward=True) + extra))
        trainer.resume_if_asked()
        trainer.train_step(1)
        return trainer.policy.state_dict()

    plain, ckpt = weights([], "a"), weights(["optim.activation_checkpointing=true"], "b")
    for k in plain:
        assert torch.equal(plain[k], ckpt[k]), k


def _gradients_of_one_step(model_dir, run_dir, extra):
    """The policy gradients the optimizer step receives at step 1 (captured at MasterWeights.step)."""
    trainer = Trainer(load_config(TrainConfig, None, tiny_overrides(model_dir, run_dir, 1, dense_reward=True) + extra))
    trainer.resume_if_asked()
    grads, step = [], trainer.master.step

    def capture(*args, **kwargs):
        grads.extend(p.grad.clone() for p in trainer.policy.parameters())
        return step(*args, **kwargs)

    trainer.master.step = capture
    trainer.train_step(1)
    return grads


def test_gradients_reproducible_and_close_across_micro_batch_splits(arithmetic_model_dir, tmp_path):
    """Run to run: bitwise. Across micro-batch splits: equal to fp32 rounding, NOT bitwise (docs/training.md)."""
    a = _gradients_of_one_step(arithmetic_model_dir, tmp_path / "a", ["optim.micro_batch_tokens=64"])
    b = _gradients_of_one_step(arithmetic_model_dir, tmp_path / "b", ["optim.micro_batch_tokens=64"])
    c = _gradients_of_one_step(arithmetic_model_dir, tmp_path / "c", ["optim.micro_batch_tokens=10000"])
    assert any(float(g.abs().max()) > 0 for g in a), "updates must be non-zero"
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert any(not torch.equal(x, z) for x, z in zip(a, c)), "expected the split to change some gradient bits"
    for x, z in zip(a, c):
        torch.testing.assert_close(x, z, rtol=1e-4, atol=1e-7)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "rlalign.cli.main", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def test_bad_config_key_is_one_line_error(tmp_path):
    out = _cli("train", "algo.kl_coeff=0.1")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "rlalign train: error: unknown config key algo.kl_coeff; did you mean algo.kl_coef, algo.entropy_coef?"]


def test_nan_reward_names_the_sample(arithmetic_model_dir, tmp_path):
    reward = tmp_path / "bad_reward.py"
    reward.write_text("def reward(prompt, completion, answer):\n    return float('nan')\n")
    out = _cli("train", *tiny_overrides(arithmetic_model_dir, tmp_path / "run", 1), f"task.reward={reward}:reward")
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "returned nan" in last and "sample 0" in last, last


def test_fresh_run_refuses_to_overwrite_an_existing_run(arithmetic_model_dir, tmp_path):
    over = tiny_overrides(arithmetic_model_dir, tmp_path / "run", 1)
    run_training(load_config(TrainConfig, None, over))
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    out = _cli("train", *over)
    assert out.returncode == 2 and "is not empty" in out.stderr.strip().splitlines()[-1]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


def test_missing_model_dir_is_clear(tmp_path):
    out = _cli("train", f"model.path={tmp_path / 'nope'}")
    assert out.returncode == 2 and "is not a directory" in out.stderr


def test_metrics_lines_are_json(arithmetic_model_dir, tmp_path):
    run_dir = run_training(load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / "run", 1)))
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        json.loads(line)


# ---- one TrainBatch per step: the strict profile forwards the policy once ------------------------------

TIMING = ("time/", "tokens_per_s/", "memory/")


def _trainer(model_dir, run_dir, extra, steps=1):
    trainer = Trainer(load_config(TrainConfig, None, tiny_overrides(model_dir, run_dir, steps, dense_reward=True) + extra))
    trainer.resume_if_asked()
    return trainer


def _count_policy_forwards(trainer, monkeypatch):
    """{'grad': n, 'no_grad': n}: the policy's packed forwards from now on."""
    from rlalign.models.decoder import CausalLM
    counts, original = {"grad": 0, "no_grad": 0}, CausalLM.forward_hidden

    def counted(model, batch):
        if model is trainer.policy:
            counts["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return original(model, batch)

    monkeypatch.setattr(CausalLM, "forward_hidden", counted)
    return counts


def _learning(record):
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


@pytest.mark.parametrize("extra", [[], ["algo.ppo_epochs=2", "algo.kl_coef=0.05", "algo.kl_in_reward=true",
                                        "algo.entropy_coef=0.01"]], ids=["default", "epochs2-klreward-entropy"])
def test_strict_step_forwards_the_policy_once_with_the_bits_of_the_rescore(arithmetic_model_dir, tmp_path, monkeypatch,
                                                                           extra):
    """Dropping the no-grad old-logprob forward changes no bit: the first update pass's forward (with grad)
    gives the same log-probs, so the same loss, update, entropy and mismatch check."""
    fused = _trainer(arithmetic_model_dir, tmp_path / "fused", extra)
    assert not fused.needs_rescore()
    counts, built, build = _count_policy_forwards(fused, monkeypatch), [], fused.train_batch
    fused.train_batch = lambda samples: built.append(build(samples)) or built[-1]
    records = [fused.train_step(1)]
    micro = len(built[0].micro_batches)
    epochs = fused.cfg.algo.ppo_epochs
    assert counts == {"grad": epochs * micro, "no_grad": 0}, (counts, micro)
    rescored = _trainer(arithmetic_model_dir, tmp_path / "rescored", extra)
    monkeypatch.setattr(rescored, "needs_rescore", lambda: True)
    records.append(rescored.train_step(1))
    assert _learning(records[0]) == _learning(records[1])
    assert records[0]["mismatch/count"] == 0 and records[0]["mismatch/tokens"] > 0
    for (name, a), b in zip(fused.policy.state_dict().items(), rescored.policy.state_dict().values()):
        assert_bitwise_equal(a, b, name)


def _nudge_first_rollout_logprob(trainer):
    draw = trainer.sampler.draw

    def nudged(*args, **kwargs):
        samples = draw(*args, **kwargs)
        samples.logprobs[0] -= 1e-3   # the engine's log-prob of the first completion token
        return samples

    trainer.sampler.draw = nudged


def test_strict_mismatch_is_found_without_the_rescore_and_the_step_is_as_before(arithmetic_model_dir, tmp_path,
                                                                                   monkeypatch):
    """on_mismatch=warn: the mismatch is counted and the update is today's (ratio against the trainer's
    own old log-probs), bit for bit the rescore path's."""
    fused = _trainer(arithmetic_model_dir, tmp_path / "fused", [])
    rescored = _trainer(arithmetic_model_dir, tmp_path / "rescored", [])
    monkeypatch.setattr(rescored, "needs_rescore", lambda: True)
    for trainer in (fused, rescored):
        _nudge_first_rollout_logprob(trainer)
    a, b = fused.train_step(1), rescored.train_step(1)
    assert a["mismatch/count"] == 1 and a["mismatch/max_abs"] > 5e-4
    assert _learning(a) == _learning(b)
    for (name, x), y in zip(fused.policy.state_dict().items(), rescored.policy.state_dict().values()):
        assert_bitwise_equal(x, y, name)


def test_strict_mismatch_stops_before_any_optimizer_step(arithmetic_model_dir, tmp_path):
    trainer = _trainer(arithmetic_model_dir, tmp_path / "run", ["run.on_mismatch=stop"])
    assert not trainer.needs_rescore()
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    _nudge_first_rollout_logprob(trainer)
    with pytest.raises(MismatchError, match="1 of .* token logprobs differ"):
        trainer.train_step(1)
    assert not trainer.update.optimizer.state   # AdamW never stepped
    for name, value in trainer.policy.state_dict().items():
        assert_bitwise_equal(value, before[name], name)


# ---- mini-batches and the logged lr ---------------------------------------------------------------------

def test_mini_batches_step_the_optimizer_per_mini_batch_and_clip(arithmetic_model_dir, tmp_path):
    trainer = _trainer(arithmetic_model_dir, tmp_path / "run", ["algo.mini_batches=2", "algo.ppo_epochs=2",
                                                                "algo.clip_low=0.001", "algo.clip_high=0.001"])
    assert trainer.needs_rescore()   # mini-batch 2 runs after an optimizer step: old log-probs come first
    calls, step = [], trainer.update.optimizer.step

    def counted(*args, **kwargs):
        calls.append(trainer.update.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    trainer.update.optimizer.step = counted
    record = trainer.train_step(1)
    assert len(calls) == 4 and len(set(calls)) == 1
    assert record["lr"] == calls[0] == pytest.approx(1e-2 / 5)   # warmup step 1 of 5: the lr used, not the next
    assert record["clip_frac"] > 0 and record["mismatch/count"] == 0


def test_value_lr_reaches_the_value_optimizer(arithmetic_model_dir, tmp_path):
    trainer = _trainer(arithmetic_model_dir, tmp_path / "run", ["algo.advantage=gae", "algo.value_lr=0.05"])
    assert trainer.update.value_optimizer.param_groups[0]["lr"] == 0.05


def test_cli_refuses_a_key_the_algorithm_does_not_read_in_one_line(tmp_path):
    out = _cli("train", f"run.dir={tmp_path / 'run'}", "algo.policy_loss=gspo", "algo.dual_clip=3.0")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "rlalign train: error: algo.dual_clip=3.0 has no effect with algo.policy_loss=gspo (only ppo_clip reads it): "
        "remove algo.dual_clip, or choose an algo.policy_loss that reads it"]
    assert not (tmp_path / "run").exists()


def test_max_minutes_without_checkpoints_stops_cleanly_and_writes_none(arithmetic_model_dir, tmp_path, rlalign_log):
    """run.save_checkpoints=false (a state too large for the disk): run.max_minutes still ends the run after a
    step with its metrics and exported policy, no checkpoint is written, and the note says it cannot resume."""
    cfg = load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / "run", steps=3)
                      + ["run.save_checkpoints=false", "run.max_minutes=0.000001"])
    run_dir = run_training(cfg)
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]
    assert not (run_dir / "checkpoints").exists() and (run_dir / "policy" / "config.json").is_file()
    assert "run.save_checkpoints=false: no checkpoint, the run cannot be resumed" in rlalign_log.text


def test_ignore_eos_samples_every_completion_to_its_limit(arithmetic_model_dir, tmp_path):
    """rollout.ignore_eos: no sample ends at <eos> (each is max_new_tokens long, all truncated), and the sampled
    <eos> tokens are scored like any other (0 mismatches); without it some samples of this model end early."""
    def first_step(ignore, name):
        cfg = load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / name, steps=1) +
                          ["rollout.max_new_tokens=12", "rollout.samples_per_prompt=8", f"rollout.ignore_eos={ignore}"])
        return [r for r in read_metrics(run_training(cfg)) if "reward/mean" in r][0]
    stopping, ignoring = first_step("false", "stop"), first_step("true", "ignore")
    assert stopping["completion/min_len"] < 12, "the test model must end some samples at <eos> by itself"
    assert ignoring["completion/min_len"] == ignoring["completion/max_len"] == 12
    assert ignoring["completion/truncated_frac"] == 1.0
    assert ignoring["mismatch/count"] == 0 and ignoring["mismatch/tokens"] == 4 * 8 * 12
