"""Tool calls out of a model turn's text, and tool responses into the next observation's text.

Two chat-template formats:

- ``"qwen"`` (Qwen2.5, Qwen3 and other Hermes-style templates): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; responses go back as one user turn of
  ``<tool_response>\\n...\\n</tool_response>`` blocks, then the assistant's header.
- ``"llama3"`` (Llama 3.1 / 3.2 JSON tool calling): the turn is one JSON object ``{"name": ..., "parameters":
  {...}}`` (``"arguments"`` accepted too), optionally after ``<|python_tag|>``; several may be separated by
  ``;``. Responses go back as ``ipython`` turns, then the assistant's header.

A call that does not parse (bad JSON, no name, arguments that are not an object) is not dropped: it becomes a
:class:`~rlalign.envs.tools.ToolResult` with ``ok=False`` that says why, answered like any tool's error.
"""

from __future__ import annotations

import dataclasses
import json
import re

from rlalign.envs.tools import ToolResult

FORMATS = ("qwen", "llama3")
_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def parse_tool_calls(text: str, fmt: str) -> list["ToolCall | ToolResult"]:
    """The calls of a turn in order; a call that does not parse is a ``ToolResult(ok=False)`` in its place."""
    if fmt == "qwen":
        bodies = _QWEN_CALL.findall(text)
    elif fmt == "llama3":
        body = text.split("<|python_tag|>", 1)[-1].strip()
        for end in ("<|eom_id|>", "<|eot_id|>"):
            body = body.removesuffix(end).strip()
        bodies = [part for part in _split_top_level(body)] if body.startswith("{") else []
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}; one of {', '.join(FORMATS)}")
    return [_parse_body(b, fmt) for b in bodies]


def _split_top_level(body: str) -> list[str]:
    """``{...}; {...}`` cut at the semicolons outside braces and strings."""
    parts, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_body(body: str, fmt: str) -> "ToolCall | ToolResult":
    try:
        obj = json.loads(body)
    except ValueError as e:
        return ToolResult("?", f"error: the tool call is not valid JSON ({e})", False)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolResult("?", "error: a tool call must be a JSON object with a string \"name\"", False)
    key = "parameters" if fmt == "llama3" and "parameters" in obj else "arguments"
    arguments = obj.get(key, {})
    if isinstance(arguments, str):   # some templates emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return ToolResult(obj["name"], f"error: tool {obj['name']}: {key} must be a JSON object", False)
    return ToolCall(obj["name"], arguments)


def format_tool_responses(results: list[ToolResult], fmt: str) -> str:
    """The observation text after a turn that ended with its end-of-turn token: the tool turn(s) with every
    result, then the assistant's header (the model's next turn starts right after it)."""
    if fmt == "qwen":
        blocks = "\n".join(f"<tool_response>\n{r.content}\n</tool_response>" for r in results)
        return f"\n<|im_start|>user\n{blocks}<|im_end|>\n<|im_start|>assistant\n"
    if fmt == "llama3":
        turns = "".join(f"<|start_header_id|>ipython<|end_header_id|>\n\n{r.content}<|eot_id|>" for r in results)
        return f"{turns}<|start_header_id|>assistant<|end_header_id|>\n\n"
    raise ValueError(f"unknown tool-call format {fmt!r}; one of {', '.join(FORMATS)}")


__all__ = ["FORMATS", "ToolCall", "format_tool_responses", "parse_tool_calls"]
