"""GSM8K-style rewards: '#### N' extraction, number cleaning, numeric comparison, fallback modes."""

from decimal import Decimal

import pytest

from rlalign.tasks import (
    extract_hash_answer,
    extract_last_number,
    gsm8k_reward,
    gsm8k_reward_fallback,
    gsm8k_reward_last_number,
    gsm8k_score,
)

SOLUTION = "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72"


@pytest.mark.parametrize("text, value", [
    ("so #### 72", Decimal(72)),
    ("#### $1,234", Decimal(1234)),
    ("####  -3.50\nmore text", Decimal("-3.5")),
    ("#### 72.", Decimal(72)),
    ("#### 1 000", Decimal(1000)),        # spaces removed
    ("#### 5 then #### 6", Decimal(6)),   # the last '####' wins
    ("#### seventy", None),
    ("no marker 72", None),
])
def test_extract_hash_answer(text, value):
    assert extract_hash_answer(text) == value


def test_extract_last_number():
    assert extract_last_number("costs $1,200.50 then 3 and finally 72.") == Decimal(72)
    assert extract_last_number("price $1,200.50") == Decimal("1200.50")
    assert extract_last_number("-4 degrees") == Decimal(-4)
    assert extract_last_number("none") is None


@pytest.mark.parametrize("completion, strict, fallback, last", [
    ("thinking... #### 72", 1.0, 1.0, 1.0),
    ("#### 72.00", 1.0, 1.0, 1.0),           # numeric comparison
    ("#### 072", 1.0, 1.0, 1.0),
    ("the answer is 72", 0.0, 1.0, 1.0),     # no '####': only the fallback modes find it
    ("#### 71 (or 72)", 0.0, 0.0, 1.0),
    ("#### 71", 0.0, 0.0, 0.0),
    ("", 0.0, 0.0, 0.0),
])
def test_modes(completion, strict, fallback, last):
    assert gsm8k_reward("q", completion, "72") == strict
    assert gsm8k_reward_fallback("q", completion, "72") == fallback
    assert gsm8k_reward_last_number("q", completion, "72") == last


def test_reference_forms():
    assert gsm8k_reward("q", "#### 72", SOLUTION) == 1.0
    assert gsm8k_reward("q", "#### 1234", "1,234") == 1.0
    assert gsm8k_reward("q", "#### 5", "$5.") == 1.0
    with pytest.raises(ValueError, match="no number in the reference"):
        gsm8k_reward("q", "#### 5", "five")
    with pytest.raises(ValueError, match="unknown mode"):
        gsm8k_score("#### 5", "5", mode="first")
