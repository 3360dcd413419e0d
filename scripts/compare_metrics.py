"""Compare two runs' metrics.jsonl value by value: "equal" or the first differing values, one line each.

    python scripts/compare_metrics.py RUN_A RUN_B [--ignore PREFIX ...]

RUN_A / RUN_B: run directories (or their metrics.jsonl). Keys that differ between two runs of the same
computation by nature are left out: wall-clock times and rates (``time/``, ``tokens_per_s/``) and the
measured peak memory (``memory/``); ``--ignore`` adds prefixes. Everything else -- rewards, losses,
gradient norms, mismatch counts, evals, lr -- must be the same value (JSON floats round-trip exactly, so
an equal value is an equal bit pattern). Exit status 0 when equal, 1 when not, 2 on unreadable input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlalign.contract.errors import RLAlignError
from rlalign.train.runio import read_metrics

VOLATILE = ("time/", "tokens_per_s/", "memory/")


def _records(path: Path) -> list[dict]:
    return read_metrics(path.parent if path.name == "metrics.jsonl" else path)


def differences(a: list[dict], b: list[dict], ignore: tuple[str, ...] = VOLATILE) -> list[str]:
    """One line per differing (step, key), and one for records present on one side only."""
    keep = lambda r: {k: v for k, v in r.items() if not k.startswith(ignore)}  # noqa: E731
    out = []
    if [r.get("step") for r in a] != [r.get("step") for r in b]:
        out.append(f"steps differ: {[r.get('step') for r in a]} vs {[r.get('step') for r in b]}")
    for x, y in zip(map(keep, a), map(keep, b)):
        for key in sorted(set(x) | set(y)):
            if x.get(key, "<absent>") != y.get(key, "<absent>"):
                out.append(f"step {x.get('step')}: {key}: {x.get(key, '<absent>')!r} vs {y.get(key, '<absent>')!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--ignore", action="append", default=[], help="another key prefix to leave out")
    args = p.parse_args(argv)
    try:
        a, b = _records(args.a), _records(args.b)
    except RLAlignError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    diff = differences(a, b, VOLATILE + tuple(args.ignore))
    compared = sum(len([k for k in r if not k.startswith(VOLATILE + tuple(args.ignore))]) for r in a)
    if not diff:
        print(f"equal: {len(a)} records, {compared} values (left out: {', '.join(VOLATILE + tuple(args.ignore))})")
        return 0
    print(f"differing: {len(diff)} values of {compared}")
    for line in diff[:20]:
        print(f"  {line}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
