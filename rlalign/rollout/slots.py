"""The running sequences' per-step state as arrays: one slot (row) per running sequence.

A decode step touches every running sequence: its new token and logprob, its token count, its
computed count, now and then a new page. Held in Python objects that is a loop over the sequences
every step; held here it is a handful of numpy operations on the step's slots, whatever their number.
The :class:`SlotTable` (owned by the scheduler) holds, for the sequence in slot s:

- ``tokens[s, :num_tokens[s]]`` (prompt then generated ids), ``logprobs[s, p]`` the logprob of the
  token at position p (p >= ``num_prompt[s]``);
- ``num_computed[s]`` (prefix whose K/V are in the cache), ``num_registered[s]`` (leading full pages
  offered to the prefix cache);
- ``pages[s, :num_pages[s]]`` its block table (int32, 0 past its end; the list
  ``Sequence.block_table`` stays the block manager's, and every change to it is mirrored here with
  :meth:`set_pages` or :meth:`push_pages`);
- what never changes while it runs: ``seed``, ``length_limit`` (prompt + max_new_tokens),
  ``temperature`` / ``top_k`` / ``top_p`` / ``min_p``, ``sampled_logprobs`` (1: its request's
  ``logprobs="sampled"``), ``stop_ids[s]`` its request's stop token ids (ascending, -1
  past them: a whole step's stop test is one comparison), and its identity for the step outputs.

A sequence takes a slot when it starts running (:meth:`assign` copies its tokens in) and gives it back
when it stops (finished, aborted, preempted: :meth:`release` writes the slot back into the Sequence).
In between the Sequence reads its counters from the slot, and its ``tokens`` / ``logprobs`` lists are
brought up to date from the slot when read (:meth:`sync`): the per-step appends are array writes only.
Slots are reused; rows grow (capacity, token width, page width) by doubling, so a step never reallocates
in the usual case.
"""

from __future__ import annotations

import numpy as np

_INT_FIELDS = ("num_tokens", "num_computed", "num_prompt", "num_registered", "num_pages", "seed",
               "length_limit", "top_k", "prompt_index", "sample_index", "sampled_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p")   # float64: .tolist() gives back the requests' exact Python floats


class SlotTable:
    """Per-slot arrays of the running sequences (module docstring). ``capacity`` slots to start with."""

    def __init__(self, capacity: int = 64, token_width: int = 256, page_width: int = 16):
        capacity, token_width, page_width = max(capacity, 1), max(token_width, 1), max(page_width, 1)
        for name in _INT_FIELDS:
            setattr(self, name, np.zeros(capacity, np.int64))
        for name in _FLOAT_FIELDS:
            setattr(self, name, np.zeros(capacity, np.float64))
        self.owner = np.full(capacity, None, dtype=object)        # the Sequence in each slot
        self.request_id = np.full(capacity, None, dtype=object)
        self.tokens = np.zeros((capacity, token_width), np.int64)
        self.logprobs = np.zeros((capacity, token_width), np.float32)
        self.pages = np.zeros((capacity, page_width), np.int32)
        self.stop_ids = np.full((capacity, 0), -1, np.int64)
        self._free = list(range(capacity - 1, -1, -1))             # pop() hands out the lowest slot

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    # ---- a sequence enters / leaves -------------------------------------------------------------

    def assign(self, seq) -> int:
        """Give ``seq`` (holding no slot) a slot holding its tokens, logprobs, counters and block table."""
        if seq.slot is not None:
            raise RuntimeError(f"internal: {seq!r} already holds slot {seq.slot}")
        if not self._free:
            self._grow_capacity(2 * self.capacity)
        s = self._free.pop()
        n, prompt = len(seq._tokens), seq.num_prompt_tokens
        self._fit_tokens(n)
        self.tokens[s, :n] = seq._tokens
        self.logprobs[s, prompt:n] = seq._logprobs
        self.num_tokens[s], self.num_prompt[s] = n, prompt
        self.num_computed[s], self.num_registered[s] = seq._num_computed, seq._num_registered_pages
        sampling = seq.request.sampling
        self.seed[s], self.length_limit[s] = seq.seed, prompt + sampling.max_new_tokens
        self.temperature[s], self.top_k[s], self.top_p[s] = sampling.temperature, sampling.top_k, sampling.top_p
        self.min_p[s], self.sampled_logprobs[s] = sampling.min_p, sampling.logprobs == "sampled"
        stops = sorted(seq.request.stop_token_ids)
        if len(stops) > self.stop_ids.shape[1]:
            self.stop_ids = _widen(self.stop_ids, len(stops), fill=-1)
        self.stop_ids[s, :len(stops)] = stops
        self.owner[s], self.request_id[s] = seq, seq.request.request_id
        self.prompt_index[s], self.sample_index[s] = seq.request.prompt_index, seq.sample_index
        seq.slot, seq.slot_table = s, self
        self.set_pages(seq)
        return s

    def release(self, seq) -> None:
        """Write ``seq``'s slot back into it (tokens, logprobs, counters) and free the slot."""
        s = seq.slot
        self.sync(seq)
        seq._num_computed, seq._num_registered_pages = int(self.num_computed[s]), int(self.num_registered[s])
        self.pages[s, :self.num_pages[s]] = 0
        self.num_pages[s] = 0
        self.stop_ids[s] = -1
        self.owner[s] = self.request_id[s] = None
        seq.slot = None
        self._free.append(s)

    def sync(self, seq) -> None:
        """Bring ``seq``'s token and logprob lists up to its slot (the tokens appended since the last sync)."""
        s, tokens, logprobs = seq.slot, seq._tokens, seq._logprobs
        n, prompt = int(self.num_tokens[s]), seq.num_prompt_tokens
        if len(tokens) > n or prompt + len(logprobs) > n:
            raise RuntimeError(f"internal: {len(tokens)} tokens in the list of {seq!r} but {n} in its slot: a running "
                               "sequence's tokens are appended with SlotTable.append, not to its list")
        if len(tokens) < n:
            tokens.extend(self.tokens[s, len(tokens):n].tolist())
        if prompt + len(logprobs) < n:
            logprobs.extend(self.logprobs[s, prompt + len(logprobs):n].tolist())

    # ---- block tables ---------------------------------------------------------------------------

    def set_pages(self, seq) -> None:
        """Mirror ``seq.block_table`` (changed by the block manager) into its slot."""
        s, table = seq.slot, seq.block_table
        old, new = int(self.num_pages[s]), len(table)
        if new > self.pages.shape[1]:
            self._grow_pages(max(new, 2 * self.pages.shape[1]))
        self.pages[s, :new] = table
        if old > new:
            self.pages[s, new:old] = 0
        self.num_pages[s] = new

    def push_pages(self, slots: np.ndarray, pages: np.ndarray) -> None:
        """One new page at the end of each of ``slots``' tables (already appended to their block_table lists)."""
        ends = self.num_pages[slots]
        if slots.size and int(ends.max()) >= self.pages.shape[1]:
            self._grow_pages(2 * self.pages.shape[1])
        self.pages[slots, ends] = pages
        self.num_pages[slots] = ends + 1

    def table(self, slots: np.ndarray) -> np.ndarray:
        """The block tables of ``slots`` as one int32 [n, longest] array, 0 past each table's end."""
        width = int(self.num_pages[slots].max()) if slots.size else 0
        return self.pages[slots, :width]

    # ---- a step's results -----------------------------------------------------------------------

    def hits_stop(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """bool [n]: whether ``tokens[i]`` is one of the stop token ids of the sequence in ``slots[i]``."""
        if not self.stop_ids.shape[1]:
            return np.zeros(slots.size, bool)
        return (self.stop_ids[slots] == tokens[:, None]).any(axis=1)

    def append(self, slots: np.ndarray, positions: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Each of ``slots`` gets ``tokens[i]`` (logprob ``logprobs[i]``) at ``positions[i]`` = its token count."""
        if slots.size:
            self._fit_tokens(int(positions.max()) + 1)
        self.tokens[slots, positions] = tokens
        self.logprobs[slots, positions] = logprobs
        self.num_tokens[slots] = positions + 1

    # ---- growth ---------------------------------------------------------------------------------

    def _fit_tokens(self, n: int) -> None:
        width = self.tokens.shape[1]
        if n > width:
            self.tokens = _widen(self.tokens, max(n, 2 * width))
            self.logprobs = _widen(self.logprobs, max(n, 2 * width))

    def _grow_pages(self, width: int) -> None:
        self.pages = _widen(self.pages, width)

    def _grow_capacity(self, capacity: int) -> None:
        old = self.capacity
        for name in (*_INT_FIELDS, *_FLOAT_FIELDS, "owner", "request_id"):
            array = getattr(self, name)
            grown = np.full(capacity, None, dtype=object) if array.dtype == object else np.zeros(capacity, array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        for name in ("tokens", "logprobs", "pages", "stop_ids"):
            array = getattr(self, name)
            grown = np.full((capacity, array.shape[1]), -1 if name == "stop_ids" else 0, array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free


def _widen(array: np.ndarray, width: int, fill: int = 0) -> np.ndarray:
    grown = np.full((array.shape[0], width), fill, array.dtype)
    grown[:, :array.shape[1]] = array
    return grown


__all__ = ["SlotTable"]
