"""The terms of ``task.rewards`` (what each entry may say, checked without loading anything) and how their values
combine. Loading and scoring them: :mod:`rlalign.tasks.reward_set`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

TERM_KEYS = {"name", "reward_model", "weight", "dtype", "micro_batch_tokens"}
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class RewardTerm:
    """One entry of ``task.rewards``: a rule reward (``name``) or a reward model (``reward_model``), weighted."""
    weight: float = 1.0
    name: "str | None" = None
    reward_model: "str | None" = None
    dtype: "str | None" = None
    micro_batch_tokens: int = 8192


def term_problem(entry: Any) -> "str | None":
    """Why a ``task.rewards`` entry is not usable (one line), or None."""
    if not isinstance(entry, Mapping):
        return f"must be a mapping such as {{name: gsm8k, weight: 1.0}} or {{reward_model: DIR, weight: 0.5}}, got {entry!r}"
    unknown = sorted(set(map(str, entry)) - TERM_KEYS)
    if unknown:
        return f"has unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(TERM_KEYS))})"
    if ("name" in entry) == ("reward_model" in entry):
        return "needs exactly one of name (a rule reward) or reward_model (a checkpoint folder)"
    source = entry.get("name", entry.get("reward_model"))
    if not (isinstance(source, str) and source.strip()):
        return f"{'name' if 'name' in entry else 'reward_model'} must be a non-empty string, got {source!r}"
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        return f"weight must be a finite number, got {weight!r}"
    if "name" in entry and ({"dtype", "micro_batch_tokens"} & set(entry)):
        return "dtype and micro_batch_tokens apply to a reward_model entry only"
    if entry.get("dtype") not in (None, *DTYPES):
        return f"dtype must be one of {', '.join(DTYPES)}, got {entry['dtype']!r}"
    tokens = entry.get("micro_batch_tokens", 8192)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        return f"micro_batch_tokens must be an integer >= 1, got {tokens!r}"
    return None


def parse_terms(entries: Sequence[Any]) -> list[RewardTerm]:
    """The ``task.rewards`` list as :class:`RewardTerm` (``ValueError`` naming the first bad entry)."""
    terms = []
    for i, entry in enumerate(entries):
        problem = term_problem(entry)
        if problem:
            raise ValueError(f"task.rewards[{i}] {problem}")
        terms.append(RewardTerm(weight=float(entry.get("weight", 1.0)), name=entry.get("name"),
                                reward_model=entry.get("reward_model"), dtype=entry.get("dtype"),
                                micro_batch_tokens=int(entry.get("micro_batch_tokens", 8192))))
    if not terms:
        raise ValueError("task.rewards is empty")
    return terms


def combine(values: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """``sum_i weights[i] * values[i][s]`` per sample ``s``, in term order; one term of weight 1: ``values[0]``."""
    if len(weights) == 1 and weights[0] == 1.0:
        return list(values[0])
    out = []
    for per_term in zip(*values, strict=True):
        total = 0.0
        for w, v in zip(weights, per_term):
            total += w * v
        out.append(total)
    return out


__all__ = ["RewardTerm", "TERM_KEYS", "combine", "parse_terms", "term_problem"]
