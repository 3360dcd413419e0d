"""SFT examples from JSONL files, read with the ``datasets`` library (local files only, never the hub).

Two row formats (``data.format``; ``auto`` picks ``messages`` when the first row has ``data.messages_field``):

- **prompt/response**: ``{"prompt": str, "response": str}``. The sequence is ``encode(prompt)`` (with the
  tokenizer's special tokens, e.g. a BOS its post-processor adds) + ``encode(response)`` (without) + the eos
  token; the response's tokens and the eos are scored (:func:`~rlalign.train.sft.objective.response_mask`).
  With ``data.chat=true`` the row is the conversation [user: prompt, assistant: response] instead (below).
- **messages**: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``, rendered
  with the model's chat template (:func:`chat_example`) and encoded. The scored tokens are, for each assistant
  turn, the tokens overlapping its content's characters in the rendered text and the end-of-turn token that must
  follow the content (one of the tokenizer's eos ids) -- with a ChatML template the content's tokens and
  ``<|im_end|>``; the role header and what the template writes after the end-of-turn token (ChatML's newline)
  are not scored.

The rendering is checked, and a row that cannot honour the rule is refused in one line naming the row (``file:line`` in a
``.jsonl`` file, ``file: row N`` in a ``.json`` list): a template that does not render an assistant turn as the conversation
before it + the generation prompt + the content unchanged, or that does not follow the content with an eos
token, a row without an
assistant turn, a missing or non-string field, a sequence longer than ``data.max_length`` or the model's
positions, or a row with no scored token (an empty prompt and a one-token response when the tokenizer adds no
BOS: the sequence's first token has no prediction).

Rows come from :func:`rlalign.tasks.datasets.read_rows`, the reader of the RL prompt data: ``.jsonl`` and ``.json``
with the standard library (no ``datasets`` needed, no column type coercion; errors name ``file:line``),
``.csv`` and ``.parquet`` through ``datasets``, offline.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.tasks.datasets import DatasetError, read_rows as read_data_rows
from rlalign.train.sft.objective import Example, response_mask

ROLES = ("system", "user", "assistant")


class SFTDataError(RLAlignError, ValueError):
    """A data file or one of its rows cannot be used; the message names the file and row."""


def read_rows(path: str) -> list[tuple[str, dict]]:
    """``(location, row)`` for every row of a local data file (``file:line`` in a ``.jsonl`` file)."""
    file = Path(path)
    if not file.is_file():
        raise SFTDataError(f"data file {path} does not exist (or is not a file)")
    try:
        rows = list(read_data_rows(file))
    except DatasetError as exc:
        raise SFTDataError(str(exc)) from None
    if not rows:
        raise SFTDataError(f"{path} is empty: it holds no rows")
    for where, row in rows:
        if not isinstance(row, dict):
            raise SFTDataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    return rows


def file_sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def row_format(rows: Sequence[dict], fmt: str, messages_field: str) -> str:
    if fmt != "auto":
        return fmt
    return "messages" if rows and rows[0].get(messages_field) is not None else "prompt_response"


def _text(row: dict, name: str, where: str) -> str:
    value = row.get(name)
    if value is None:
        raise SFTDataError(f"{where}: missing field {name!r} (the row has {', '.join(sorted(k for k, v in row.items() if v is not None))})")
    if not isinstance(value, str):
        raise SFTDataError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _messages(value, name: str, where: str) -> list[dict]:
    if value is None:
        raise SFTDataError(f"{where}: missing field {name!r}")
    if not isinstance(value, list) or not value:
        raise SFTDataError(f"{where}: field {name!r} must be a non-empty list of chat messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise SFTDataError(f"{where}: message {i} must be {{\"role\": one of {', '.join(ROLES)}, "
                               "\"content\": a string}")
    if not any(m["role"] == "assistant" for m in value):
        raise SFTDataError(f"{where}: the conversation has no assistant turn, so nothing to learn; add one or "
                           "drop the row")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def prompt_response_example(tokenizer, prompt: str, response: str, where: str) -> Example:
    eos = tokenizer.eos_token_ids[0]
    prompt_ids = tokenizer.encode(prompt)
    response_ids = tokenizer.encode(response, add_special_tokens=False) + [eos]
    return Example(tuple(prompt_ids + response_ids), response_mask(len(prompt_ids), len(response_ids)), where)


def chat_example(tokenizer, messages: list[dict], where: str) -> Example:
    """The conversation rendered with the chat template and encoded; scored: each assistant turn's content tokens
    (those overlapping the content's characters in the rendered text) and the end-of-turn token after them."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    tokens, offsets = list(encoding.ids), encoding.offsets
    scored = [False] * len(tokens)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, stop = _content_span(tokenizer, messages, i, text, where)
        content = [t for t, (a, b) in enumerate(offsets) if a < stop and b > start]
        after = next((t for t, (a, b) in enumerate(offsets) if a >= stop and b > a), None)
        if after is None or tokens[after] not in tokenizer.eos_token_ids:
            raise SFTDataError(f"{where}: the chat template does not end assistant message {i} with an eos token "
                               f"({', '.join(map(str, tokenizer.eos_token_ids))}) right after its content: the model "
                               "would not learn to stop")
        for t in content + [after]:
            scored[t] = t > 0
    return Example(tuple(tokens), tuple(scored), where)


def _content_span(tokenizer, messages: list[dict], turn: int, text: str, where: str) -> tuple[int, int]:
    """Where assistant message ``turn``'s content lies in the rendered conversation ``text``: right after the
    rendering of the messages before it with the generation prompt, which must be a prefix of ``text``."""
    head = tokenizer.apply_chat_template(messages[:turn], add_generation_prompt=True, tokenize=False)
    content = messages[turn]["content"]
    if not text.startswith(head) or text[len(head):len(head) + len(content)] != content:
        raise SFTDataError(f"{where}: the chat template does not render assistant message {turn} as the conversation "
                           "so far + its generation prompt + the content unchanged, so the tokens to learn cannot be "
                           "told apart; use a template that renders earlier turns the same whatever follows")
    return len(head), len(head) + len(content)


def to_example(tokenizer, row: dict, fmt: str, data, where: str, max_length: int) -> Example:
    """One row as an :class:`Example`, checked (module doc)."""
    if fmt == "messages":
        example = chat_example(tokenizer, _messages(row.get(data.messages_field), data.messages_field, where), where)
    elif data.chat:
        example = chat_example(tokenizer, [{"role": "user", "content": _text(row, data.prompt_field, where)},
                                           {"role": "assistant", "content": _text(row, data.response_field, where)}],
                               where)
    else:
        example = prompt_response_example(tokenizer, _text(row, data.prompt_field, where),
                                          _text(row, data.response_field, where), where)
    if len(example.tokens) > max_length:
        raise SFTDataError(f"{where}: {len(example.tokens)} tokens, more than the {max_length} allowed "
                           "(data.max_length, or the model's max_position_embeddings)")
    if example.num_scored == 0:
        raise SFTDataError(f"{where}: no token to learn (an empty prompt and a one-token response: the sequence's "
                           "first token has nothing before it to predict it from)")
    return example


def load_examples(tokenizer, path: str, data, max_length: int) -> list[Example]:
    rows = read_rows(path)
    fmt = row_format([row for _, row in rows], data.format, data.messages_field)
    if fmt == "messages" and tokenizer.chat_template is None:
        raise SFTDataError(f"{path}: chat messages need the model's chat template, and its tokenizer has none")
    return [to_example(tokenizer, row, fmt, data, where, max_length) for where, row in rows]


def held_out_split(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) row indices: ``round(count * fraction)`` rows (at least one when ``fraction > 0``, never all)
    chosen by a permutation seeded with ``seed``; both lists in file order."""
    n_eval = min(max(round(count * fraction), 1 if fraction > 0 else 0), count - 1)
    held = set(torch.randperm(count, generator=torch.Generator().manual_seed(seed))[:n_eval].tolist())
    return [i for i in range(count) if i not in held], sorted(held)


__all__ = ["SFTDataError", "read_rows", "load_examples", "to_example", "chat_example", "prompt_response_example",
           "held_out_split", "file_sha256", "row_format"]
