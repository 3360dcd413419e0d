"""``rlalign train [CONFIG.yaml] [section.key=value ...]``: the main job."""

from __future__ import annotations

from rich.console import Console

from rlalign.configlib import load_config
from rlalign.integrations.ray import run_training_on_ray
from rlalign.train.config import TrainConfig
from rlalign.train.loop import run_training
from rlalign.train.report import write_report
from rlalign.train.runio import read_metrics


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="GRPO/PPO-family RL training (no arguments: the embedded default)")
    p.add_argument("config", nargs="?", help="YAML config (sections model, task, rollout, algo, optim, run)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01 run.dir=runs/x")
    p.set_defaults(func=run)


def run(args) -> int:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config] + overrides   # `rlalign train run.steps=5`: overrides only
    cfg = load_config(TrainConfig, config, overrides)
    console = Console(stderr=True)
    if cfg.launcher == "ray":   # the trainer and the rollout workers as Ray actors (docs/ray.md)
        run_dir = run_training_on_ray(cfg, console)
    else:
        run_dir = run_training(cfg, console)
    png, md = write_report(run_dir)
    records = read_metrics(run_dir)
    evals = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    mism = sum(r.get("mismatch/count", 0) for r in records)
    compared = sum(r.get("mismatch/tokens", 0) for r in records)
    if evals:
        console.print(f"eval accuracy {evals[0]:.3f} -> {evals[-1]:.3f}; logprob mismatches: {mism} of {compared} tokens")
    console.print(f"run directory: {run_dir}\nreport: {md} and {png} (regenerate with `rlalign report {run_dir}`)\n"
                  f"policy (Hugging Face format): {run_dir / 'policy'}")
    return 0
