"""Command-line values the benchmark scripts share: comma-separated positive integers (batch sizes, row counts,
token counts, group sizes, a shape). One parser, so every script refuses 0, negatives and malformed lists alike."""

from __future__ import annotations


def positive_ints(text: str, count: int | None = None) -> tuple[int, ...] | None:
    """``text`` as comma-separated integers, each >= 1 (exactly ``count`` of them when given); None if it is not
    that (the caller names the option in its one-line refusal)."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        return None
    return values if values and min(values) >= 1 and (count is None or len(values) == count) else None


__all__ = ["positive_ints"]
