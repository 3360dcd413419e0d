"""Tools, tool-call parsing and the tool-using env: every failure of a tool is an error observation."""

from __future__ import annotations

import json
import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.envs import (CalculatorEnv, StepResult, Tool, ToolCall, ToolEnv, ToolResult, Turn, calculate,
                          format_tool_responses, parse_tool_calls, schema_of)
from rlalign.tasks import Problem


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    More text that is not the description."""
    return a + b


def test_schema_from_signature():
    schema = schema_of(add)
    assert schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a"]}}}


def test_call_ok_and_json_results():
    assert Tool(add).call({"a": 2, "b": 3}) == ToolResult("add", "5", True)
    assert Tool(lambda: {"x": [1, 2]}, schema={"function": {"name": "f"}}).call({}).content == '{"x": [1, 2]}'


def _fails():
    raise ValueError("no\nway")


def _exits():
    raise SystemExit(3)


def _garbage():
    return object()


def _nan():
    return math.nan


def _huge():
    return "x" * 10_000


@pytest.mark.parametrize("fn, expected", [
    (_fails, "error: tool _fails raised ValueError: no way"),
    (_exits, "error: tool _exits raised SystemExit: 3"),
    (_garbage, "error: tool _garbage returned object, not text or JSON"),
    (_nan, "error: tool _nan returned float, not text or JSON"),
    (_huge, "error: tool _huge returned 10000 characters, more than max_chars=4096"),
])
def test_a_failing_tool_is_an_error_result(fn, expected):
    result = Tool(fn).call({})
    assert not result.ok and result.content.startswith(expected), result.content


def test_a_hanging_tool_times_out_and_the_call_returns():
    release = threading.Event()
    result = Tool(lambda: release.wait(60), schema={"function": {"name": "hang"}}, timeout_s=0.05).call({})
    release.set()
    assert result == ToolResult("hang", "error: tool hang timed out after 0.05 s", False)


@pytest.mark.parametrize("arguments, why", [([1, 2], "arguments must be a JSON object, got list"),
                                            ({"b": 1}, "bad arguments: missing a required argument: 'a'"),
                                            ({"a": 1, "c": 2}, "bad arguments: got an unexpected keyword")])
def test_bad_arguments_are_error_results(arguments, why):
    result = Tool(add).call(arguments)
    assert not result.ok and result.content.startswith(f"error: tool add {why}"), result.content


_names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
_values = st.one_of(st.integers(-10**6, 10**6), st.text(max_size=12), st.booleans(), st.none(),
                    st.lists(st.integers(0, 9), max_size=3))
_calls = st.lists(st.tuples(_names, st.dictionaries(_names, _values, max_size=4)), min_size=0, max_size=3)


@settings(max_examples=25, deadline=None)
@given(calls=_calls, before=st.text(max_size=20).filter(lambda t: "<" not in t and "{" not in t))
def test_qwen_calls_round_trip(calls, before):
    text = before + "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    assert parse_tool_calls(text + "<|im_end|>", "qwen") == [ToolCall(n, a) for n, a in calls]


@settings(max_examples=25, deadline=None)
@given(calls=_calls.filter(bool), tag=st.booleans(), key=st.sampled_from(["parameters", "arguments"]))
def test_llama3_calls_round_trip(calls, tag, key):
    body = "; ".join(json.dumps({"name": n, key: a}) for n, a in calls)
    text = ("<|python_tag|>" if tag else "") + body + "<|eom_id|>"
    assert parse_tool_calls(text, "llama3") == [ToolCall(n, a) for n, a in calls]


def test_unparsable_calls_become_error_results():
    got = parse_tool_calls('<tool_call>{"name": "add", "arguments": {</tool_call><tool_call>[1]</tool_call>'
                           '<tool_call>{"name": "add", "arguments": 3}</tool_call>', "qwen")
    assert [r.ok for r in got] == [False, False, False]
    assert got[0].content.startswith("error: the tool call is not valid JSON")
    assert "string \"name\"" in got[1].content and "arguments must be a JSON object" in got[2].content
    assert parse_tool_calls("The answer is 4.", "llama3") == []
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_tool_calls("", "mistral")


def test_responses_in_the_templates_turn_format():
    results = [ToolResult("a", "1", True), ToolResult("b", "error: x", False)]
    assert format_tool_responses(results, "qwen") == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\nerror: x\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    assert format_tool_responses(results[:1], "llama3") == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def _turn(text, index=0):
    return Turn(text, (), index, "stop")


def test_tool_env_runs_calls_and_scores_the_answer():
    env = CalculatorEnv()
    env.reset(Problem("What is 12*(3+4)?", "84"))
    step = env.step(_turn('<tool_call>\n{"name": "calculate", "arguments": {"expression": "12*(3+4)"}}\n'
                          '</tool_call><tool_call>{"name": "nope", "arguments": {}}</tool_call>'))
    assert not step.done and step.reward == 0.0
    assert "<tool_response>\n84\n</tool_response>" in step.observation
    assert "error: no tool named 'nope' (tools: calculate)" in step.observation
    assert env.step(_turn("It is 84.", 1)) == StepResult(None, 1.0, True)
    assert env.step(_turn("It is 85.", 1)) == StepResult(None, 0.0, True)


def test_calculate_runs_nothing_but_arithmetic():
    assert calculate("-(2+3)*4/8") == "-2.5" and calculate("7*6") == "42"
    for bad in ("__import__('os')", "2**10", "x+1", "'a'*3"):
        with pytest.raises((ValueError, SyntaxError)):
            calculate(bad)
    env = CalculatorEnv(tool_timeout_s=1.0)
    env.reset(Problem("q", "1"))
    assert "error: tool calculate raised ValueError: not arithmetic" in env.step(
        _turn('<tool_call>{"name": "calculate", "arguments": {"expression": "open(1)"}}</tool_call>')).observation


def test_tool_env_in_llama3_format():
    class Env(ToolEnv):
        tools = (add,)
        tool_format = "llama3"
    env = Env()
    env.reset(Problem("q", "a"))
    step = env.step(_turn('<|python_tag|>{"name": "add", "parameters": {"a": 40, "b": 2}}<|eom_id|>'))
    assert step.observation.startswith("<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>")
    assert env.calls == [ToolResult("add", "42", True)] and env.schemas == [schema_of(add)]
    with pytest.raises(ValueError, match="tool_format must be one of"):
        Env(tool_format="xml")
