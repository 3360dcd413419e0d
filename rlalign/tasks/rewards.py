"""GSM8K-style rewards: the final answer follows ``#### `` and is compared numerically.

Number rule: after removing commas, ``$`` and spaces, a number is ``[+-]?digits[.digits]``;
a trailing period ("72.") is not part of it. Numbers compare as exact decimals
(``Decimal("72.0") == Decimal("72")``), never as binary floats.

Modes of :func:`gsm8k_score`:

- ``"hash"``: the answer is the number at the start of the text after the *last* ``####``
  (up to the end of that line); no ``####`` or no number there -> 0.0;
- ``"last_number"``: the answer is the last number anywhere in the text;
- ``"hash_or_last"``: ``"hash"`` when the text has ``####``, otherwise ``"last_number"``.

The reference answer may be a bare number or a full GSM8K solution ending in ``#### N``; a
reference with no number raises ``ValueError`` (bad data, not a wrong completion).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

MODES = ("hash", "last_number", "hash_or_last")
_LEADING_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")
_ANY_NUMBER = re.compile(r"[+-]?\$?\d[\d,]*(?:\.\d+)?")


def _clean(text: str) -> str:
    return text.replace(",", "").replace("$", "").replace(" ", "")


def _to_decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def extract_hash_answer(text: str) -> Decimal | None:
    """The number right after the last ``####`` (same line), or None."""
    at = text.rfind("####")
    if at < 0:
        return None
    line = _clean(text[at + 4:].split("\n", 1)[0].strip())
    match = _LEADING_NUMBER.match(line)
    return _to_decimal(match.group(0)) if match else None


def extract_last_number(text: str) -> Decimal | None:
    """The last number in the text (commas and ``$`` inside it removed), or None."""
    matches = _ANY_NUMBER.findall(text)
    return _to_decimal(_clean(matches[-1])) if matches else None


def _reference(answer: str) -> Decimal:
    value = extract_hash_answer(answer) if "####" in answer else None
    if value is None:
        match = _LEADING_NUMBER.fullmatch(_clean(answer.strip()).rstrip("."))
        value = _to_decimal(match.group(0)) if match else None
    if value is None:
        raise ValueError(f"gsm8k reward: no number in the reference answer {answer[:80]!r}")
    return value


def gsm8k_score(completion: str, answer: str, mode: str = "hash") -> float:
    """1.0 if the completion's final answer (by ``mode``) equals the reference numerically, else 0.0."""
    if mode not in MODES:
        raise ValueError(f"gsm8k reward: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    expected = _reference(answer)
    if mode == "last_number" or (mode == "hash_or_last" and "####" not in completion):
        got = extract_last_number(completion)
    else:
        got = extract_hash_answer(completion)
    return 1.0 if got is not None and got == expected else 0.0


def gsm8k_reward(prompt: str, completion: str, answer: str) -> float:
    """Reward-function form of :func:`gsm8k_score` in mode ``"hash"`` (strict ``#### N``)."""
    del prompt
    return gsm8k_score(completion, answer, "hash")


def gsm8k_reward_fallback(prompt: str, completion: str, answer: str) -> float:
    """Mode ``"hash_or_last"``: ``#### N`` if present, else the last number in the completion."""
    del prompt
    return gsm8k_score(completion, answer, "hash_or_last")


def gsm8k_reward_last_number(prompt: str, completion: str, answer: str) -> float:
    """Mode ``"last_number"``: the last number in the completion."""
    del prompt
    return gsm8k_score(completion, answer, "last_number")
