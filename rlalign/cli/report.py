"""``rlalign report RUN_DIR [RUN_DIR ...]``."""

from __future__ import annotations

import sys

from rlalign.contract.errors import RLAlignError
from rlalign.train.run.report import write_report


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="plot runs' metrics (PNG; several runs overlaid) and write a Markdown summary")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default=None, help="where several runs' compare.png/.md go (default: the first run's directory)")
    p.add_argument("--smooth", type=float, default=0.6,
                   help="EMA weight of the past for noisy series, in [0, 1) (0: raw only; default 0.6)")
    p.set_defaults(func=run)


def run(args) -> int:
    if not 0.0 <= args.smooth < 1.0:
        raise RLAlignError(f"--smooth must be in [0, 1), got {args.smooth}")
    notes: list[str] = []
    png, md = write_report(args.run_dirs, args.out, smooth=args.smooth, notes=notes)
    for note in notes:
        print(f"rlalign report: note: {note}", file=sys.stderr)
    print(f"wrote {png}\nwrote {md}")
    return 0
