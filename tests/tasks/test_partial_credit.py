"""configs/partial_credit.py: positional_match (unchanged), match_then_stop and match_then_steep, loaded as a
run loads them."""

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.tasks.registry import load_reward

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "partial_credit.py"
positional_match = load_reward(f"{CONFIG}:positional_match")
match_then_stop = load_reward(f"{CONFIG}:match_then_stop")
match_then_steep = load_reward(f"{CONFIG}:match_then_steep")
COST, STEEP_COST = 1 / 400, 1 / 16

answers = st.text("0123456789", min_size=1, max_size=6)
completions = st.text("0123456789", max_size=400)


def test_positional_match_values_unchanged():
    assert positional_match("", "357", "357") == 1.0
    assert positional_match("", "3571", "357") == 1.0 - 0.1
    assert positional_match("", "3", "357") == 1 / 3
    assert positional_match("", "", "357") == 0.0


def test_match_then_stop_values():
    assert match_then_stop("12+345=", "357", "357") == 1.0
    assert match_then_stop("12+345=", "", "357") == 0.0
    assert match_then_stop("12+345=", "3", "357") == 1 / 3
    assert match_then_stop("12+345=", "3579", "357") == 1.0 - COST
    assert match_then_stop("12+345=", "0" * 403, "357") == -1.0   # nothing matched, 400 extra


@settings(max_examples=200, deadline=None)
@given(answer=answers, completion=completions, tail=st.text("0123456789", min_size=1, max_size=20))
def test_each_character_beyond_the_answer_costs_the_same(answer, completion, tail):
    """Past the answer's length, every further character lowers the reward by exactly COST (so an earlier
    stop always scores higher), whatever the characters are."""
    longer = completion.ljust(len(answer), "x") if len(completion) < len(answer) else completion
    gap = match_then_stop("", longer, answer) - match_then_stop("", longer + tail, answer)
    assert abs(gap - COST * len(tail)) < 1e-12, (answer, longer, tail, gap)


@settings(max_examples=200, deadline=None)
@given(answer=answers, completion=completions, data=st.data())
def test_one_more_matched_place_earns_one_over_the_answer_length(answer, completion, data):
    """Writing the answer's digit at a place i < len(answer) where the completion was wrong raises the
    reward by exactly 1 / len(answer) (length, hence the cost, unchanged)."""
    padded = completion.ljust(len(answer), "x")
    wrong = [i for i in range(len(answer)) if padded[i] != answer[i]]
    if not wrong:
        assert match_then_stop("", padded, answer) == 1.0 - COST * (len(padded) - len(answer))
        return
    i = data.draw(st.sampled_from(wrong))
    fixed = padded[:i] + answer[i] + padded[i + 1:]
    gain = match_then_stop("", fixed, answer) - match_then_stop("", padded, answer)
    assert abs(gain - 1 / len(answer)) < 1e-12, (answer, padded, i, gain)


@settings(max_examples=200, deadline=None)
@given(answer=answers, completion=completions)
def test_match_then_stop_range(answer, completion):
    """At most 1, reached only by the answer itself; at least -1 for completions of <= 400 characters."""
    reward = match_then_stop("", completion, answer)
    assert -1.0 <= reward <= 1.0
    assert (reward == 1.0) == (completion == answer), (answer, completion, reward)


def test_match_then_steep_values():
    assert match_then_steep("12+345=", "357", "357") == 1.0
    assert match_then_steep("12+345=", "", "357") == 0.0
    assert match_then_steep("12+345=", "3", "357") == 1 / 3
    assert match_then_steep("12+345=", "3579", "357") == 1.0 - STEEP_COST
    assert match_then_steep("12+345=", "0" * 19, "357") == -1.0   # nothing matched, 16 extra


@settings(max_examples=200, deadline=None)
@given(answer=answers, completion=completions, tail=st.text("0123456789", min_size=1, max_size=20))
def test_match_then_steep_is_match_then_stop_with_a_steeper_cost(answer, completion, tail):
    """The same matched-place credit as match_then_stop; each character beyond the answer costs exactly
    STEEP_COST, so the two differ by (STEEP_COST - COST) x the characters beyond the answer."""
    extra = max(0, len(completion) - len(answer))
    gap = match_then_stop("", completion, answer) - match_then_steep("", completion, answer)
    assert abs(gap - (STEEP_COST - COST) * extra) < 1e-9, (answer, completion, gap)
    longer = completion.ljust(len(answer), "x") if len(completion) < len(answer) else completion
    step = match_then_steep("", longer, answer) - match_then_steep("", longer + tail, answer)
    assert abs(step - STEEP_COST * len(tail)) < 1e-9, (answer, longer, tail, step)
