"""Users' prompt/answer data from JSONL or parquet files.

- ``.jsonl``: one JSON object per line; blank lines skipped; errors name ``file:line`` (1-based).
- ``.json``: one JSON array of objects; errors name ``file: row N`` (1-based).
- ``.parquet``: read with pyarrow when it is installed (``pip install pyarrow``); errors name
  ``file: row N`` (1-based).

Each row gives a prompt and an answer by configurable field names; a dotted name
(``reward_model.ground_truth``) reaches into nested objects when no top-level key has that exact
name. The prompt is a string, or a chat conversation: a list of ``{"role": "system" | "user" |
"assistant", "content": str}`` messages (kept as a tuple of such dicts; the trainer renders it with
the tokenizer's chat template). The answer is a string or a number (stored as ``str``). An optional
``prompt_template`` (string prompts only) is formatted with ``str.format_map`` on the row's fields
plus ``prompt`` (the prompt field's value), e.g. ``"Question: {prompt}\\nAnswer:"``.
"""

from __future__ import annotations

from rlalign.contract.errors import RLAlignError
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_MISSING = object()


class DatasetError(RLAlignError, ValueError):
    """A dataset file or one of its rows cannot be used; the message names the file and line/row."""


ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Example:
    prompt: "str | tuple[dict, ...]"   # text, or chat messages
    answer: str
    source: str  # "file:line" or "file: row N", for error messages
    extra: "dict[str, Any]" = field(default_factory=dict)   # the row's other fields (reward keywords)


def _utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise DatasetError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); save the file as "
                           "UTF-8") from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    for number, line in enumerate(_utf8(path).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        rows = json.loads(_utf8(path))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rows, list):
        raise DatasetError(f"{path}: a .json dataset must hold a list of objects, got {type(rows).__name__} "
                           f"(use .jsonl for one object per line)")
    for number, row in enumerate(rows, start=1):
        yield f"{path}: row {number}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading a .parquet file needs the pyarrow package, which is not installed here: "
                           "pip install pyarrow (or use .jsonl / .json)") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise DatasetError(f"{path}: cannot read parquet ({type(e).__name__}: {e})") from None
    for number, row in enumerate(rows, start=1):
        yield f"{path}: row {number}", row


def read_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, row)`` for every row of a ``.jsonl``, ``.json`` or ``.parquet`` file."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_rows(path)
    if suffix == ".json":
        return _json_rows(path)
    if suffix == ".parquet":
        return _parquet_rows(path)
    raise DatasetError(f"{path}: unknown file type {suffix!r} (use .jsonl, .json or .parquet)")


def _field(row: dict, name: str, where: str) -> Any:
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is _MISSING:
            keys = ", ".join(sorted(map(str, row))) or "none"
            raise DatasetError(f"{where}: missing field {name!r} (row has: {keys})")
    return value


def _answer_text(value: Any, name: str, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: field {name!r} must be a string or a number, got {type(value).__name__}")
    return str(value)


def _example(row: Any, where: str, prompt_field: str, answer_field: str, template: str | None) -> Example:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompt = _field(row, prompt_field, where)
    if isinstance(prompt, list):
        if template is not None:
            raise DatasetError(f"{where}: field {prompt_field!r} holds chat messages; prompt_template applies to "
                               "string prompts only (drop task.template; use task.system_prompt for a system message)")
        prompt = _messages(prompt, prompt_field, where)
    elif not isinstance(prompt, str):
        raise DatasetError(f"{where}: field {prompt_field!r} must be a string or a list of chat messages, "
                           f"got {type(prompt).__name__}")
    answer = _answer_text(_field(row, answer_field, where), answer_field, where)
    if template is not None:
        try:
            prompt = template.format_map({**row, "prompt": prompt})
        except (KeyError, IndexError, ValueError) as e:
            raise DatasetError(f"{where}: prompt_template {template!r} cannot be filled ({type(e).__name__}: {e})"
                               ) from None
    extra = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
    return Example(prompt=prompt, answer=answer, source=where, extra=extra)


def _messages(value: list, name: str, where: str) -> tuple[dict, ...]:
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise DatasetError(f"{where}: field {name!r} message {i} must be {{\"role\": one of {list(ROLES)}, "
                               f"\"content\": a string}}, got {str(m)[:80]}")
    if not value or value[-1]["role"] != "user":
        raise DatasetError(f"{where}: field {name!r} must end with a user message (the model answers it)")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def load_examples(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer",
                  prompt_template: str | None = None) -> list[Example]:
    """All rows of the file as :class:`Example`, in file order; the first bad row raises
    :class:`DatasetError` naming the file and line/row."""
    examples = [_example(row, where, prompt_field, answer_field, prompt_template)
                for where, row in read_rows(path)]
    if not examples:
        raise DatasetError(f"{path}: no rows")
    return examples


def split_examples(examples: list[Example], eval_fraction: float, seed: int = 0
                   ) -> tuple[list[Example], list[Example]]:
    """Deterministic train/eval split.

    ``n_eval = round(eval_fraction * n)``, raised to 1 when ``eval_fraction > 0`` and ``n >= 2``;
    the eval rows are the first ``n_eval`` of a ``random.Random(seed).shuffle`` of the row
    indices. Both splits keep the file order.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(examples)
    n_eval = round(eval_fraction * n)
    if eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    eval_ids = set(order[:n_eval])
    train = [ex for i, ex in enumerate(examples) if i not in eval_ids]
    held_out = [ex for i, ex in enumerate(examples) if i in eval_ids]
    return train, held_out


def load_dataset(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer",
                 prompt_template: str | None = None, eval_fraction: float = 0.0, seed: int = 0
                 ) -> tuple[list[Example], list[Example]]:
    """:func:`load_examples` then :func:`split_examples`: returns ``(train, eval)``."""
    examples = load_examples(path, prompt_field=prompt_field, answer_field=answer_field,
                             prompt_template=prompt_template)
    return split_examples(examples, eval_fraction, seed)
