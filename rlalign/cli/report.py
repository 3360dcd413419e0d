"""``rlalign report RUN_DIR``."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="plot a run's metrics (PNG) and write a Markdown summary")
    p.add_argument("run_dir")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    from rlalign.train.report import write_report
    notes: list[str] = []
    png, md = write_report(args.run_dir, notes)
    for note in notes:
        print(f"rlalign report: note: {note}", file=sys.stderr)
    print(f"wrote {png}\nwrote {md}")
    return 0
