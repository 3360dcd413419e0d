"""The math answer checker (task.reward=math): \\boxed{} / '####' / last-number answers, numbers with thousands
commas, decimals and fractions compared as exact rationals; math-verify (task.reward=math_verify) where installed."""

import importlib.util
from fractions import Fraction

import pytest
from hypothesis import given, strategies as st

from rlalign.tasks import RewardLoadError, load_reward
from rlalign.tasks.rewards import final_answer, last_boxed, math_reward, parse_math_number

SOLUTION = "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72"


def _forms(value: Fraction) -> list[str]:
    """Ways a completion may write ``value``."""
    p, q = value.numerator, value.denominator
    sign = "-" if p < 0 else ""
    forms = [f"{sign}\\frac{{{abs(p)}}}{{{q}}}", f"{sign}\\dfrac{{{abs(p)}}}{{{q}}}", f"{p}/{q}", f"{p * 3}/{q * 3}"]
    if q == 1:
        forms += [f"{p:,}", f"{p:,}".replace(",", "{,}"), f"${p}$", f"{p}.", f"{p}.000"]
    if 10 ** 6 % q == 0:   # a terminating decimal
        forms.append(f"{p / q:.6f}")
    return forms


values = st.builds(Fraction, st.integers(-10**7, 10**7), st.integers(1, 64))


@given(values, st.data())
def test_every_way_of_writing_a_value_matches_it(value, data):
    form = data.draw(st.sampled_from(_forms(value)))
    reference = data.draw(st.sampled_from([str(value), f"#### {value}", f"\\boxed{{{value}}}"]))
    assert parse_math_number(form) == value
    assert math_reward("q", f"so the result is \\boxed{{{form}}} indeed", reference) == 1.0
    assert math_reward("q", f"work...\n#### {form}", reference) == 1.0
    if "\\" not in form and "$" not in form and "{" not in form:
        assert math_reward("q", f"the answer is {form}", reference) == 1.0   # last number, no marker


@given(values, values)
def test_different_values_do_not_match(a, b):
    if a != b:
        assert math_reward("q", f"\\boxed{{{_forms(a)[0]}}}", str(b)) == 0.0


@pytest.mark.parametrize("completion, answer, reward", [
    ("#### 72", SOLUTION, 1.0),
    ("\\boxed{\\boxed{7}} then \\boxed{8}", "8", 1.0),   # the last box wins
    ("\\boxed{x^2+1}", "x^2 + 1", 1.0),                   # not a number: normalised text
    ("\\boxed{12", "12", 1.0),                            # an unclosed box (truncated): the last number
    ("no answer here", "5", 0.0),
    ("\\boxed{1/0}", "1", 0.0),
    ("#### 1,234,567", "1234567", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
])
def test_examples(completion, answer, reward):
    assert math_reward("q", completion, answer) == reward


def test_last_boxed_and_final_answer():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("none") is None
    assert final_answer("first 3 then 4/5.") == "4/5"


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="math-verify is not installed")
@pytest.mark.parametrize("completion, answer", [("\\boxed{\\frac{3}{4}}", "0.75"), ("#### 1,234", "1234")])
def test_math_verify_agrees_on_plain_answers(completion, answer):
    fn = load_reward("math_verify")
    assert fn("q", completion, answer) == 1.0 == math_reward("q", completion, answer)
    assert fn("q", "\\boxed{5}", answer) == 0.0


def test_math_verify_without_the_package_is_one_line(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else object())
    with pytest.raises(RewardLoadError, match="needs the math-verify package, which is not installed here: pip install"):
        load_reward("math_verify")
