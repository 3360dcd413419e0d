"""Record a rollout to a file and replay it through a trainer later (another process or machine).

File format (JSON Lines, UTF-8): line 1 is the header, then one line per completion.

    {"format": "rlalign-rollout", "version": 1, "weights_hash": "<sha256 hex of rlalign.models.weights_hash>",
     "engine": "rlalign", "profile": "strict",
     "sampling": {"n": 2, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 16, "seed": 0,
                  "logprob_temperature": 1.0},
     "model": {...}, "environment": {...}, "num_sequences": 8}
    {"prompt_index": 0, "sample": 0, "prompt_tokens": [...], "tokens": [...], "positions": [...],
     "logprobs": [...], "seed": 123, "finish_reason": "length"}

``positions[i]`` is the absolute position of ``tokens[i]`` (= len(prompt_tokens) + i), ``logprobs[i]``
its log-probability as reported by the engine: fp32 values written as JSON numbers with Python's
shortest round-trip repr, so reading them back and casting to float32 gives the same bits
(-0.0 included). ``seed`` is the per-sample sampling seed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from rlalign.contract.errors import RLAlignError
from rlalign.models.atomic import atomic_write
from rlalign.models.ownership import refuse_link
from rlalign.ops import temperature as temperature_rule

FORMAT = "rlalign-rollout"
VERSION = 1


class ReplayError(RLAlignError, ValueError):
    """A rollout record cannot be read (message names the file and line)."""


def check_record_target(path: Path) -> None:
    """``--record FILE`` may be a new file or a rollout record (replaced); a link, a folder or any other file
    is refused (rlalign.models.ownership: nothing the command did not write is replaced)."""
    path = Path(path)
    refuse_link(path, "--record")
    if not path.exists():
        return
    if not path.is_file() or not _is_record(path):
        raise ReplayError(f"--record {path} already exists and is not a rollout record; choose a new file "
                          "(nothing was changed)")


def _is_record(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            header = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(header, dict) and header.get("format") == FORMAT


@dataclasses.dataclass
class RecordedSequence:
    prompt_index: int
    sample: int
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]
    seed: int | None = None
    finish_reason: str | None = None

    @property
    def positions(self) -> list[int]:
        start = len(self.prompt_tokens)
        return list(range(start, start + len(self.tokens)))

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_tokens + self.tokens

    def to_json(self) -> dict:
        return {"prompt_index": self.prompt_index, "sample": self.sample, "prompt_tokens": self.prompt_tokens,
                "tokens": self.tokens, "positions": self.positions, "logprobs": self.logprobs, "seed": self.seed,
                "finish_reason": self.finish_reason}


@dataclasses.dataclass
class RolloutRecord:
    sequences: list[RecordedSequence]
    weights_hash: str
    sampling: dict
    engine: str = "rlalign"
    profile: str = "strict"
    model: dict = dataclasses.field(default_factory=dict)
    environment: dict = dataclasses.field(default_factory=dict)

    @property
    def logprob_temperature(self) -> float:
        """As recorded; for a record without it, the rule (ops.logprob_temperature) on its sampling
        temperature (missing or null: 1.0)."""
        t = self.sampling.get("logprob_temperature")
        if t is None:
            t = temperature_rule.logprob_temperature(float(self.sampling.get("temperature") or 0.0))
        return float(t)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.sequences)

    def header(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "weights_hash": self.weights_hash, "engine": self.engine,
                "profile": self.profile, "sampling": self.sampling, "model": self.model,
                "environment": self.environment, "num_sequences": len(self.sequences)}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the record atomically (rlalign.models.atomic); an existing ``path`` is
        replaced only when it is a rollout record itself (:func:`check_record_target`)."""
        path = Path(path)
        check_record_target(path)
        lines = [json.dumps(self.header(), allow_nan=True)] + [json.dumps(seq.to_json(), allow_nan=True)
                                                               for seq in self.sequences]
        atomic_write(path, ("\n".join(lines) + "\n").encode("utf-8"))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RolloutRecord":
        path = Path(path)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ReplayError(f"{path}: cannot read rollout record ({exc.strerror or exc})") from None
        if not lines:
            raise ReplayError(f"{path}: empty file (not an {FORMAT} record)")
        header = _parse(path, 1, lines[0])
        if header.get("format") != FORMAT:
            raise ReplayError(f"{path}:1: not an {FORMAT} record (format={header.get('format')!r})")
        if header.get("version") != VERSION:
            raise ReplayError(f"{path}:1: unsupported record version {header.get('version')!r} (this reads {VERSION})")
        for key in ("weights_hash", "sampling"):
            if key not in header:
                raise ReplayError(f"{path}:1: header is missing {key!r}")
        sequences = [_sequence(path, n, _parse(path, n, line))
                     for n, line in enumerate(lines[1:], start=2) if line.strip()]
        expected = header.get("num_sequences")
        if expected is not None and expected != len(sequences):
            raise ReplayError(f"{path}: header says {expected} sequences but the file holds {len(sequences)} "
                              "(truncated?)")
        return cls(sequences, str(header["weights_hash"]), dict(header["sampling"]), str(header.get("engine", "?")),
                   str(header.get("profile", "?")), dict(header.get("model") or {}),
                   dict(header.get("environment") or {}))


def _parse(path: Path, lineno: int, line: str) -> dict:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ReplayError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ReplayError(f"{path}:{lineno}: expected a JSON object")
    return value


def _sequence(path: Path, lineno: int, d: dict[str, Any]) -> RecordedSequence:
    where = f"{path}:{lineno}"
    for key in ("prompt_tokens", "tokens", "logprobs"):
        if not isinstance(d.get(key), list):
            raise ReplayError(f"{where}: missing or non-list {key!r}")
    if not d["prompt_tokens"]:
        raise ReplayError(f"{where}: empty prompt_tokens")
    if len(d["logprobs"]) != len(d["tokens"]):
        raise ReplayError(f"{where}: {len(d['tokens'])} tokens but {len(d['logprobs'])} logprobs")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in d["prompt_tokens"] + d["tokens"]):
        raise ReplayError(f"{where}: token ids must be integers")
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) for x in d["logprobs"]):
        raise ReplayError(f"{where}: logprobs must be numbers")
    seq = RecordedSequence(int(d.get("prompt_index", 0)), int(d.get("sample", 0)), list(d["prompt_tokens"]),
                           list(d["tokens"]), [float(x) for x in d["logprobs"]], d.get("seed"),
                           d.get("finish_reason"))
    if "positions" in d and d["positions"] != seq.positions:
        raise ReplayError(f"{where}: positions must be len(prompt_tokens) + i, got {d['positions'][:4]}...")
    return seq


__all__ = ["RolloutRecord", "RecordedSequence", "ReplayError", "FORMAT", "VERSION"]
