"""Continuous batching: which sequences run this step, how many new tokens each, and on which pages.

One step = one forward over a list of chunks, a chunk being ``tokens[start:start + length]`` of one
sequence (a whole prompt, a prefill chunk, one decode token, or a recompute after preemption).
Policy, per step, with a token budget ``max_num_batched_tokens``:

1. running sequences in admission order, each ``min(uncomputed, max_prefill_chunk, budget left)``
   tokens. When pages run out, the most recently admitted running sequence is preempted (its
   pages freed, back to the front of the queue; it is recomputed from its tokens later) until
   the chunk fits, or the sequence preempts itself if it is the newest.
2. unless step 1 preempted, waiting sequences in queue order while the budget, ``max_num_seqs``
   and the pages allow (a watermark of free pages is kept for the running ones). With prefix caching, a newly
   admitted sequence first takes the cached pages of its longest cached full-page prefix
   (never its last token: that row must be computed to sample from it).

Running sequences hold a slot of :class:`rlalign.rollout.slots.SlotTable` (their counters, tokens and
page table as arrays; ``running_slots`` lists them in running order). The leading running sequences
that each feed one decode token into a page they hold alone, or into a new page, are planned with array
operations (the usual step: all of them); the rest go through the per-sequence policy above. Plans are
columns (:class:`SchedulerOutput`: seqs, slots, starts, lengths).

The scheduler never influences a token or a logprob: those depend on the sequence's own tokens
and its (seed, position) only.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from rlalign.rollout.block_manager import BlockManager
from rlalign.rollout.config import RolloutConfig
from rlalign.rollout.sequence import Sequence, SeqStatus
from rlalign.rollout.slots import SlotTable


@dataclasses.dataclass(slots=True)
class Chunk:
    seq: Sequence
    start: int      # = seq.num_computed when scheduled
    length: int

    @property
    def samples(self) -> bool:
        """Whether the chunk ends at the sequence's last token (its last row is sampled from)."""
        return self.start + self.length == self.seq.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    """One step's chunks as aligned columns: chunk i is ``seqs[i].tokens[starts[i]:starts[i] + lengths[i]]``,
    its sequence in slot ``slots[i]`` of the scheduler's :class:`SlotTable` (int64 arrays)."""
    seqs: list[Sequence]
    slots: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    copies: list[tuple[int, int]]   # (src page, dst page) K/V copies to do before the forward
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks as objects (tests and per-chunk code; the engine's per-step code reads the columns)."""
        return [Chunk(*row) for row in zip(self.seqs, self.starts.tolist(), self.lengths.tolist())]

    def select(self, keep: np.ndarray) -> "SchedulerOutput":
        """The chunks where the boolean ``keep`` is True (no copies, no preemptions)."""
        return SchedulerOutput(list(itertools.compress(self.seqs, keep.tolist())), self.slots[keep],
                               self.starts[keep], self.lengths[keep], [], [])


class Scheduler:
    def __init__(self, config: RolloutConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.running_slots = np.zeros(0, np.int64)   # running[i].slot, kept aligned with running
        self.slots = SlotTable(capacity=config.max_num_seqs)
        self.num_preemptions = 0
        self.parked: list[Sequence] = []   # held until a weight update restarts them (:meth:`park`)
        self._watermark = int(config.admission_watermark * block_manager.num_pages)
        self._leaders: set[Sequence] = set()   # running group leaders that may still have forks pending

    # ---- queue ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        self.slots.assign(seq)
        self.running.append(seq)
        self.running_slots = np.append(self.running_slots, seq.slot)
        if _pending_forks(seq):
            self._leaders.add(seq)

    def _stop_running(self, i: int) -> Sequence:
        """Take running[i] out of the running list and give back its slot."""
        seq = self.running.pop(i)
        self.running_slots = np.delete(self.running_slots, i)
        self.slots.release(seq)
        self._leaders.discard(seq)
        return seq

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The step's chunks (module docstring). The leading running sequences that each feed one decode
        token into a page they hold alone or a new page are planned at once on the slot arrays
        (:meth:`_decode_prefix`); the rest -- prefill chunks, copy-on-write, preemption, admissions --
        one by one, as the policy says."""
        budget = self.config.max_num_batched_tokens
        k, starts = self._decode_prefix(budget)
        prefix = (self.running[:k], self.running_slots[:k].copy(), starts)
        budget -= k
        rows: list[tuple[Sequence, int, int]] = []   # (seq, start, length) after the prefix
        copies, preempted = [], []
        i = k
        running, append, chunk_cap = self.running, self.blocks.append, self.config.max_prefill_chunk
        ref, ps = self.blocks.ref_counts, self.blocks.page_size
        while i < len(running) and budget > 0:
            seq = running[i]
            start = seq.num_computed
            n = seq.num_tokens - start
            table = seq.block_table
            if n == 1 and start < len(table) * ps and ref[table[start // ps]] == 1:
                rows.append((seq, start, 1))   # a decode token into a page it holds alone: nothing to do
                budget -= 1
                i += 1
                continue
            n = min(n, budget)
            if chunk_cap is not None:
                n = min(n, chunk_cap)
            new_copies = append(table, start, start + n, 0)
            if new_copies is not None:
                copies += new_copies
                self.slots.set_pages(seq)
                rows.append((seq, start, n))
            elif not self._preempt_for(i, n, rows, copies, preempted):
                continue
            budget -= n
            i += 1
        if not (preempted and (k or rows)) and self.waiting:   # pages short: admitting would only preempt again
            self._admit(budget, rows, copies)
        return _output(prefix, rows, copies, preempted)

    def _decode_prefix(self, budget: int) -> tuple[int, np.ndarray]:
        """(k, starts): running[:k] each feed one decode token at ``starts`` (= num_computed), written into
        a page the sequence holds alone, or a new page, allocated here. k stops at the first sequence
        that is anything else, at the token budget, and where the new pages run out (so what follows
        is exactly what the one-by-one loop would do)."""
        slots = self.running_slots
        if not slots.size or budget <= 0:
            return 0, np.zeros(0, np.int64)
        table, ps = self.slots, self.blocks.page_size
        starts = table.num_computed[slots]
        page = starts // ps
        num_pages = table.num_pages[slots]
        grow = page == num_pages
        inside = page < num_pages
        held_alone = np.zeros(slots.size, bool)
        held_alone[inside] = self.blocks.ref_counts[table.pages[slots[inside], page[inside]]] == 1
        plain = (table.num_tokens[slots] - starts == 1) & (grow | held_alone)
        k = min(slots.size if plain.all() else int(plain.argmin()), budget)
        short = (grow[:k].cumsum() > self.blocks.num_free).nonzero()[0]
        if short.size:
            k = int(short[0])
        self._grow_tables(slots[:k], grow[:k])
        return k, starts[:k]

    def _grow_tables(self, slots: np.ndarray, grow: np.ndarray) -> None:
        """A new page at the end of the table of each sequence of ``slots`` where ``grow`` (its next token
        starts a page; the caller checked that enough pages are free)."""
        rows = grow.nonzero()[0]
        if not rows.size:
            return
        new_pages = self.blocks.allocate(rows.size)
        if new_pages is None:
            raise RuntimeError("internal: the scheduler counted free pages that are not there")
        for seq, page in zip(self.slots.owner[slots[rows]].tolist(), new_pages):
            seq.block_table.append(page)
        self.slots.push_pages(slots[rows], np.asarray(new_pages, np.int32))

    def _admit(self, budget: int, rows: list, copies: list) -> None:
        """Waiting sequences in queue order while the budget, max_num_seqs and the pages allow."""
        occupied = self._occupied()
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if occupied and occupied + 1 + _pending_forks(seq) > self.config.max_num_seqs:
                break
            self._take_cached_prefix(seq)
            n = self._chunk_length(seq, budget)
            reserve = self._watermark if self.running else 0
            if not self._reserve(seq, n, rows, copies, reserve):
                self._release(seq)
                break
            self.waiting.popleft()
            self._start_running(seq)
            occupied += 1 + _pending_forks(seq)
            budget -= n

    def _occupied(self) -> int:
        """Seats of max_num_seqs taken: running sequences and the samples their leaders will fork."""
        return len(self.running) + sum(_pending_forks(s) for s in self._leaders)

    def _chunk_length(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed, budget)
        return n if self.config.max_prefill_chunk is None else min(n, self.config.max_prefill_chunk)

    def _reserve(self, seq: Sequence, n: int, rows: list, copies: list, reserve: int) -> bool:
        start = seq.num_computed
        new_copies = self.blocks.append(seq.block_table, start, start + n, reserve)
        if new_copies is None:
            return False
        copies += new_copies
        if seq.slot is not None:
            self.slots.set_pages(seq)
        rows.append((seq, start, n))
        return True

    def _preempt_for(self, i: int, n: int, rows: list, copies: list, preempted: list) -> bool:
        """Preempt the newest running sequences (after index i) until running[i] gets its pages;
        preempt running[i] itself when it is the newest. Returns whether running[i] was scheduled."""
        seq = self.running[i]
        while len(self.running) > i + 1:
            self._preempt(len(self.running) - 1, preempted)
            if self._reserve(seq, n, rows, copies, reserve=0):
                return True
        self._preempt(i, preempted)
        return False

    def _preempt(self, i: int, preempted: list) -> None:
        seq = self.running[i]
        self._release(seq)
        self._stop_running(i)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.num_registered_pages = 0

    def _take_cached_prefix(self, seq: Sequence) -> None:
        if not self.blocks.enable_prefix_caching or seq.block_table:
            return
        ps = self.blocks.page_size
        pages = self.blocks.match_prefix(seq.page_digests(ps, (seq.num_tokens - 1) // ps))
        seq.block_table = pages
        seq.num_computed = seq.num_registered_pages = len(pages)
        seq.num_computed *= ps

    # ---- after the forward ---------------------------------------------------------------------

    def mark_computed(self, out: SchedulerOutput) -> None:
        """The chunks' K/V are in the cache: advance the counters (at once, on the slots) and offer newly
        full pages to the prefix cache (one by one: a sequence's page fills every page_size tokens)."""
        ends = out.starts + out.lengths
        self.slots.num_computed[out.slots] = ends
        if not self.blocks.enable_prefix_caching:
            return
        ps = self.blocks.page_size
        full = ends // ps
        for r in (full > self.slots.num_registered[out.slots]).nonzero()[0].tolist():
            seq, count = out.seqs[r], int(full[r])
            digests = seq.page_digests(ps, count)
            for b in range(seq.num_registered_pages, count):
                self.blocks.register(seq.block_table[b], digests[b])
            seq.num_registered_pages = count

    def fork(self, leader: Sequence) -> list[Sequence]:
        """Start the leader's pending siblings on its pages (prompt computed once, pages shared)."""
        siblings = leader.request.pending_forks
        leader.request.pending_forks = []
        self._leaders.discard(leader)
        for sib in siblings:
            sib.block_table = self.blocks.fork(leader.block_table)
            sib.num_computed = leader.num_computed
            sib.num_registered_pages = leader.num_registered_pages
            self._start_running(sib)
        return siblings

    def forking_leaders(self) -> list[Sequence]:
        """Running group leaders whose siblings are still to be forked (they fork when their prompt is in)."""
        return [s for s in self._leaders if _pending_forks(s)] if self._leaders else []

    def schedule_continuation(self, slots: np.ndarray) -> SchedulerOutput | None:
        """Plan the decode step after the one in flight before its tokens are known (overlapped scheduling):
        each sequence of ``slots`` (int64) feeds one token -- the one the step in flight samples for it --
        at position ``num_computed`` (its current token count). Returns None, changing nothing, unless that
        is exactly what :meth:`schedule` would run: ``slots`` the running sequences in order, the token
        budget holding them, nothing admissible (no sequence waiting, or no seat or budget left for the
        first one), every slot in a page the sequence holds alone or in a new page, and free pages for the
        pages that fill. Allocates those pages. Array operations only, plus one call per new page."""
        budget = self.config.max_num_batched_tokens
        if slots.size != self.running_slots.size or slots.size > budget:
            return None
        if self.waiting and slots.size < budget and not self._seats_full():
            return None   # schedule() would admit (or try to): a serial step
        if not (slots == self.running_slots).all():
            return None
        table, ps = self.slots, self.blocks.page_size
        starts = table.num_computed[slots]
        page, num_pages = starts // ps, table.num_pages[slots]
        grow = page == num_pages
        if (table.num_tokens[slots] != starts).any() or (page > num_pages).any():
            return None
        inside = ~grow
        if (self.blocks.ref_counts[table.pages[slots[inside], page[inside]]] != 1).any():
            return None   # copy-on-write of a shared page: not a plain continuation
        if int(grow.sum()) > self.blocks.num_free:
            return None
        self._grow_tables(slots, grow)
        return SchedulerOutput(list(self.running), slots.copy(), starts, np.ones(slots.size, np.int64), [], [])

    def _seats_full(self) -> bool:
        """Whether :meth:`schedule` stops before admitting the first waiting sequence for lack of seats
        (``max_num_seqs``, pending forks counted as :meth:`schedule` counts them)."""
        occupied = self._occupied()
        return occupied > 0 and occupied + 1 + _pending_forks(self.waiting[0]) > self.config.max_num_seqs

    def park(self, seqs: list[Sequence], free_pages: bool = True) -> None:
        """Hold running sequences out of the queues until :meth:`restart_all` (a weight update mid-generation):
        their pages freed (their K/V belong to the weights that computed them) and their slots given back, as
        :meth:`finish` does; they are not finished."""
        self.finish(seqs, free_pages, status=SeqStatus.PARKED)
        self.parked.extend(seqs)

    def only_parked(self) -> bool:
        """Whether every unfinished sequence is parked (none running or waiting)."""
        return bool(self.parked) and not self.running and not self.waiting

    def restart_all(self) -> None:
        """Every sequence to be recomputed from its first token: the running ones preempted (pages freed), the
        parked ones queued again, in that order before those already waiting (a weight update with requests in
        flight: no K/V of the old weights is kept)."""
        while self.running:
            self._preempt(len(self.running) - 1, [])
        for seq in self.parked:
            self.blocks.free(seq.block_table)   # empty already, unless a step in flight held them (completed by now)
            seq.num_computed = seq.num_registered_pages = 0
            seq.status = SeqStatus.WAITING
        self.waiting.extend(self.parked)
        self.parked = []

    def finish(self, seqs: list[Sequence], free_pages: bool = True, status: SeqStatus = SeqStatus.FINISHED) -> None:
        """Free the pages of finished (or aborted) sequences and drop them from the queues (their slots
        given back). ``free_pages=False``: a step in flight still writes their K/V; :meth:`free_pages`
        once it has run."""
        if not seqs:
            return
        gone_slots, queued = [], False
        for seq in seqs:
            if free_pages:
                self.blocks.free(seq.block_table)
            if seq.slot is not None:
                gone_slots.append(seq.slot)
                self.slots.release(seq)
            else:
                queued = True
            self._leaders.discard(seq)
            seq.status = status
        if gone_slots:
            gone = np.zeros(self.slots.capacity, bool)
            gone[gone_slots] = True
            keep = ~gone[self.running_slots]
            self.running = list(itertools.compress(self.running, keep.tolist()))
            self.running_slots = self.running_slots[keep]
        if queued:
            gone = set(map(id, seqs))
            if any(id(s) in gone for s in self.waiting):
                self.waiting = collections.deque(s for s in self.waiting if id(s) not in gone)
            if self.parked:
                self.parked = [s for s in self.parked if id(s) not in gone]

    def free_pages(self, seqs: list[Sequence]) -> None:
        """The pages of finished sequences that :meth:`finish` kept (``free_pages=False``)."""
        for seq in seqs:
            self.blocks.free(seq.block_table)


def _output(prefix: tuple, rows: list, copies: list, preempted: list) -> SchedulerOutput:
    """The plan: the decode prefix's columns, then the one-by-one rows."""
    seqs, slots, starts = prefix
    if not rows:
        return SchedulerOutput(seqs, slots, starts, np.ones(len(seqs), np.int64), copies, preempted)
    count = len(rows)
    more_seqs = [r[0] for r in rows]
    return SchedulerOutput(
        seqs + more_seqs,
        np.concatenate([slots, np.fromiter((s.slot for s in more_seqs), np.int64, count)]),
        np.concatenate([starts, np.fromiter((r[1] for r in rows), np.int64, count)]),
        np.concatenate([np.ones(len(seqs), np.int64), np.fromiter((r[2] for r in rows), np.int64, count)]),
        copies, preempted)


def _pending_forks(seq: Sequence) -> int:
    """Samples a group leader will fork into once its prompt is prefilled (they count towards max_num_seqs)."""
    return len(seq.request.pending_forks) if seq is seq.request.seqs[0] else 0
