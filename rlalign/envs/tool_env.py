"""A tool-using environment: each turn's tool calls are run and their responses are the next observation.

:class:`ToolEnv` is the usual agent loop: a turn with tool calls (in ``tool_format``, :mod:`rlalign.envs.parsing`)
gets the tools' responses as the next observation; a turn without one is the final answer and ends the episode,
scored by :meth:`ToolEnv.answer_reward`. Subclass it with ``tools`` (callables or :class:`~rlalign.envs.tools.Tool`
objects) and ``answer_reward``. A call to an unknown tool, a call that does not parse and a tool that fails, hangs
or returns garbage are all error responses the model sees (:mod:`rlalign.envs.tools`); the episode goes on.
"""

from __future__ import annotations

from rlalign.envs.base import Env, StepResult, Turn
from rlalign.envs.parsing import FORMATS, ToolCall, format_tool_responses, parse_tool_calls
from rlalign.envs.tools import Tool, ToolResult, as_tools


class ToolEnv(Env):
    tools: tuple = ()
    tool_format: str = "qwen"
    tool_timeout_s: float = 5.0

    def __init__(self, *, tools=None, tool_format: "str | None" = None, tool_timeout_s: "float | None" = None):
        self.tool_format = tool_format or self.tool_format
        if self.tool_format not in FORMATS:
            raise ValueError(f"tool_format must be one of {', '.join(FORMATS)}, got {self.tool_format!r}")
        timeout = self.tool_timeout_s if tool_timeout_s is None else tool_timeout_s
        given = self.tools if tools is None else tools
        self.toolbox = as_tools(t if isinstance(t, Tool) else Tool(t, timeout_s=timeout) for t in given)
        self.calls: list[ToolResult] = []   # every call's result this episode, in order

    @property
    def schemas(self) -> list[dict]:
        """The tools' JSON schemas (for the chat template's ``tools=``)."""
        return [t.schema for t in self.toolbox.values()]

    def step(self, turn: Turn) -> StepResult:
        calls = parse_tool_calls(turn.text, self.tool_format)
        if not calls:
            return StepResult(None, self.answer_reward(turn), True)
        results = [self.run_call(c) for c in calls]
        self.calls += results
        return StepResult(format_tool_responses(results, self.tool_format), self.tool_reward(results), False)

    def run_call(self, call: "ToolCall | ToolResult") -> ToolResult:
        if isinstance(call, ToolResult):   # it did not parse: the error is the response
            return call
        tool = self.toolbox.get(call.name)
        if tool is None:
            return ToolResult(call.name, f"error: no tool named {call.name!r} (tools: "
                              f"{', '.join(self.toolbox) or 'none'})", False)
        return tool.call(call.arguments)

    def answer_reward(self, turn: Turn) -> float:
        """The final answer's reward (override; default 0)."""
        return 0.0

    def tool_reward(self, results: list[ToolResult]) -> float:
        """A turn of tool calls' reward (override for per-turn shaping; default 0)."""
        return 0.0


__all__ = ["ToolEnv"]
