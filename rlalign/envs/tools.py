"""Tools: plain Python callables with a JSON schema, called with a timeout; every failure is an observation.

``Tool(fn)`` takes the schema from ``fn``'s signature and docstring (the OpenAI / TRL ``tools=[...]`` form:
``{"type": "function", "function": {"name", "description", "parameters": {JSON schema}}}``) unless one is given.
:meth:`Tool.call` runs ``fn(**arguments)`` in a daemon thread and waits at most ``timeout_s``; it never raises:

- the arguments do not fit the signature (missing, unknown) -> ``ToolResult(ok=False, "tool add: ...")``;
- the tool raises (``sys.exit`` included) -> ``ToolResult(ok=False, "tool add raised ValueError: ...")``;
- the tool runs past ``timeout_s`` -> ``ToolResult(ok=False, "tool add timed out after 5 s")`` (Python cannot stop
  a thread: the call keeps running in the background, its result is dropped -- a tool that may hang should bound
  its own work);
- the tool returns something that is not a string or JSON-serializable (or longer than ``max_chars``) ->
  ``ToolResult(ok=False, "tool add returned ...")``.

The model sees the result's ``content`` as the tool's response (:mod:`rlalign.envs.parsing` formats it for the
chat template), so a failing tool is a bad turn for the policy to learn from, never a crashed run.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import threading
import typing
from collections.abc import Callable, Mapping

from rlalign.contract.errors import one_line

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """``content``: the text the model is shown; ``ok``: False for every failure (then content says why)."""
    name: str
    content: str
    ok: bool


def schema_of(fn: Callable) -> dict:
    """The function-calling schema of ``fn``: its name, the docstring's first paragraph, one property per
    parameter (type from its annotation: int, float, str, bool, list, dict; untyped -> any), required = the
    parameters without a default."""
    hints = typing.get_type_hints(fn) if not isinstance(fn, type) else {}
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(typing.get_origin(hints.get(name)) or hints.get(name))
        properties[name] = {"type": kind} if kind else {}
        if param.default is param.empty:
            required.append(name)
    doc = inspect.getdoc(fn) or ""
    return {"type": "function", "function": {
        "name": fn.__name__, "description": doc.split("\n\n")[0].strip(),
        "parameters": {"type": "object", "properties": properties, "required": required}}}


class Tool:
    """A callable the model may call by name; ``schema`` defaults to :func:`schema_of`."""

    def __init__(self, fn: Callable, *, schema: "Mapping | None" = None, timeout_s: float = 5.0,
                 max_chars: int = 4096):
        if not callable(fn):
            raise TypeError(f"a tool must be callable, got {type(fn).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"tool timeout_s must be > 0, got {timeout_s}")
        self.fn, self.timeout_s, self.max_chars = fn, float(timeout_s), int(max_chars)
        self.schema = dict(schema) if schema is not None else schema_of(fn)
        self.name = self.schema["function"]["name"]

    def call(self, arguments: object) -> ToolResult:
        """``fn(**arguments)`` with the timeout; every failure is a ``ToolResult(ok=False)`` (module docstring)."""
        if not isinstance(arguments, Mapping):
            return self._error(f"arguments must be a JSON object, got {type(arguments).__name__}")
        try:
            inspect.signature(self.fn).bind(**arguments)
        except TypeError as e:
            return self._error(f"bad arguments: {e}")
        box: dict = {}

        def run():
            try:
                box["value"] = self.fn(**arguments)
            except BaseException as e:   # noqa: BLE001 -- sys.exit in a tool must not end the run
                box["error"] = e

        worker = threading.Thread(target=run, name=f"tool-{self.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            return self._error(f"timed out after {self.timeout_s:g} s")
        if "error" in box:
            return self._error(f"raised {one_line(box['error'])}")
        return self._content(box.get("value"))

    def _content(self, value) -> ToolResult:
        if isinstance(value, str):
            text = value
        else:
            try:
                text = json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as e:
                return self._error(f"returned {type(value).__name__}, not text or JSON ({one_line(e)})")
        if len(text) > self.max_chars:
            return self._error(f"returned {len(text)} characters, more than max_chars={self.max_chars}")
        return ToolResult(self.name, text, True)

    def _error(self, why: str) -> ToolResult:
        return ToolResult(self.name, f"error: tool {self.name} {why}", False)


def as_tools(tools) -> dict[str, Tool]:
    """Tools by name from callables or :class:`Tool` objects (two with one name is an error)."""
    out: dict[str, Tool] = {}
    for t in tools:
        tool = t if isinstance(t, Tool) else Tool(t)
        if tool.name in out:
            raise ValueError(f"two tools are named {tool.name!r}")
        out[tool.name] = tool
    return out


__all__ = ["Tool", "ToolResult", "as_tools", "schema_of"]
