"""The built-in default task: multi-digit addition, e.g. prompt ``"12+345="`` -> answer ``"357"``.

Generation is deterministic from a seed, indexable (train problem ``i`` is a pure function of
``(seed, digit range, i)``, so a data position is just an integer) and split without overlap:
a problem ``a+b`` belongs to the held-out eval split iff a hash of ``(seed, a, b)`` falls in
the first ``eval_fraction`` of its range; train problems are drawn only outside it.

Operands: the digit count of each operand is uniform in ``[min_digits, max_digits]``, then the
value is uniform over the numbers with that many digits (1 digit: 0-9, d > 1 digits:
10^(d-1) .. 10^d - 1). Randomness comes from BLAKE2b of a text key, so it is the same on every
machine and Python version.

Prompts are short (at most ``2 * max_digits + 2`` characters) and answers a few digits, over a
12-character alphabet (:data:`CHARS`): a tiny character-level model can learn it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
ANSWER_CHARS = "0123456789"
CHARS = ANSWER_CHARS + "+="
#: The character vocabulary of the default task, in id order: special tokens first, then CHARS.
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + tuple(CHARS)

MAX_DIGITS = 30
_SPLIT_BUCKETS = 1_000_000
_MAX_TRAIN_ATTEMPTS = 10_000


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    extra: Mapping[str, Any] = field(default_factory=dict)   # a dataset row's other fields, for the reward


def parse_answer(completion: str) -> str:
    """The answer a completion gives: its longest prefix made only of the digits 0-9.

    Parsing stops at the first other character (the end token text, a space, '+', ...) or at
    the end of the string; no whitespace is skipped before the digits.
    """
    end = 0
    while end < len(completion) and completion[end] in ANSWER_CHARS:
        end += 1
    return completion[:end]


def arithmetic_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff :func:`parse_answer` of the completion is non-empty and equals ``answer`` as a
    string (so leading zeros are wrong: "0357" != "357"), else 0.0. ``prompt`` is unused."""
    del prompt
    parsed = parse_answer(completion)
    return 1.0 if parsed and parsed == answer.strip() else 0.0


def _hash_int(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=32).digest(), "little")


def _take(x: int, n: int) -> tuple[int, int]:
    """(x mod n, x div n): consume a uniform draw in [0, n) from the hash integer."""
    return x % n, x // n


@dataclass
class ArithmeticTask:
    """Multi-digit addition with disjoint train and held-out eval splits.

    ``eval_size`` distinct problems form the eval split; ``eval_fraction`` is the share of the
    problem space reserved for it (train never draws from that share).
    """

    seed: int = 0
    min_digits: int = 1
    max_digits: int = 3
    eval_size: int = 200
    eval_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= MAX_DIGITS:
            raise ValueError(f"arithmetic task: need 1 <= min_digits <= max_digits <= {MAX_DIGITS}, got "
                             f"min_digits={self.min_digits}, max_digits={self.max_digits}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"arithmetic task: eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.eval_size < 0:
            raise ValueError(f"arithmetic task: eval_size must be >= 0, got {self.eval_size}")

    reward = staticmethod(arithmetic_reward)

    def _operand(self, x: int) -> tuple[int, int]:
        span = self.max_digits - self.min_digits + 1
        extra, x = _take(x, span)
        digits = self.min_digits + extra
        low = 0 if digits == 1 else 10 ** (digits - 1)
        offset, x = _take(x, 10 ** digits - low)
        return low + offset, x

    def _draw(self, stream: str, index: int, attempt: int) -> tuple[int, int]:
        x = _hash_int(f"rlalign.arithmetic/{self.seed}/{self.min_digits}-{self.max_digits}/"
                      f"{stream}/{index}/{attempt}")
        a, x = self._operand(x)
        b, _ = self._operand(x)
        return a, b

    def is_eval(self, a: int, b: int) -> bool:
        """True iff the problem ``a+b`` belongs to the eval share of the problem space."""
        bucket = _hash_int(f"rlalign.arithmetic.split/{self.seed}/{a}+{b}") % _SPLIT_BUCKETS
        return bucket < self.eval_fraction * _SPLIT_BUCKETS

    @staticmethod
    def problem(a: int, b: int) -> Problem:
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    def train_problem(self, index: int) -> Problem:
        """Train problem number ``index`` (>= 0): the first draw for it outside the eval share."""
        if index < 0:
            raise ValueError(f"arithmetic task: train index must be >= 0, got {index}")
        for attempt in range(_MAX_TRAIN_ATTEMPTS):
            a, b = self._draw("train", index, attempt)
            if not self.is_eval(a, b):
                return self.problem(a, b)
        raise RuntimeError(f"arithmetic task: no train problem found for index {index}; "
                           f"eval_fraction={self.eval_fraction} leaves too little for training")

    def train_problems(self, start: int, count: int) -> list[Problem]:
        """Train problems ``start .. start + count - 1`` (the stream is endless; repeats happen
        only as often as in independent uniform draws)."""
        return [self.train_problem(i) for i in range(start, start + count)]

    @cached_property
    def eval_problems(self) -> list[Problem]:
        """The held-out split: ``eval_size`` distinct problems, all inside the eval share."""
        seen: set[tuple[int, int]] = set()
        found: list[Problem] = []
        max_draws = int(50 * self.eval_size / self.eval_fraction) + 1000
        for index in range(max_draws):
            if len(found) == self.eval_size:
                return found
            a, b = self._draw("eval", index, 0)
            if (a, b) not in seen and self.is_eval(a, b):
                seen.add((a, b))
                found.append(self.problem(a, b))
        if len(found) == self.eval_size:
            return found
        raise ValueError(f"arithmetic task: found only {len(found)} distinct eval problems for digits "
                         f"{self.min_digits}..{self.max_digits} with eval_fraction={self.eval_fraction}; "
                         f"lower eval_size or widen the digit range")
