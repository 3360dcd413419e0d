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
from fractions import Fraction

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


# ---- math answers: \boxed{}, fractions, LaTeX numbers ------------------------------------------------------------
#
# The final answer of a completion (:func:`final_answer`): the content of its last ``\boxed{...}`` (braces
# balanced), else the text after its last ``####`` (that line), else its last number. An answer is read as an exact
# rational (:func:`parse_math_number`) after dropping ``$``, ``\$``, ``\!``, ``\,``, spaces, ``\%``/``%``, ``\left``
# / ``\right``, thousands commas (``1,234`` and LaTeX's ``1{,}234``) and a trailing period: ``[+-]N``, ``[+-]N/M``,
# ``[+-]\frac{N}{M}`` (``\dfrac``, ``\tfrac``; also ``\frac12``), N and M decimals. Answers that are not numbers
# compare as that normalised text.

_BOXED = ("\\boxed{", "\\fbox{")
_DECIMAL = r"\d+(?:\.\d+)?|\.\d+"
_FRACTION = re.compile(rf"([+-]?)\\frac(?:\{{({_DECIMAL})\}}\{{({_DECIMAL})\}}|(\d)(\d))")
_SLASH = re.compile(rf"([+-]?)({_DECIMAL})/({_DECIMAL})")
_PLAIN = re.compile(rf"[+-]?(?:{_DECIMAL})")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")
_ANY_VALUE = re.compile(_ANY_NUMBER.pattern + r"(?:/\d+(?:\.\d+)?)?")   # a number, or a fraction N/M


def last_boxed(text: str) -> "str | None":
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if there is none or it
    is not closed."""
    at = max(text.rfind(marker) for marker in _BOXED)
    if at < 0:
        return None
    start = text.index("{", at) + 1
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def normalize_math(text: str) -> str:
    """The answer text with formatting removed (see the section comment above)."""
    out = text.strip().strip("$")
    for old, new in (("\\$", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\%", ""), ("%", ""), ("{,}", ","),
                     ("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("$", "")):
        out = out.replace(old, new)
    out = "".join(out.split())
    while _THOUSANDS.search(out):
        out = _THOUSANDS.sub("", out)
    return out.rstrip(".")


def parse_math_number(text: str) -> "Fraction | None":
    """The exact value of a numeric answer (integer, decimal, ``N/M`` or ``\\frac{N}{M}``), or None."""
    s = normalize_math(text)
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
    m = _FRACTION.fullmatch(s)
    if m:
        num, den = (m.group(2), m.group(3)) if m.group(2) is not None else (m.group(4), m.group(5))
        return _ratio(m.group(1), num, den)
    m = _SLASH.fullmatch(s)
    if m:
        return _ratio(m.group(1), m.group(2), m.group(3))
    return Fraction(Decimal(s)) if _PLAIN.fullmatch(s) else None


def _ratio(sign: str, num: str, den: str) -> "Fraction | None":
    d = Fraction(Decimal(den))
    if d == 0:
        return None
    value = Fraction(Decimal(num)) / d
    return -value if sign == "-" else value


def final_answer(text: str) -> "str | None":
    """A completion's final answer text: last ``\\boxed{}``, else after the last ``####``, else the last number (or
    ``N/M`` fraction)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    at = text.rfind("####")
    if at >= 0:
        return text[at + 4:].split("\n", 1)[0]
    values = _ANY_VALUE.findall(text)
    return values[-1] if values else None


def math_answers_equal(got: str, expected: str) -> bool:
    """Equal as exact rationals when both parse as numbers, else as normalised text."""
    a, b = parse_math_number(got), parse_math_number(expected)
    if a is not None or b is not None:
        return a is not None and a == b
    return bool(normalize_math(got)) and normalize_math(got) == normalize_math(expected)


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff the completion's :func:`final_answer` equals the reference's (a bare answer, ``\\boxed{}`` or a GSM8K
    solution ending in ``#### N``), by :func:`math_answers_equal`; else 0.0."""
    del prompt
    got = final_answer(completion)
    reference = final_answer(answer) if ("####" in answer or last_boxed(answer) is not None) else answer
    return 1.0 if got is not None and reference is not None and math_answers_equal(got, reference) else 0.0


def math_verify_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff the ``math-verify`` package (``pip install math-verify``) finds the completion's answer equal to the
    reference (``verify(parse(answer), parse(completion))``), else 0.0."""
    del prompt
    from math_verify import parse, verify   # optional dependency: loaded only by this reward
    return 1.0 if verify(parse(answer), parse(completion)) else 0.0
