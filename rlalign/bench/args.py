"""Command-line values the commands and benchmark scripts share: comma-separated positive integers (batch sizes, row
counts, token counts, group sizes, a shape), and the argparse types of single integer options (a count, a count that
may be 0, a seed). One parser each, so every command refuses 0, negatives and malformed values alike, in one line
naming the option (``rlalign parity: error: argument --train-batch: must be an integer >= 1, got '0'``)."""

from __future__ import annotations

import argparse

SEED_LIMIT = 2**63 - 1   # as the config's run.seed


def positive_ints(text: str, count: int | None = None) -> tuple[int, ...] | None:
    """``text`` as comma-separated integers, each >= 1 (exactly ``count`` of them when given); None if it is not
    that (the caller names the option in its one-line refusal)."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        return None
    return values if values and min(values) >= 1 and (count is None or len(values) == count) else None


def _integer(text: str, low: int, high: "int | None", rule: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type of a count: an integer >= 1."""
    return _integer(text, 1, None, "an integer >= 1")


def non_negative_int(text: str) -> int:
    """argparse type of a count where 0 means off (top-k): an integer >= 0."""
    return _integer(text, 0, None, "an integer >= 0 (0: off)")


def seed_int(text: str) -> int:
    """argparse type of a seed: an integer in [0, 2**63 - 1]."""
    return _integer(text, 0, SEED_LIMIT, "an integer in [0, 2**63 - 1]")


__all__ = ["positive_ints", "positive_int", "non_negative_int", "seed_int", "SEED_LIMIT"]
