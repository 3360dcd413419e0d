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

The scheduler never influences a token or a logprob: those depend on the sequence's own tokens
and its (seed, position) only.
"""

from __future__ import annotations

import collections
import dataclasses

from rlalign.rollout.block_manager import BlockManager
from rlalign.rollout.config import RolloutConfig
from rlalign.rollout.sequence import Sequence, SeqStatus


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
    chunks: list[Chunk]
    copies: list[tuple[int, int]]   # (src page, dst page) K/V copies to do before the forward
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class Scheduler:
    def __init__(self, config: RolloutConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._watermark = int(config.admission_watermark * block_manager.num_pages)

    # ---- queue ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [])
        budget = self.config.max_num_batched_tokens
        i = 0
        running, append, chunk_cap = self.running, self.blocks.append, self.config.max_prefill_chunk
        ref, ps, chunks = self.blocks.ref_counts, self.blocks.page_size, out.chunks
        while i < len(running) and budget > 0:
            seq = running[i]
            # = _chunk_length and _reserve (reserve 0), inlined: this runs for every sequence every step
            start = seq.num_computed
            n = len(seq.tokens) - start
            table = seq.block_table
            if n == 1 and start < len(table) * ps and ref[table[start // ps]] == 1:
                # the usual decode token: its slot lies in a page the sequence holds alone, so
                # blocks.append would allocate and copy nothing
                chunks.append(Chunk(seq, start, 1))
                budget -= 1
                i += 1
                continue
            n = min(n, budget)
            if chunk_cap is not None:
                n = min(n, chunk_cap)
            copies = append(table, start, start + n, 0)
            if copies is not None:
                if copies:
                    out.copies += copies
                out.chunks.append(Chunk(seq, start, n))
            elif not self._preempt_for(i, n, out):
                continue
            budget -= n
            i += 1
        if out.preempted and out.chunks:
            return out  # pages are short: admitting now would only preempt again
        if not self.waiting:
            return out
        occupied = sum(1 + _pending_forks(s) for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if occupied and occupied + 1 + _pending_forks(seq) > self.config.max_num_seqs:
                break
            self._take_cached_prefix(seq)
            n = self._chunk_length(seq, budget)
            reserve = self._watermark if self.running else 0
            if not self._reserve(seq, n, out, reserve):
                self._release(seq)
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            occupied += 1 + _pending_forks(seq)
            budget -= n
        return out

    def _chunk_length(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed, budget)
        return n if self.config.max_prefill_chunk is None else min(n, self.config.max_prefill_chunk)

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput, reserve: int) -> bool:
        copies = self.blocks.append(seq.block_table, seq.num_computed, seq.num_computed + n, reserve)
        if copies is None:
            return False
        out.copies += copies
        out.chunks.append(Chunk(seq, seq.num_computed, n))
        return True

    def _preempt_for(self, i: int, n: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences (after index i) until running[i] gets its pages;
        preempt running[i] itself when it is the newest. Returns whether running[i] was scheduled."""
        seq = self.running[i]
        while len(self.running) > i + 1:
            self._preempt(self.running.pop(), out)
            if self._reserve(seq, n, out, reserve=0):
                return True
        self._preempt(self.running.pop(i), out)
        return False

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

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
        """The chunks' K/V are in the cache: advance the counters and offer newly full pages to the prefix cache."""
        ps = self.blocks.page_size
        caching = self.blocks.enable_prefix_caching
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed = chunk.start + chunk.length
            if caching:
                full = seq.num_computed // ps
                if full > seq.num_registered_pages:
                    digests = seq.page_digests(ps, full)
                    for b in range(seq.num_registered_pages, full):
                        self.blocks.register(seq.block_table[b], digests[b])
                    seq.num_registered_pages = full

    def fork(self, leader: Sequence) -> list[Sequence]:
        """Start the leader's pending siblings on its pages (prompt computed once, pages shared)."""
        siblings = leader.request.pending_forks
        leader.request.pending_forks = []
        for sib in siblings:
            sib.block_table = self.blocks.fork(leader.block_table)
            sib.num_computed = leader.num_computed
            sib.num_registered_pages = leader.num_registered_pages
            sib.status = SeqStatus.RUNNING
            self.running.append(sib)
        return siblings

    def schedule_continuation(self, seqs: list[Sequence]) -> SchedulerOutput | None:
        """Plan the decode step after the one in flight before its tokens are known (overlapped scheduling):
        each of ``seqs`` feeds one token -- the one the step in flight samples for it -- at position
        ``num_computed`` (its current token count). Returns None, changing nothing, unless that is exactly
        what :meth:`schedule` would run: ``seqs`` the running sequences in order, the token budget holding
        them, nothing admissible (no sequence waiting, or no seat or budget left for the first one), every
        slot in a page the sequence holds alone or in a new page, and free pages for the pages that fill.
        Allocates those pages."""
        running, ps, ref = self.running, self.blocks.page_size, self.blocks.ref_counts
        budget = self.config.max_num_batched_tokens
        if len(seqs) != len(running) or len(seqs) > budget:
            return None
        if self.waiting and len(seqs) < budget and not self._seats_full():
            return None   # schedule() would admit (or try to): a serial step
        grow = []
        for seq, run in zip(seqs, running):
            if seq is not run or seq.num_computed != len(seq.tokens):
                return None
            page = seq.num_computed // ps
            if page == len(seq.block_table):
                grow.append(seq)
            elif page > len(seq.block_table) or ref[seq.block_table[page]] != 1:
                return None   # copy-on-write of a shared page: not a plain continuation
        if len(grow) > self.blocks.num_free:
            return None
        for seq in grow:
            self.blocks.append(seq.block_table, seq.num_computed, seq.num_computed + 1, 0)
        return SchedulerOutput([Chunk(seq, seq.num_computed, 1) for seq in seqs], [], [])

    def _seats_full(self) -> bool:
        """Whether :meth:`schedule` stops before admitting the first waiting sequence for lack of seats
        (``max_num_seqs``, pending forks counted as :meth:`schedule` counts them)."""
        occupied = sum(1 + _pending_forks(s) for s in self.running)
        return occupied > 0 and occupied + 1 + _pending_forks(self.waiting[0]) > self.config.max_num_seqs

    def finish(self, seqs: list[Sequence], free_pages: bool = True) -> None:
        """Free the pages of finished (or aborted) sequences and drop them from the queues.
        ``free_pages=False``: a step in flight still writes their K/V; :meth:`free_pages` once it has run."""
        if not seqs:
            return
        for seq in seqs:
            if free_pages:
                self.blocks.free(seq.block_table)
            seq.status = SeqStatus.FINISHED
        gone = set(map(id, seqs))
        self.running = [s for s in self.running if id(s) not in gone]
        if any(id(s) in gone for s in self.waiting):
            self.waiting = collections.deque(s for s in self.waiting if id(s) not in gone)

    def free_pages(self, seqs: list[Sequence]) -> None:
        """The pages of finished sequences that :meth:`finish` kept (``free_pages=False``)."""
        for seq in seqs:
            self.blocks.free(seq.block_table)


def _pending_forks(seq: Sequence) -> int:
    """Samples a group leader will fork into once its prompt is prefilled (they count towards max_num_seqs)."""
    return len(seq.request.pending_forks) if seq is seq.request.seqs[0] else 0
