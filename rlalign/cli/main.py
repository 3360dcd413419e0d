"""The ``rlalign`` command: one sub-command per module in rlalign.cli."""

from __future__ import annotations

import argparse
import importlib
import sys

from rlalign.contract.errors import RLAlignError

COMMANDS = ("train", "generate", "parity", "report", "export", "bench", "doctor", "pretrain")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlalign", description="RL post-training with bit-identical rollout and training log-probs")
    parser.add_argument("--version", action="version", version=f"rlalign {__import__('rlalign').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"rlalign.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"rlalign.cli.{name}":
                continue  # command not part of this build
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("rlalign: interrupted", file=sys.stderr)
        return 130
    except RLAlignError as exc:
        print(f"rlalign {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
