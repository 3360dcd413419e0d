"""configs/partial_credit.py: positional_match (unchanged) and match_then_stop, loaded as a run loads them."""

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.tasks.registry import load_reward

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "partial_credit.py"
positional_match = load_reward(f"{CONFIG}:positional_match")
match_then_stop = load_reward(f"{CONFIG}:match_then_stop")
COST = 1 / 400

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
