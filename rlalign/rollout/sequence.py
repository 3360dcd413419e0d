"""Requests, their sequences (one per sample) and what the engine hands back.

A :class:`Sequence` is one sample of one request: its tokens (prompt then completion) and
explicit counters. ``num_computed`` is the length of the prefix whose K/V are in the cache; the
tokens ``tokens[num_computed:]`` are fed by the next forwards (a whole prompt, a prefill chunk,
the one token sampled last step, or everything again after a preemption). When a forward brings
``num_computed`` up to ``num_tokens``, the last row's hidden state samples the next token.

While a sequence runs it holds a slot of the scheduler's :class:`rlalign.rollout.slots.SlotTable`,
which owns its per-step state (tokens, logprobs, num_computed, registered pages) in arrays that a
decode step updates for every running sequence at once. Then the Sequence is a view: its counters
read the slot, and ``tokens`` / ``logprobs`` are brought up to date from it when read (the lists
returned are the record: append to them only while the sequence holds no slot; a running sequence's
tokens are appended through ``SlotTable.append``).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from array import array

from rlalign.models.completion import Completion
from rlalign.rollout.config import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"        # queued (new, or preempted: its pages were freed, recomputed on return)
    RUNNING = "running"        # holds pages, scheduled every step while the budget allows
    FORK_PENDING = "fork_pending"  # a sample waiting for its group leader's prompt prefill
    PARKED = "parked"          # held (no pages) until a weight update restarts it (partial rollouts)
    FINISHED = "finished"


class _SlotCounter:
    """A per-step counter of a :class:`Sequence`: the slot table's ``column`` while the sequence holds a slot,
    else its own ``field``."""

    def __init__(self, column: str, field: str):
        self.column, self.field = column, field

    def __get__(self, seq, owner=None):
        if seq is None:
            return self
        if seq.slot is not None:
            return int(getattr(seq.slot_table, self.column)[seq.slot])
        return getattr(seq, self.field)

    def __set__(self, seq, value: int) -> None:
        if seq.slot is not None:
            getattr(seq.slot_table, self.column)[seq.slot] = value
        else:
            setattr(seq, self.field, value)


class Sequence:
    """One sample: ``tokens`` = prompt + generated, ``block_table`` = its KV pages in position order."""

    __slots__ = ("request", "sample_index", "seed", "_tokens", "num_prompt_tokens", "_num_computed", "block_table",
                 "_logprobs", "status", "finish_reason", "stop_reason", "num_preemptions", "_num_registered_pages",
                 "routing", "_digests", "slot", "slot_table", "version_marks")

    def __init__(self, request: "Request", sample_index: int, seed: int, prompt_tokens: list[int]):
        self.request = request
        self.sample_index = sample_index
        self.seed = seed
        self._tokens = list(prompt_tokens)
        self.num_prompt_tokens = len(prompt_tokens)
        self._num_computed = 0
        self.block_table: list[int] = []
        self._logprobs: list[float] = []
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self._num_registered_pages = 0   # leading full pages already offered to the prefix cache
        self.routing = None             # expert ids of the computed rows, gathered when it finishes (record_routing)
        self._digests: list[bytes] = []
        self.slot: int | None = None    # its row in slot_table while it runs (SlotTable.assign / release)
        self.slot_table = None
        # (first completion token index, weights version) of each version that sampled it, in order
        self.version_marks: list[tuple[int, int]] = [(0, request.weights_version)]

    # ---- the per-step state: the slot's while it runs, else these fields ------------------------

    @property
    def tokens(self) -> list[int]:
        """Prompt + generated token ids (the record; read-only while the sequence holds a slot)."""
        if self.slot is not None:
            self.slot_table.sync(self)
        return self._tokens

    @property
    def logprobs(self) -> list[float]:
        """The generated tokens' logprobs (read-only while the sequence holds a slot)."""
        if self.slot is not None:
            self.slot_table.sync(self)
        return self._logprobs

    @property
    def num_tokens(self) -> int:
        if self.slot is not None:
            return int(self.slot_table.num_tokens[self.slot])
        return len(self._tokens)

    num_computed = _SlotCounter("num_computed", "_num_computed")
    num_registered_pages = _SlotCounter("num_registered", "_num_registered_pages")

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def switch_version(self, version: int) -> None:
        """Its tokens from now on are sampled by weights ``version`` (a weight update with the sample in flight)."""
        if self.version_marks[-1][0] == self.num_output_tokens:   # no token sampled by the version it replaces
            self.version_marks.pop()
        self.version_marks.append((self.num_output_tokens, version))

    def token_versions(self) -> list[int] | None:
        """The weights version of each completion token when more than one version sampled them, else None."""
        if len(self.version_marks) == 1:
            return None
        ends = [start for start, _ in self.version_marks[1:]] + [self.num_output_tokens]
        return [v for (start, v), end in zip(self.version_marks, ends) for _ in range(start, end)]

    def page_digests(self, page_size: int, count: int) -> list[bytes]:
        """Digests of the first ``count`` full pages of tokens: d_i = blake2b-128(d_{i-1} || int64 tokens of page i),
        d_{-1} = b"". Equal digests mean equal token prefixes (up to a 2**-128 collision)."""
        while len(self._digests) < count:
            i = len(self._digests)
            prev = self._digests[-1] if i else b""
            page = self._page_bytes(i * page_size, (i + 1) * page_size)
            self._digests.append(hashlib.blake2b(prev + page, digest_size=16).digest())
        return self._digests[:count]

    def _page_bytes(self, start: int, end: int) -> bytes:
        """tokens[start:end] as int64 bytes (native order), read from the slot while the sequence runs."""
        if self.slot is not None:
            return self.slot_table.tokens[self.slot, start:end].tobytes()
        return array("q", self._tokens[start:end]).tobytes()

    def __repr__(self) -> str:
        return (f"Sequence({self.request.request_id}/{self.sample_index}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed}, pages={len(self.block_table)})")


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_index: int
    prompt_tokens: list[int]
    prompt_text: str | None
    sampling: SamplingParams
    weights_version: int
    stop_token_ids: frozenset[int]
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    pending_forks: list[Sequence] = dataclasses.field(default_factory=list)  # siblings of seqs[0] awaiting its prefill

    @property
    def finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)


@dataclasses.dataclass(slots=True)
class StepOutput:
    """One token produced by :meth:`RolloutEngine.step` (or an abort); ``completion`` is set once the sample ends."""

    request_id: str
    prompt_index: int
    sample_index: int
    token: int | None
    logprob: float | None
    finished: bool
    completion: Completion | None = None
