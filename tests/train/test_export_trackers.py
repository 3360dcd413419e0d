"""Intermediate checkpoints: kept per run.keep_checkpoints and exported to Hugging Face format;
trackers (TensorBoard, W&B offline) with verl / TRL metric names."""

import pytest
import torch

from rlalign.cli.main import main
from rlalign.configlib import load_config
from rlalign.models.checkpoint import load_model
from rlalign.train.config import LOGGERS, TrainConfig
from rlalign.train.loop import run_training
from rlalign.train.run.trackers import ALIASES, TRACKERS, rename
from tests.bitwise import assert_bitwise_equal
from tests.train.conftest import tiny_overrides


@pytest.fixture(scope="module")
def tracked_run(arithmetic_model_dir, tmp_path_factory):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")   # no network, no account
    mp.setenv("WANDB_SILENT", "true")
    try:
        cfg = load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, run_dir, steps=3, dense_reward=True) + [
            "run.keep_checkpoints=3", "run.loggers=[jsonl,tensorboard,wandb]", "run.metric_names=trl",
            "run.policy_kl=true"])
        run_training(cfg)
    finally:
        mp.undo()
    return run_dir


def test_intermediate_checkpoints_export_to_hugging_face(tracked_run, tmp_path):
    files = sorted((tracked_run / "checkpoints").glob("step_*.pt"))
    assert [f.name for f in files] == ["step_000001.pt", "step_000002.pt", "step_000003.pt"]   # keep_checkpoints=3
    out = tmp_path / "hf_step1"
    assert main(["export", str(files[0]), str(out)]) == 0
    exported, _ = load_model(out)
    state = torch.load(files[0], weights_only=True)
    for name, p in exported.named_parameters():
        assert_bitwise_equal(p.detach(), state["model"][name], name)
    assert (out / "tokenizer.json").exists()
    import transformers
    assert transformers.AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen3"
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2   # one-line error, exit 2


def test_tensorboard_and_wandb_offline_receive_trl_names(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tracked_run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "learning_rate"} <= tags
    assert [e.step for e in acc.Scalars("reward")] == [1, 2, 3]
    runs = list((tracked_run / "wandb").glob("offline-run-*"))
    assert runs and any(f.suffix == ".wandb" for f in runs[0].iterdir())


def test_policy_step_kl_is_logged_and_moves_with_the_update(tracked_run):
    from rlalign.train.run.metrics import read_metrics
    steps = [r for r in read_metrics(tracked_run) if "reward/mean" in r]
    assert all("kl/policy_step" in r for r in steps)
    assert any(r["kl/policy_step"] > 0 for r in steps if r["grad_norm"] > 0)
    assert all(r["kl/policy_step"] == 0 for r in steps if r["grad_norm"] == 0)


def test_aliases_keep_unmapped_names():
    record = {"reward/mean": 0.5, "mismatch/count": 0, "loss/kl": 0.1, "kl/ref": 0.2}
    assert rename(record, "trl") == {"reward": 0.5, "mismatch/count": 0, "loss/kl": 0.1, "kl": 0.2}
    assert rename(record, "rlalign") == record
    for table in ALIASES.values():
        assert all("/" in k or k in ("entropy", "clip_frac", "grad_norm", "lr") for k in table)


def test_every_configurable_logger_has_a_tracker():
    """run.loggers accepts the names of rlalign.train.config.LOGGERS; each has its entry in TRACKERS."""
    assert tuple(TRACKERS) == LOGGERS


def test_tensorboard_resume_purges_the_killed_runs_later_steps_and_overwrite_deletes_only_its_files(tmp_path):
    pytest.importorskip("tensorboard")
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlalign.train.run.directory import previous_run_files
    from rlalign.train.run.trackers import TensorBoardTracker

    cfg = SimpleNamespace()
    first = TensorBoardTracker(tmp_path, cfg)               # a run that logged steps 1..4, then was killed
    for step in (1, 2, 3, 4):
        first.log({"loss": float(step)}, step)
    first.close()
    resumed = TensorBoardTracker(tmp_path, cfg, start_step=2)   # resumed from the checkpoint of step 2
    for step in (3, 4, 5):
        resumed.log({"loss": 10.0 * step}, step)
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]

    foreign = tmp_path / "tensorboard" / "events.out.tfevents.someone-elses"
    foreign.write_bytes(b"not ours")
    doomed = previous_run_files(tmp_path)
    events = sorted(p.name for p in (tmp_path / "tensorboard").iterdir() if p.name.startswith("events.out.tfevents."))
    assert len(events) == 3
    assert sorted(p.name for p in doomed) == sorted([*(e for e in events if e != foreign.name), "rlalign-event-files"])
