"""Reward functions by name / import path / file path, and score() errors naming the sample."""

import math
import textwrap

import numpy as np
import pytest

from rlalign.tasks import BUILTIN_REWARDS, RewardError, RewardLoadError, arithmetic_reward, load_reward, score


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length_reward(prompt, completion, answer):
            return float(len(completion))

        class Scorers:
            @staticmethod
            def exact(prompt, completion, answer):
                return 1.0 if completion == answer else 0.0

        NOT_CALLABLE = 3
    """))
    (tmp_path / "broken_rewards.py").write_text("import definitely_missing_dependency_xyz\n")
    (tmp_path / "raising_rewards.py").write_text("raise RuntimeError('bad\\nconfig')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_builtin_names():
    assert load_reward("arithmetic") is arithmetic_reward
    assert set(BUILTIN_REWARDS) >= {"arithmetic", "gsm8k", "gsm8k_fallback", "gsm8k_last_number"}


def test_import_paths(user_module):
    assert load_reward("my_rewards:length_reward")("p", "abc", "a") == 3.0
    assert load_reward("my_rewards:Scorers.exact")("p", "x", "x") == 1.0
    assert load_reward("rlalign.tasks.rewards:gsm8k_reward")("p", "#### 3", "3") == 1.0


def test_file_path(user_module):
    fn = load_reward(f"{user_module / 'my_rewards.py'}:length_reward")
    assert fn("p", "ab", "") == 2.0


@pytest.mark.parametrize("spec, message", [
    ("nonsense", "not a built-in name .* and not of the form 'module:function'"),
    ("my_rewards:", "not of the form"),
    ("no_such_module_abc:f", "module 'no_such_module_abc' not found"),
    ("my_rewards:missing", "'my_rewards' has no attribute 'missing'"),
    ("my_rewards:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a function"),
    ("broken_rewards:f", "importing 'broken_rewards' failed: ModuleNotFoundError: .*definitely_missing"),
    ("raising_rewards:f", "importing 'raising_rewards' failed: RuntimeError: bad config"),
    ("/nowhere/r.py:f", "file '/nowhere/r.py' not found"),
    ("", "expected a built-in name"),
])
def test_load_errors_are_one_line_and_name_the_path(user_module, spec, message):
    with pytest.raises(RewardLoadError, match=message) as info:
        load_reward(spec)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"reward {spec!r}:")
    assert isinstance(info.value, ValueError)


def test_score_ok_and_number_types():
    values = iter([1, 0.5, True, np.float32(0.25)])
    out = score(lambda p, c, a: next(values), ["a"] * 4, ["b"] * 4, ["c"] * 4)
    assert out == [1.0, 0.5, 1.0, 0.25] and all(type(v) is float for v in out)


def _nan_on_second(prompt, completion, answer):
    return math.nan if completion == "bad" else 1.0


@pytest.mark.parametrize("fn, message", [
    (lambda p, c, a: 1 / 0 if c == "bad" else 0.0, r"on sample 1 \(prompt 'what is 2\+2\?'\) raised ZeroDivisionError"),
    (_nan_on_second, r"_nan_on_second on sample 1 .* returned nan, expected a finite float"),
    (lambda p, c, a: math.inf if c == "bad" else 0.0, "returned inf"),
    (lambda p, c, a: "1.0", "returned str '1.0'"),
    (lambda p, c, a: None if c == "bad" else 0.0, "returned NoneType None, expected a float"),
])
def test_score_errors_name_the_sample(fn, message):
    with pytest.raises(RewardError, match=message):
        score(fn, ["1+1=", "what is 2+2?"], ["ok", "bad"], ["2", "4"])


def test_score_prompt_excerpt_is_short():
    with pytest.raises(RewardError) as info:
        score(lambda p, c, a: math.nan, ["x" * 500], ["c"], ["a"])
    assert "x" * 60 + "..." in str(info.value) and "x" * 61 not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_score_length_mismatch():
    with pytest.raises(ValueError, match="lengths differ"):
        score(arithmetic_reward, ["a"], ["b", "c"], ["d"])


def test_extra_row_fields_reach_rewards_that_take_them():
    """A row's other fields go to the reward as keywords it accepts (all of them with **kwargs), as in TRL."""
    extras = [{"difficulty": 2, "source": "x"}, {"difficulty": 5, "source": "y"}]
    by_name = score(lambda p, c, a, difficulty=0: float(difficulty), ["p", "q"], ["c", "d"], ["a", "b"], extras)
    assert by_name == [2.0, 5.0]
    seen = []
    score(lambda p, c, a, **kw: seen.append(kw) or 0.0, ["p", "q"], ["c", "d"], ["a", "b"], extras)
    assert seen == extras
    assert score(lambda p, c, a: 1.0, ["p", "q"], ["c", "d"], ["a", "b"], extras) == [1.0, 1.0]   # plain signature
    with pytest.raises(ValueError, match="extras"):
        score(lambda p, c, a: 1.0, ["p"], ["c"], ["a"], [])
