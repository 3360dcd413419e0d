"""The built-in addition task: determinism, disjoint splits, digit ranges, the reward rule, vocab."""

import pytest

from rlalign.tasks import CHARS, EOS_TOKEN, SPECIAL_TOKENS, VOCAB, ArithmeticTask, arithmetic_reward, parse_answer


def operands(problem):
    a, b = problem.prompt[:-1].split("+")
    return int(a), int(b)


def test_problem_format():
    task = ArithmeticTask(seed=3)
    for p in task.train_problems(0, 50) + task.eval_problems[:50]:
        a, b = operands(p)
        assert p.prompt == f"{a}+{b}=" and p.answer == str(a + b)
        assert len(p.prompt) <= 2 * task.max_digits + 2


def test_deterministic_and_indexable():
    a, b = ArithmeticTask(seed=7), ArithmeticTask(seed=7)
    assert a.train_problems(0, 30) == b.train_problems(0, 30)
    assert a.eval_problems == b.eval_problems
    assert a.train_problems(10, 5) == [a.train_problem(i) for i in range(10, 15)]
    assert ArithmeticTask(seed=8).train_problems(0, 30) != a.train_problems(0, 30)


def test_train_and_eval_are_disjoint():
    task = ArithmeticTask(seed=0, eval_size=300)
    held_out = {p.prompt for p in task.eval_problems}
    assert len(held_out) == 300  # distinct
    assert all(task.is_eval(*operands(p)) for p in task.eval_problems)
    train = {p.prompt for p in task.train_problems(0, 5000)}
    assert not train & held_out


def test_digit_range():
    task = ArithmeticTask(seed=1, min_digits=2, max_digits=4, eval_size=50)
    seen = set()
    for p in task.train_problems(0, 400):
        for x in operands(p):
            assert 10 <= x <= 9999
            seen.add(len(str(x)))
    assert seen == {2, 3, 4}
    one = ArithmeticTask(seed=1, min_digits=1, max_digits=1, eval_size=3)
    assert all(0 <= x <= 9 for p in one.train_problems(0, 100) for x in operands(p))


@pytest.mark.parametrize("completion, reward", [
    ("357", 1.0),
    ("357" + EOS_TOKEN, 1.0),
    ("357+12", 1.0),     # parsing stops at the first non-digit
    ("357 is it", 1.0),
    ("0357", 0.0),       # exact string: leading zero is wrong
    (" 357", 0.0),       # nothing skipped before the digits
    ("35", 0.0),
    ("3570", 0.0),
    ("", 0.0),
    (EOS_TOKEN, 0.0),
])
def test_reward_rule(completion, reward):
    assert arithmetic_reward("12+345=", completion, "357") == reward
    assert ArithmeticTask.reward("12+345=", completion, "357") == reward


def test_parse_answer():
    assert parse_answer("12<eos>34") == "12"
    assert parse_answer("x12") == ""


def test_vocab():
    assert VOCAB[:len(SPECIAL_TOKENS)] == SPECIAL_TOKENS
    assert len(set(VOCAB)) == len(VOCAB) == len(SPECIAL_TOKENS) + 12
    task = ArithmeticTask(seed=2)
    used = set("".join(p.prompt + p.answer for p in task.train_problems(0, 200)))
    assert used <= set(CHARS)


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_digits=0), "min_digits"),
    (dict(min_digits=3, max_digits=2), "min_digits"),
    (dict(eval_fraction=0.0), "eval_fraction"),
    (dict(eval_size=-1), "eval_size"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**kwargs)


def test_eval_split_too_large_for_problem_space():
    task = ArithmeticTask(min_digits=1, max_digits=1, eval_size=60, eval_fraction=0.1)
    with pytest.raises(ValueError, match="distinct eval problems"):
        _ = task.eval_problems
