"""Users' prompt/answer data: local files and ``datasets`` folders, never the Hub.

Sources (:func:`read_rows`, the reader any stage that reads rows can reuse):

- ``.jsonl``: one JSON object per line; blank lines skipped; errors name ``file:line`` (1-based).
- ``.json``: one JSON array of objects; errors name ``file: row N`` (1-based).
  Both are read with the standard library, so each row keeps its own JSON types (``datasets``' JSON reader casts a
  column to one type: ``"4"`` next to ``2`` becomes ``4``, ``1`` next to ``1.5`` becomes ``1.0``, which would change
  what a reward sees).
- ``.csv`` and ``.parquet``: read through the ``datasets`` library; errors name ``file: row N``.
- a folder written by ``datasets``' ``save_to_disk``: a ``Dataset``, or split ``split`` (default ``train``) of a
  ``DatasetDict``.
- ``streaming=True``: any of these read lazily through ``datasets`` streaming (an ``IterableDataset``), for data
  larger than memory (a streamed JSON column has one type, ``datasets``' rule).

Nothing is downloaded: ``HF_DATASETS_OFFLINE=1`` is set before ``datasets`` is imported, and a path that is not an
existing file or folder (a Hub name such as ``openai/gsm8k``) is refused in one line.

Each row gives a prompt and an answer by column names (:class:`Columns`); a dotted name
(``reward_model.ground_truth``) reaches into nested objects when no top-level key has that exact name; other
columns reach the reward under their own names, or renamed (``Columns.renames``: ``{name the reward sees:
column}``). The prompt is a string, or a chat conversation: a list of ``{"role": "system" | "user" | "assistant",
"content": str}`` messages (kept as a tuple of such dicts; the trainer renders it with the tokenizer's chat
template). The answer is a string or a number (stored as ``str``). An optional ``prompt_template`` (string prompts
only) is formatted with ``str.format_map`` on the row's fields plus ``prompt`` (the prompt field's value), e.g.
``"Question: {prompt}\\nAnswer:"``.

Train streams are indexable by data position (a checkpoint keeps one integer): :class:`TrainRows` (in memory)
cycles through the train rows in file order, or with ``shuffle`` through a permutation per pass seeded by
``(seed, pass)``; :class:`StreamedRows` reads them lazily (``shuffle``: ``datasets``' shuffle buffer seeded by
``seed``, ``set_epoch(pass)``), its held-out rows chosen by a hash of ``(seed, row index)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlalign.contract.errors import RLAlignError, one_line

_MISSING = object()
_ROW_INDEX = "__rlalign_row_index__"   # the file-order index a streamed row carries until it becomes an Example
_SPLIT_BUCKETS = 1_000_000


class DatasetError(RLAlignError, ValueError):
    """A dataset file or one of its rows cannot be used; the message names the file and line/row."""


ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Example:
    prompt: "str | tuple[dict, ...]"   # text, or chat messages
    answer: str
    source: str  # "file:line" or "file: row N", for error messages
    extra: "dict[str, Any]" = field(default_factory=dict)   # the row's other fields (reward keywords)


@dataclass(frozen=True)
class Columns:
    """Which columns hold the prompt and the answer, and ``renames``: ``{name the reward sees: column}`` for other
    columns (dotted names reach into nested objects)."""
    prompt: str = "prompt"
    answer: str = "answer"
    renames: "Mapping[str, str]" = field(default_factory=dict)


# ---- reading rows ------------------------------------------------------------------------------------------------

def _utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise DatasetError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); save the file as "
                           "UTF-8") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read it ({one_line(e, 300)})") from None


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


def hf_datasets():
    """The ``datasets`` module, offline (``HF_DATASETS_OFFLINE=1`` set before its import: nothing is downloaded), its
    progress bars and log messages off."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError as e:
        raise DatasetError(f"reading this data needs the datasets package, which cannot be imported here ({e}): "
                           "pip install datasets (or use .jsonl / .json)") from None
    datasets.config.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    # its own error logs repeat what the one-line DatasetError says (a second, multi-line message on stderr)
    logging.getLogger("datasets").setLevel(logging.CRITICAL)
    return datasets


_BUILDERS = {".csv": "csv", ".parquet": "parquet", ".jsonl": "json", ".json": "json"}


def _need_pyarrow(path: Path) -> None:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DatasetError(f"{path}: reading a .parquet file needs the pyarrow package, which is not installed here: "
                           "pip install pyarrow (or use .jsonl / .json)") from None


def _file_dataset(path: Path):
    """A local file through ``datasets`` streaming (read lazily; no Arrow cache is written)."""
    if path.suffix.lower() == ".parquet":
        _need_pyarrow(path)
    datasets = hf_datasets()
    try:
        return datasets.load_dataset(_BUILDERS[path.suffix.lower()], data_files=str(path), split="train",
                                     streaming=True)
    except Exception as e:   # datasets / pyarrow raise many types for unreadable files
        raise DatasetError(f"{path}: cannot read {path.suffix.lstrip('.').lower()} ({one_line(e, 300)})") from None


def _folder_dataset(path: Path, split: str, streaming: bool):
    """A ``save_to_disk`` folder: its Dataset, or split ``split`` of its DatasetDict."""
    datasets = hf_datasets()
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DatasetError(f"{path}: not a folder written by datasets' save_to_disk ({one_line(e, 300)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DatasetError(f"{path}: no split {split!r} (the folder has: {', '.join(ds) or 'none'})")
        ds = ds[split]
    return ds.to_iterable_dataset() if streaming else ds


def _local(path: "str | Path") -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise DatasetError(f"{path}: no such file or folder (rlalign reads local data only and never downloads a "
                           "Hugging Face Hub dataset: save it with save_to_disk or as .jsonl first)")
    if not path.is_dir() and path.suffix.lower() not in _BUILDERS:
        raise DatasetError(f"{path}: unknown file type {path.suffix.lower()!r} (use .jsonl, .json, .csv, .parquet "
                           "or a datasets save_to_disk folder)")
    return path


def dataset_of(path: "str | Path", *, split: str = "train", streaming: bool = False):
    """The ``datasets`` object of a local file or ``save_to_disk`` folder: an ``IterableDataset`` for a file or when
    streaming, the folder's ``Dataset`` otherwise."""
    path = _local(path)
    return _folder_dataset(path, split, streaming) if path.is_dir() else _file_dataset(path)


def _numbered(path: Path, rows) -> Iterator[tuple[str, Any]]:
    try:
        for number, row in enumerate(rows, start=1):
            yield f"{path}: row {number}", row
    except DatasetError:
        raise
    except Exception as e:   # a lazily read file fails to parse further on
        raise DatasetError(f"{path}: cannot read it ({one_line(e, 300)})") from None


def read_rows(path: str | Path, *, split: str = "train", streaming: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, row)`` for every row of a local data source (see the module docstring), in order;
    ``location`` names the file and line/row for error messages."""
    path = _local(path)
    suffix = path.suffix.lower()
    if not streaming and path.is_file() and suffix == ".jsonl":
        return _jsonl_rows(path)
    if not streaming and path.is_file() and suffix == ".json":
        return _json_rows(path)
    return _numbered(path, dataset_of(path, split=split, streaming=streaming))


# ---- rows to examples --------------------------------------------------------------------------------------------

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


def to_example(row: Any, where: str, columns: Columns = Columns(), template: "str | None" = None) -> Example:
    """One row as an :class:`Example` (its prompt, answer and the other fields for the reward); a bad row raises
    :class:`DatasetError` naming ``where``."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompt = _field(row, columns.prompt, where)
    if isinstance(prompt, list):
        if template is not None:
            raise DatasetError(f"{where}: field {columns.prompt!r} holds chat messages; prompt_template applies to "
                               "string prompts only (drop task.template; use task.system_prompt for a system message)")
        prompt = _messages(prompt, columns.prompt, where)
    elif not isinstance(prompt, str):
        raise DatasetError(f"{where}: field {columns.prompt!r} must be a string or a list of chat messages, "
                           f"got {type(prompt).__name__}")
    answer = _answer_text(_field(row, columns.answer, where), columns.answer, where)
    if template is not None:
        try:
            prompt = template.format_map({**row, "prompt": prompt})
        except (KeyError, IndexError, ValueError) as e:
            raise DatasetError(f"{where}: prompt_template {template!r} cannot be filled ({type(e).__name__}: {e})"
                               ) from None
    renamed = {name: _field(row, column, where) for name, column in columns.renames.items()}
    taken = {columns.prompt, columns.answer, *columns.renames.values()}
    extra = {k: v for k, v in row.items() if k not in taken}
    return Example(prompt=prompt, answer=answer, source=where, extra={**extra, **renamed})


def _messages(value: list, name: str, where: str) -> tuple[dict, ...]:
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise DatasetError(f"{where}: field {name!r} message {i} must be {{\"role\": one of {list(ROLES)}, "
                               f"\"content\": a string}}, got {str(m)[:80]}")
    if not value or value[-1]["role"] != "user":
        raise DatasetError(f"{where}: field {name!r} must end with a user message (the model answers it)")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def load_examples(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer",
                  prompt_template: str | None = None, columns: "Columns | None" = None,
                  split: str = "train") -> list[Example]:
    """All rows of the source as :class:`Example`, in order; the first bad row raises :class:`DatasetError`
    naming the file and line/row. ``columns`` (when given) replaces ``prompt_field`` / ``answer_field``."""
    columns = columns or Columns(prompt_field, answer_field)
    examples = [to_example(row, where, columns, prompt_template) for where, row in read_rows(path, split=split)]
    if not examples:
        raise DatasetError(f"{path}: no rows")
    return examples


# ---- splits and train streams ------------------------------------------------------------------------------------

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
                 prompt_template: str | None = None, eval_fraction: float = 0.0, seed: int = 0,
                 columns: "Columns | None" = None, split: str = "train") -> tuple[list[Example], list[Example]]:
    """:func:`load_examples` then :func:`split_examples`: returns ``(train, eval)``."""
    examples = load_examples(path, prompt_field=prompt_field, answer_field=answer_field,
                             prompt_template=prompt_template, columns=columns, split=split)
    return split_examples(examples, eval_fraction, seed)


class TrainRows:
    """Train position ``i`` -> an example: pass ``i // n`` over the ``n`` rows, row ``i % n`` of that pass, in file
    order, or with ``shuffle`` in the order of ``random.Random(f"rlalign.data/{seed}/{pass}").shuffle``."""

    def __init__(self, examples: list[Example], seed: int = 0, shuffle: bool = False):
        if not examples:
            raise DatasetError("no train rows (every row went to the eval split)")
        self.examples, self.seed, self.shuffle = examples, seed, shuffle
        self._order: tuple[int, list[int]] = (-1, [])

    def __call__(self, i: int) -> Example:
        epoch, k = divmod(i, len(self.examples))
        if not self.shuffle:
            return self.examples[k]
        if self._order[0] != epoch:
            order = list(range(len(self.examples)))
            random.Random(f"rlalign.data/{self.seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self.examples[self._order[1][k]]


def in_eval_share(seed: int, index: int, eval_fraction: float) -> bool:
    """Whether the row at file-order ``index`` is held out when streaming: a BLAKE2b hash of ``(seed, index)``
    falls in the first ``eval_fraction`` of its range (the same on every machine)."""
    digest = hashlib.blake2b(f"rlalign.data.split/{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SPLIT_BUCKETS < eval_fraction * _SPLIT_BUCKETS


class StreamedRows:
    """A source read lazily through ``datasets`` streaming. Rows in the eval share (:func:`in_eval_share`) are held
    out; :meth:`__call__` gives train position ``i`` (reading on from the last position; an earlier one, as on
    resume, re-reads from the start), passes over the train rows repeating with ``set_epoch(pass)``."""

    def __init__(self, path: "str | Path", *, columns: Columns = Columns(), template: "str | None" = None,
                 split: str = "train", seed: int = 0, eval_fraction: float = 0.0, shuffle: bool = False,
                 shuffle_buffer: int = 10_000):
        self.path, self.columns, self.template = Path(path), columns, template
        self.seed, self.eval_fraction = seed, eval_fraction
        indexed = dataset_of(path, split=split, streaming=True).map(lambda row, i: {_ROW_INDEX: i}, with_indices=True)
        self._indexed = indexed
        train = indexed.filter(lambda row: not in_eval_share(seed, row[_ROW_INDEX], eval_fraction))
        self._train = train.shuffle(seed=seed, buffer_size=shuffle_buffer) if shuffle else train
        self._restart()

    def _example(self, row: dict) -> Example:
        row = dict(row)
        where = f"{self.path}: row {row.pop(_ROW_INDEX) + 1}"
        return to_example(row, where, self.columns, self.template)

    def _pass(self, epoch: int) -> Iterator[dict]:
        self._train.set_epoch(epoch)
        return iter(_numbered(self.path, self._train))

    def _restart(self) -> None:
        self._epoch, self._pos, self._in_pass, self._rows = 0, 0, 0, self._pass(0)

    def _next(self) -> Example:
        while True:
            for _, row in self._rows:
                self._in_pass += 1
                return self._example(row)
            if self._in_pass == 0:
                raise DatasetError(f"{self.path}: no train rows (the source is empty, or every row went to the eval "
                                   "split)")
            self._epoch, self._in_pass = self._epoch + 1, 0
            self._rows = self._pass(self._epoch)

    def __call__(self, i: int) -> Example:
        if i < self._pos:
            self._restart()
        while self._pos < i:
            self._next()
            self._pos += 1
        example = self._next()
        self._pos += 1
        return example

    def eval_examples(self, limit: int = 0) -> list[Example]:
        """The held-out rows in file order (the first ``limit`` of them when ``limit`` > 0: the read stops there)."""
        out: list[Example] = []
        for _, row in _numbered(self.path, self._indexed):
            if in_eval_share(self.seed, row[_ROW_INDEX], self.eval_fraction):
                out.append(self._example(row))
                if len(out) == limit:
                    break
        return out


__all__ = ["Columns", "DatasetError", "Example", "StreamedRows", "TrainRows", "dataset_of", "hf_datasets",
           "in_eval_share", "load_dataset", "load_examples", "read_rows", "split_examples", "to_example", "ROLES"]
