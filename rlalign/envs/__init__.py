"""Multi-turn environments and tools: the interface a user's agent loop implements, tool calls parsed from the
model's chat-template format, and the episode driver that runs them on the rollout engine (docs/agents.md).

Rooms (highest first): ``loading`` (``task.env`` -> a factory), ``episodes`` (the driver), ``builtin`` (the
built-in envs), ``tool_env`` (:class:`ToolEnv`), ``parsing`` (tool calls in and responses out), ``tools``
(:class:`Tool`: a callable with a schema and a timeout), ``base`` (:class:`Env`, :class:`Turn`,
:class:`StepResult`).
"""

from rlalign.envs.base import Env, EnvError, StepResult, Turn
from rlalign.envs.builtin import BUILTIN_ENVS, CalculatorEnv, RetryArithmeticEnv, calculate
from rlalign.envs.episodes import Episode, EpisodeLimits, run_episodes
from rlalign.envs.loading import env_class, load_env
from rlalign.envs.parsing import FORMATS, ToolCall, format_tool_responses, parse_tool_calls
from rlalign.envs.tool_env import ToolEnv
from rlalign.envs.tools import Tool, ToolResult, as_tools, schema_of

__all__ = [
    "BUILTIN_ENVS", "CalculatorEnv", "Env", "EnvError", "Episode", "EpisodeLimits", "FORMATS", "RetryArithmeticEnv",
    "StepResult", "Tool", "ToolCall", "ToolEnv", "ToolResult", "Turn", "as_tools", "calculate", "env_class",
    "format_tool_responses", "load_env", "parse_tool_calls", "run_episodes", "schema_of",
]
