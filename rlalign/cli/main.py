"""The ``rlalign`` command: one sub-command per module in rlalign.cli."""

from __future__ import annotations

import argparse
import importlib
import sys

from rlalign import ompwait

# before anything imports torch (mklmode does, below): libgomp reads its wait policy once, when torch loads it
ompwait.apply()

from rlalign import envvars, mklmode  # noqa: E402  (after the wait policy: see above)
from rlalign.contract.errors import RLAlignError
from rlalign.version import __version__

COMMANDS = ("train", "generate", "parity", "report", "export", "checksum", "bench", "doctor", "pretrain", "sft")


class OneLineParser(argparse.ArgumentParser):
    """An argument error is one line, ``rlalign <cmd>: error: <message>`` (exit 2), as every other error of the
    command; ``--help`` shows the usage. Sub-command parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="rlalign", description="RL post-training with bit-identical rollout and training log-probs")
    parser.add_argument("--version", action="version", version=f"rlalign {__version__}")
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
        envvars.check_environment()   # every RLALIGN_* variable set is one rlalign reads, with an allowed value
        if getattr(args, "profile", None) != "native":
            mklmode.pin()   # before any MKL call (cross-machine mode): strict bits then equal on every x86 CPU
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("rlalign: interrupted", file=sys.stderr)
        return 130
    except RLAlignError as exc:
        print(f"rlalign {_command(args)}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:   # disk full, read-only filesystem, permissions: the environment, not a bug
        print(f"rlalign {_command(args)}: error: {os_error_line(exc)}{_RESUME_HINT.get(args.command, '')}",
              file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:
        print(f"rlalign {_command(args)}: error: a file is not UTF-8 text ({exc.reason} at byte {exc.start}); "
              "save it as UTF-8", file=sys.stderr)
        return 2


def _command(args) -> str:
    """The command as typed: ``train``, or ``bench rollout`` for a benchmark."""
    return " ".join(filter(None, (args.command, getattr(args, "benchmark", None))))


_RESUME_HINT = {"train": "; the last checkpoint is intact: fix this and continue with run.resume=true"}


def os_error_line(exc: OSError) -> str:
    """``No space left on device: /runs/x/metrics.jsonl`` (strerror and the file(s) involved)."""
    where = ", ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
    return (exc.strerror or str(exc) or exc.__class__.__name__) + (f": {where}" if where else "")


if __name__ == "__main__":
    sys.exit(main())
