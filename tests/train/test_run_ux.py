"""What a user sees of a run: plain per-step lines outside a terminal, the saved config.yaml, the
resume rules, --help / --print-config, the logged learning rate."""

import io
import subprocess
import sys
import time
from contextlib import redirect_stdout

import pytest
import yaml

from rlalign.cli.main import build_parser, main
from rlalign.configlib import ConfigError, describe, load_config
from rlalign.train.config import TrainConfig
from rlalign.train.loop import Trainer, run_training
from rlalign.train.run.config_file import resolve_train_config
from rlalign.train.run.metrics import read_metrics
from tests.train.conftest import DENSE_REWARD, tiny_overrides


def test_redirected_run_prints_a_line_per_step_while_it_runs(arithmetic_model_dir, tmp_path):
    """`rlalign train > log 2>&1`: the banner then one plain line per step appear while the run works."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    with open(log, "w") as out:   # a file: not a terminal
        proc = subprocess.Popen([sys.executable, "-m", "rlalign.cli.main", "train",
                                 *tiny_overrides(arithmetic_model_dir, run_dir, steps=50), "run.progress=true"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and "step 2/50 |" not in log.read_text():
            time.sleep(0.1)
        assert proc.poll() is None, f"the run ended before its second step line appeared:\n{log.read_text()}"
        text = log.read_text()
    finally:
        proc.kill()
        proc.wait()
    lines = text.splitlines()
    assert f"run directory {run_dir}" in lines[0] and str(run_dir / "config.yaml") in lines[1]
    step1 = next(line for line in lines if "step 1/50 |" in line)
    for field in ("reward", "mism 0/", "ent", "len", "clip", "lr", "rollout", "train", "eta"):
        assert field in step1, (field, step1)
    assert "\x1b[" not in text and "\r" not in text, "terminal control codes in a redirected log"
    # the config is part of the run from its start: config.yaml holds every key, resolved
    saved = load_config(TrainConfig, run_dir / "config.yaml")
    assert saved == load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, run_dir, steps=50)
                                + ["run.progress=true"])


def test_resume_uses_the_saved_config_and_refuses_meaning_changes(arithmetic_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    first = load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, run_dir, steps=1, dense_reward=True))
    run_training(first)
    step1 = read_metrics(run_dir)[-1]
    assert step1["lr"] == pytest.approx(first.optim.lr / first.optim.warmup_steps, rel=1e-12)  # the lr step 1 used

    # resuming names only the run directory: the task, reward, model and every other key come from config.yaml
    cfg = resolve_train_config(None, [f"run.dir={run_dir}", "run.resume=true", "run.steps=2"])
    assert cfg.task.reward == DENSE_REWARD and cfg.model.path == str(arithmetic_model_dir)
    assert cfg.optim.micro_batch_tokens == 64 and cfg.run.steps == 2

    for change, key in (("optim.micro_batch_tokens=128", "optim.micro_batch_tokens"), ("task.reward=builtin", "task.reward"),
                        ("optim.lr=0.5", "optim.lr")):
        changed = resolve_train_config(None, [f"run.dir={run_dir}", "run.resume=true", change])
        trainer = Trainer(changed)
        with pytest.raises(ConfigError, match=f"{key}.*run.resume_override=\\[{key}\\]"):
            trainer.resume_if_asked()
        trainer.run_lock.release()

    allowed = resolve_train_config(None, [f"run.dir={run_dir}", "run.resume=true", "run.steps=2", "optim.lr=0.001",
                                          "run.resume_override=[optim.lr]"])
    run_training(allowed)
    step2 = read_metrics(run_dir)[-1]
    assert step2["step"] == 2 and step2["lr"] == pytest.approx(0.001 * 2 / first.optim.warmup_steps, rel=1e-12)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["lr"] == 0.001


def test_help_lists_every_key_with_default_and_meaning():
    rows = describe(TrainConfig)
    missing = [key for key, _, meaning in rows if not meaning]
    assert not missing, f"config fields without a one-line meaning (add a trailing comment): {missing}"
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    text = train.format_help()
    for key, default, meaning in rows:
        assert f"{key} = {default}" in text and meaning in text, key


def test_print_config_is_the_resolved_config(tmp_path):
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["train", "--print-config", "run.steps=7", "algo.kl_coef=0.01"]) == 0
    path = tmp_path / "printed.yaml"
    path.write_text(out.getvalue())
    assert load_config(TrainConfig, path) == load_config(TrainConfig, None, ["run.steps=7", "algo.kl_coef=0.01"])


def test_dry_run_loads_everything_and_writes_nothing(arithmetic_model_dir, tmp_path):
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["train", "--dry-run", *tiny_overrides(arithmetic_model_dir, tmp_path / "run")]) == 0
    assert "# dry run: model" in out.getvalue() and not (tmp_path / "run").exists()
    with redirect_stdout(io.StringIO()):
        assert main(["train", "--dry-run", f"model.path={tmp_path / 'missing'}"]) == 2   # one-line error
