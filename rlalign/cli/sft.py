"""``rlalign sft CONFIG.yaml [section.key=value ...]``: supervised fine-tuning on JSONL (docs/sft.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from rlalign.configlib import describe
from rlalign.models.ownership import refuse_overlap
from rlalign.train.run.config_file import config_yaml
from rlalign.train.run.logs import install_cli_handler
from rlalign.train.run.metrics import read_metrics
from rlalign.train.run.report import write_report
from rlalign.train.sft.config import SFTConfig
from rlalign.train.sft.loop import resolve_sft_config, run_sft


def register(subparsers) -> None:
    p = subparsers.add_parser("sft", help="supervised fine-tuning on prompt/response or chat JSONL (docs/sft.md)",
                              description="Supervised fine-tuning: loss on response (assistant) tokens only, packed "
                                          "sequences, the strict ops. Every key below can be set in the YAML config "
                                          "or on the command line as section.key=value.",
                              epilog=_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="YAML config (sections model, data, optim, run)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.path=train.jsonl run.dir=runs/sft")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=run)


def _keys_help() -> str:
    rows = describe(SFTConfig)
    width = max(len(k) + len(d) for k, d, _ in rows) + 3
    return "config keys (section.key = default  meaning):\n" + "\n".join(
        f"    {f'{k} = {d}':<{width}} {m}".rstrip() for k, d, m in rows)


def run(args) -> int:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config] + overrides   # `rlalign sft data.path=x.jsonl`: overrides only
    cfg = resolve_sft_config(config, overrides)
    if args.print_config:
        print(config_yaml(cfg), end="")
        return 0
    if config is not None and cfg.run.dir and cfg.run.overwrite:
        refuse_overlap(Path(cfg.run.dir), "run.dir (run.overwrite=true would delete in it)", [Path(config)])
    console = Console(stderr=True, soft_wrap=True)
    install_cli_handler(console)
    run_dir = run_sft(cfg)
    png, md = write_report(run_dir)
    evals = [r["eval/loss"] for r in read_metrics(run_dir) if r.get("eval/loss") is not None]
    if evals:
        console.print(f"eval loss {evals[0]:.4f} -> {evals[-1]:.4f}")
    console.print(f"run directory: {run_dir}\nreport: {md} and {png}\n"
                  f"model (Hugging Face format): {run_dir / 'policy'} (rlalign train model.path={run_dir / 'policy'})")
    return 0
