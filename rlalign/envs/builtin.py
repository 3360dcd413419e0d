"""The built-in environments (``task.env`` names).

- ``retry_arithmetic``: the default model's addition prompts with retries. A turn whose answer
  (:func:`rlalign.tasks.arithmetic.parse_answer`) equals the sum ends the episode with reward
  ``1 / (turn index + 1)``; a wrong turn gets the problem again as the observation (``task.max_turns`` turns at
  most). It uses only the default tokenizer's 15 characters, so the embedded default model can run it.
- ``calculator``: a :class:`~rlalign.envs.tool_env.ToolEnv` with one tool, ``calculate(expression)`` (``+ - * /``,
  parentheses and numbers only), for chat models with a tool-call template; the final answer scores 1.0 when
  its last number equals the row's answer.
"""

from __future__ import annotations

import ast
import operator
import re

from rlalign.envs.base import Env, StepResult, Turn
from rlalign.envs.tool_env import ToolEnv
from rlalign.tasks.arithmetic import parse_answer


class RetryArithmeticEnv(Env):
    """Addition with retries: reward 1/(k+1) when turn k (0-based) answers right; a wrong answer is told the
    problem again (the row's prompt text)."""

    def step(self, turn: Turn) -> StepResult:
        answer = parse_answer(turn.text)
        if answer and answer == self.row.answer.strip():
            return StepResult(None, 1.0 / (turn.index + 1), True)
        return StepResult(self.row.prompt, 0.0, False)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

    Any other syntax is an error (no names, calls or powers: nothing but arithmetic runs)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
    result = value(ast.parse(str(expression), mode="eval").body)
    return str(int(result)) if float(result).is_integer() else repr(float(result))


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class CalculatorEnv(ToolEnv):
    """Tool use for chat models: ``calculate(expression)``; the answer turn scores 1.0 when its last number is the
    row's answer."""
    tools = (calculate,)

    def answer_reward(self, turn: Turn) -> float:
        numbers = _NUMBER.findall(turn.text.replace(",", ""))
        return 1.0 if numbers and numbers[-1] == self.row.answer.strip() else 0.0


BUILTIN_ENVS = {"retry_arithmetic": RetryArithmeticEnv, "calculator": CalculatorEnv}

__all__ = ["BUILTIN_ENVS", "CalculatorEnv", "RetryArithmeticEnv", "calculate"]
