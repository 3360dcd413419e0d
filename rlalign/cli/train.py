"""``rlalign train [CONFIG.yaml] [section.key=value ...]``: the main job."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from rlalign.configlib import describe
from rlalign.integrations.ray import run_training_on_ray
from rlalign.models.ownership import refuse_overlap
from rlalign.train.budget import format_budget, memory_budget
from rlalign.train.config import TrainConfig
from rlalign.train.run.logs import install_cli_handler
from rlalign.train.loop import run_training
from rlalign.train.run.report import write_report
from rlalign.train.run.config_file import config_yaml, resolve_train_config
from rlalign.train.run.metrics import read_metrics
from rlalign.train.setup import build_task, load_policy


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="GRPO/PPO-family RL training (no arguments: the embedded default)",
                              description="GRPO/PPO-family RL training. Every key below can be set in the YAML "
                                          "config or on the command line as section.key=value.",
                              epilog=config_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="YAML config (sections model, task, rollout, algo, optim, run, ...)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01 run.dir=runs/x")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (every key, as config.yaml would hold it) and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve and validate the config, load the model and the task, print the config and the first "
                        "training prompt as the model receives it, and the memory budget; no training")
    p.set_defaults(func=run)


def config_keys_help() -> str:
    """The config's sections and keys with defaults and one-line meanings (from rlalign.train.config)."""
    rows = describe(TrainConfig)
    width = max(len(k) + len(d) for k, d, _ in rows) + 3
    lines, section = ["config keys (section.key = default  meaning):"], None
    for key, default, meaning in rows:
        head = key.split(".")[0] if "." in key else ""
        if head != section:
            section = head
            lines.append(f"\n  {head or 'top level'}:")
        lines.append(f"    {f'{key} = {default}':<{width}} {meaning}".rstrip())
    return "\n".join(lines)


def run(args) -> int:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config] + overrides   # `rlalign train run.steps=5`: overrides only
    cfg = resolve_train_config(config, overrides)
    if args.print_config:
        print(config_yaml(cfg), end="")
        return 0
    if args.dry_run:
        return _dry_run(cfg)
    if config is not None and cfg.run.overwrite and not cfg.run.resume:   # the trainer checks the run's other inputs
        refuse_overlap(Path(cfg.run.dir), "run.dir (run.overwrite=true would delete in it)", [Path(config)])
    console = Console(stderr=True, soft_wrap=True)   # no hard wrapping of paths in batch logs
    install_cli_handler(console)
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


def _dry_run(cfg) -> int:
    """Everything a run checks before its first step, without writing a run directory; shows the first
    training prompt rendered as the model receives it (chat template applied, decoded from its token ids)."""
    policy, tokenizer, model_dir = load_policy(cfg.model)
    task = build_task(cfg.task, tokenizer, cfg.run.seed, cfg.model.device)   # starts the reward's worker: the reward loads
    try:
        first = task.train(0, 1)[0]
        ids = task.encode(first.prompt)
    finally:
        task.close()
    print(config_yaml(cfg), end="")
    print(f"# dry run: model {model_dir} ({sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M parameters) "
          f"loaded; task ready ({len(task.eval_problems())} eval problems); nothing was trained or written")
    print(f"# first training prompt as the model receives it ({len(ids)} tokens, decoded with special tokens):")
    print("\n".join(f"#   {line}" for line in tokenizer.decode(ids, skip_special_tokens=False).split("\n")))
    print(f"# its reference answer: {repr(first.answer)[:200]}")
    print("# memory budget (arithmetic from tensor sizes: python -m rlalign.train.budget; docs/gpu.md):")
    print("\n".join("# " + line for line in format_budget(memory_budget(cfg, policy.config)).splitlines()))
    return 0
