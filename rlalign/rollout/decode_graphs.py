"""Decode steps as CUDA graph replays: one captured forward per batch-size bucket.

A decode step (every running sequence feeds one token) is the same ~15 launches per layer every
step; issued from Python they cost far more host time than the GPU needs for them. So the model's
``forward_hidden`` is captured once per bucket size b (1, 2, 4, 8, 16, 20, 24, 28, 32, 40, 48, ...
up to ``max_batch``; all of them at the first decode step) on static input buffers and replayed;
the sampler and the logprob op stay eager.

Why padding cannot change a bit: a step with n < b sequences fills rows n..b-1 with padding
sequences, and in the strict profile a row's result does not depend on the other rows of the batch
(the contract every strict op keeps; the rollout bitwise tests check it with this path too). The
padding rows are self-contained: padding row j (j = 0, 1, ...) is token 0 at position
p = j % page_size of its own scratch page ``scratch[j // page_size]``, so its context (keys 0..p)
is written by padding rows j - p .. j of the same step. Scratch pages lie beyond the block
manager's pages: no real sequence ever reads or writes them.

The static buffers are the forward's only inputs besides the weights and the KV cache, which are
updated in place (:meth:`RolloutEngine.update_weights` copies into the parameters), so the graphs
stay valid across weight updates. The batch is built by the engine, so the ops' index validations
(host syncs, impossible inside a graph) are replaced by :meth:`check` on the host arrays, and the
strict finiteness verdicts recorded in the graph are re-queued after every replay
(:func:`rlalign.ops._checks.requeue`), raised by the next logprob op as in an eager step.

``mode="padded"`` runs the same padded static batches eagerly, without capture: the CPU tests
check with it that padding leaves every token and logprob unchanged.

The native profile (the benchmarks' baseline) runs the same machinery. Its paged attention has no
per-row contract, so it cannot read each sequence's length on the host inside a graph: under
:func:`rlalign.ops.static_decode` it attends over the whole width of the block table it is given,
masked by ``seq_lens`` on the device. So that width follows the step, native graphs are keyed by
(batch bucket, width bucket): widths (pages) are bucketed like batch sizes (:func:`buckets_up_to`
of ``max_pages``), each pair captured at its first use (``width_buckets=True``). Strict graphs use
the full width (their kernel reads each sequence's own length) and are all captured at the first
decode step.

``time_replays=True`` records a pair of CUDA events around every replay (:attr:`last_events`): the
GPU time of the captured forward, which the rollout benchmark sets against the step's wall time;
:attr:`last_checks` counts the finiteness checks (isfinite + all, two kernels each) in that graph.

MoE routing (``record_routing``): Python-side records do not happen at replay, so the captured forward
runs inside :func:`rlalign.models.moe.record_routing` and the stacked expert ids [b, sparse layers, k]
are one more static output of the graph; after each replay they hold that step's values.
:attr:`DecodeGraphs.routing` is then the real rows' part (padding rows dropped), valid until the next run.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rlalign.models.batch import ForwardBatch, KVCache
from rlalign.models.moe import record_routing
from rlalign.ops import capturing_graph, flush_deferred_checks, requeue_deferred_checks, static_decode
from rlalign.rollout.errors import RolloutError


def buckets_up_to(max_batch: int) -> list[int]:
    """Batch sizes with a graph: powers of two to 16, then steps of 4 to 32, 8 to 64, 16 to 128, ...
    (above 16 at most a fifth of a replayed batch is padding), always ending with ``max_batch``."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b = b * 2 if b < 16 else b + (1 << (b.bit_length() - 3))
    return sizes + [max_batch]


@dataclasses.dataclass
class HostDecode:
    """One decode step's inputs on the host (n sequences, one token each)."""
    ids: np.ndarray          # int64 [n]
    positions: np.ndarray    # int64 [n]
    table: np.ndarray        # int32 [n, w] page ids (0 past a sequence's pages)
    seq_lens: np.ndarray     # int32 [n] = positions + 1
    slots: np.ndarray        # int64 [n]


class DecodeGraphs:
    """Static buffers for up to ``max_batch`` decode rows and one captured graph per bucket."""

    def __init__(self, model, kv_cache: KVCache, scratch_pages: list[int], max_batch: int, max_pages: int,
                 mode: str = "graphs", width_buckets: bool = False, time_replays: bool = False,
                 record_routing: bool = False):
        if mode not in ("graphs", "padded"):
            raise ValueError(f"DecodeGraphs mode must be 'graphs' or 'padded', got {mode!r}")
        ps = kv_cache.page_size
        if len(scratch_pages) * ps < max_batch:
            raise ValueError(f"{len(scratch_pages)} scratch pages of {ps} slots cannot hold {max_batch} padding rows")
        self.model, self.kv_cache, self.mode = model, kv_cache, mode
        self.max_batch, self.max_pages, self.page_size = max_batch, max_pages, ps
        self.buckets = buckets_up_to(max_batch)
        # widths follow the batch buckets' rule: at most a fifth of a padded width is padding above 16 pages
        self.widths = buckets_up_to(max_pages) if width_buckets else [max_pages]
        self.width_buckets, self.time_replays = width_buckets, time_replays
        self.last_events: tuple | None = None
        self.last_checks = 0      # finiteness verdicts recorded in the graph the last run replayed
        dev = model.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)   # one token each: fixed
        self.block_table = torch.zeros((max_batch, max_pages), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        # padding row j: position j % ps of scratch page j // ps
        j = np.arange(max_batch)
        self._pad_pos = (j % ps).astype(np.int64)
        self._pad_page = np.asarray(scratch_pages, dtype=np.int64)[j // ps]
        self.record_routing = record_routing
        self.routing: torch.Tensor | None = None   # the last run's expert ids [n, sparse layers, k] (record_routing)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, list, torch.Tensor | None]] = {}
        self._pool = None
        self.replays = self.captures = 0

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n rows, or None when n exceeds max_batch (run eagerly)."""
        if n > self.max_batch:
            return None
        return next(b for b in self.buckets if b >= n)

    def check(self, host: HostDecode, num_pages: int) -> None:
        """What the ops would validate, on the host arrays: token ids in the vocabulary, pages and
        slots inside the cache, every context's pages present, one slot per row (a batch the engine
        built passes). Vectorised numpy: it runs before every replay, where the ops' own validators
        (per-sequence Python loops, with device syncs) cannot run."""
        n, w = host.table.shape
        if w > self.max_pages:
            raise RolloutError(f"internal: a decode batch needs {w} pages per sequence, the graphs hold {self.max_pages}")
        need = (host.seq_lens.astype(np.int64) + self.page_size - 1) // self.page_size
        used = np.arange(w) < need[:, None]
        if np.any(need > w) or np.any(used & ((host.table < 0) | (host.table >= num_pages))):
            raise RolloutError("internal: a decode batch's block table points outside the KV cache")
        if n and (host.ids.min() < 0 or host.ids.max() >= self.model.config.vocab_size):
            raise RolloutError("internal: a decode batch has a token id outside the vocabulary")
        if np.any(host.slots < 0) or np.any(host.slots >= num_pages * self.page_size) or \
                np.unique(host.slots).size != n or np.any(host.positions + 1 != host.seq_lens):
            raise RolloutError("internal: a decode batch's slots or positions are inconsistent")

    def width(self, w: int) -> int:
        """The block-table width (pages) the forward of a step needing ``w`` pages runs with."""
        return next(x for x in self.widths if x >= w)

    def run(self, host: HostDecode) -> torch.Tensor:
        """Final hidden rows [n, H] of the n decode rows (valid until the next run)."""
        n = host.ids.shape[0]
        b = self.bucket(n)
        if b is None:
            raise RolloutError(f"internal: a decode batch of {n} rows exceeds the graphs' {self.max_batch}")
        w = self.width(host.table.shape[1])
        if self.mode == "graphs" and not self._graphs and not self.width_buckets:
            self.capture_all()    # fills the buffers with padding batches: before this step's fill
        elif self.mode == "graphs" and (b, w) not in self._graphs:
            self._graphs[(b, w)] = self._capture(b, w)
        self._fill(host, b)
        if self.mode == "padded":
            with static_decode():
                hidden, routing = self._forward(self._batch(b, w))
            self.routing = None if routing is None else routing[:n]
            return hidden[:n]
        graph, hidden, verdicts, routing = self._graphs[(b, w)]
        self.routing = None if routing is None else routing[:n]
        self.last_checks = len(verdicts)
        if self.time_replays:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            self.last_events = (start, end)
        else:
            graph.replay()
        requeue_deferred_checks(verdicts)
        self.replays += 1
        return hidden[:n]

    def capture_all(self) -> None:
        """Capture every bucket at every width, largest first (the shared memory pool is sized by the first)."""
        for b in sorted(self.buckets, reverse=True):
            for w in sorted(self.widths, reverse=True):
                self._graphs[(b, w)] = self._capture(b, w)

    # ---- internals -----------------------------------------------------------------------------

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden rows, expert ids [rows, sparse layers, k] or None without record_routing)."""
        if not self.record_routing:
            return self.model.forward_hidden(batch), None
        with record_routing(keep_logits=False) as record:
            hidden = self.model.forward_hidden(batch)
        return hidden, record.expert_ids()

    def _batch(self, b: int, w: int) -> ForwardBatch:
        return ForwardBatch(input_ids=self.input_ids[:b], positions=self.positions[:b],
                            cu_seqlens=self.cu_seqlens[:b + 1], kv_cache=self.kv_cache,
                            block_table=self.block_table[:b, :w], seq_lens=self.seq_lens[:b],
                            slot_mapping=self.slot_mapping[:b])

    def _fill(self, host: HostDecode, b: int) -> None:
        n, w = host.table.shape
        pad = b - n
        pos = np.concatenate([host.positions, self._pad_pos[:pad]])
        page = self._pad_page[:pad]
        table = np.zeros((b, max(w, 1)), np.int32)
        table[:n, :w] = host.table
        table[n:, 0] = page
        ps = self.page_size
        self.input_ids[:b].copy_(torch.from_numpy(np.concatenate([host.ids, np.zeros(pad, np.int64)])))
        self.positions[:b].copy_(torch.from_numpy(pos))
        self.seq_lens[:b].copy_(torch.from_numpy((pos + 1).astype(np.int32)))
        self.slot_mapping[:b].copy_(torch.from_numpy(np.concatenate([host.slots, page * ps + self._pad_pos[:pad]])))
        self.block_table[:b, :table.shape[1]].copy_(torch.from_numpy(table))

    def _capture(self, b: int, w: int):
        """Warm up (compiles kernels, fills the ops' caches) on a side stream, then capture."""
        pad_only = HostDecode(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 1), np.int32),
                              np.zeros(0, np.int32), np.zeros(0, np.int64))
        self._fill(pad_only, b)
        batch = self._batch(b, w)
        stream = torch.cuda.Stream(device=self.input_ids.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), static_decode():
            self.model.forward_hidden(batch)
        torch.cuda.current_stream().wait_stream(stream)
        flush_deferred_checks()
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with capturing_graph(max_query_len=1) as verdicts, torch.cuda.graph(graph, pool=self._pool):
            hidden, routing = self._forward(batch)
        self.captures += 1
        return graph, hidden, list(verdicts), routing
