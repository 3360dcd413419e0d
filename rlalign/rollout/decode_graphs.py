"""Decode steps as CUDA graph replays: one captured forward per batch-size bucket.

A decode step (every running sequence feeds one token) is the same ~15 launches per layer every
step; issued from Python they cost far more host time than the GPU needs for them. So the model's
``forward_hidden`` is captured once per bucket size b (1, 2, 4, 8, 16, 20, 24, 28, 32, 40, 48, ...
up to ``max_batch``; all of them at the first decode step) on static input buffers and replayed;
the sampler and the logprob op are captured with it (below), in both profiles.

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

The native profile (the benchmarks' baseline) runs the same machinery: the same buckets, the sampler
in the graph, overlapped scheduling. On CUDA its paged attention is the Triton paged kernel, which reads
each sequence's length on the device, so its graphs are the strict ones' (full width, all captured at the
first decode step). Where native gathers K/V for SDPA instead (CPU, or a dtype the kernel does not take:
:func:`rlalign.ops.attention.native_paged_kernel_unavailable`), under :func:`rlalign.ops.static_decode` it
attends over the whole width of the block table it is given, masked by ``seq_lens`` on the device; so that
width follows the step, those graphs are keyed by (batch bucket, width bucket): widths (pages) are bucketed
like batch sizes (:func:`buckets_up_to` of ``max_pages``), each pair captured at its first use
(``width_buckets=True``).

``time_replays=True`` records a pair of CUDA events around every replay (:attr:`last_events`): the
GPU time of the captured forward, which the rollout benchmark sets against the step's wall time;
:attr:`last_checks` counts the finiteness checks (isfinite + all, two kernels each) in that graph.

MoE routing (``record_routing``): Python-side records do not happen at replay, so the captured forward
runs inside :func:`rlalign.models.moe.record_routing` and the stacked expert ids [b, sparse layers, k]
are one more static output of the graph; after each replay they hold that step's values.
:attr:`DecodeGraphs.routing` is then the real rows' part (padding rows dropped), valid until the next run.

Sampling inside the graph (``sampler_weight``: the LM head): the captured body is the forward, then
``ops.sample_and_score`` of every row -- the very op the eager engine calls, in its static form (no host
read, no data-dependent shape; ``rlalign.ops._checks.static_shapes``), which gives the same bits in the
strict profile (the native static form draws its noise from the device's default generator instead of the
rows' seeds: ``ops.sample``). Its per-row inputs (seeds, positions, temperature, top_k, top_p) are static buffers filled before
each replay (:class:`HostSampler`); the sampled tokens and logprobs are static outputs. Two host values
the op cannot read inside a graph specialise it: the rows' one logprob temperature and whether any row
filters with top-k/top-p (a full sort of every row; only graphs of filtering batches pay it), so graphs
are keyed by (batch bucket, width, (score temperature, filters)); the first such variant is captured for
every bucket at the first decode step, later ones per bucket at first use. A step whose rows cannot be
sampled by the graph (a row that does not sample, forked siblings, several logprob temperatures) runs
the same graph with harmless sampler inputs and is sampled eagerly from its hidden rows. In a sampling
graph every finiteness verdict (the forward's and the sampler's) is stacked into one static bool output
(:attr:`DecodeGraphs.verdicts`), which the engine copies to the host with the tokens and checks there.

The input ids may come from the device (``prev_tokens`` of :meth:`DecodeGraphs.run`): the previous step's
sampled tokens, gathered into the static ``input_ids`` by a device copy -- overlapped scheduling
(docs/rollout.md). The static inputs are filled from pinned staging buffers without waiting for the
device (:class:`rlalign.rollout.readback.Uploader`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rlalign import ops
from rlalign.models.batch import ForwardBatch, KVCache
from rlalign.models.moe import record_routing
from rlalign.ops import capturing_graph, flush_deferred_checks, requeue_deferred_checks, static_decode
from rlalign.rollout.errors import RolloutError
from rlalign.rollout.readback import Uploader


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


@dataclasses.dataclass
class HostSampler:
    """The sampler's inputs of a decode step whose every row samples (n rows, the batch's order)."""
    seeds: np.ndarray            # int64 [n]
    positions: np.ndarray        # int64 [n]: the position each new token takes
    temperature: np.ndarray      # fp32 [n]
    top_k: np.ndarray            # int64 [n]
    top_p: np.ndarray            # fp32 [n]
    score_temperature: float     # every row's logprob temperature (ops.logprob_temperature of its T)
    filtered: bool               # whether a row may filter (top-k / top-p): picks the graph variant

    @property
    def variant(self) -> tuple[float, bool]:
        return self.score_temperature, self.filtered


@dataclasses.dataclass
class _Captured:
    """One graph (None in "padded" mode) and its static outputs."""
    graph: object
    hidden: torch.Tensor
    routing: torch.Tensor | None
    tokens: torch.Tensor | None
    logprobs: torch.Tensor | None
    verdicts: torch.Tensor | None      # bool [m] (sampling graphs), None when there are none
    messages: list                     # (op, message) per verdict
    raw_verdicts: list                 # as recorded (requeued when the step is sampled eagerly)
    forward_checks: int = 0            # how many of them the forward recorded (finiteness checks)


class DecodeGraphs:
    """Static buffers for up to ``max_batch`` decode rows and one captured graph per bucket."""

    def __init__(self, model, kv_cache: KVCache, scratch_pages: list[int], max_batch: int, max_pages: int,
                 mode: str = "graphs", width_buckets: bool = False, time_replays: bool = False,
                 record_routing: bool = False, sampler_weight: torch.Tensor | None = None):
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
        # sampling inside the graph (module docstring): static per-row inputs, and the last run's outputs
        self.sampler_weight = sampler_weight
        self.seeds = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.sample_positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.temperature = torch.ones(max_batch, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(max_batch, dtype=torch.float32, device=dev)
        self.prev_rows = torch.zeros(max_batch, dtype=torch.int64, device=dev)   # rows of prev_tokens (run)
        self.tokens: torch.Tensor | None = None      # the last run's sampled tokens [n] (None: sample eagerly)
        self.logprobs: torch.Tensor | None = None    # ... and their logprobs [n]
        self.verdicts: torch.Tensor | None = None    # ... and its stacked verdicts, with verdict_messages
        self.verdict_messages: list = []
        self._variant = (1.0, False)                 # the sampler variant of the last sampled run
        self._graphs: dict[tuple, _Captured] = {}
        self._pool = None
        self._upload = Uploader(dev)
        self.replays = self.captures = 0

    @property
    def samples(self) -> bool:
        """Whether the graphs sample (the sampler is captured with the forward; the engine always passes it)."""
        return self.sampler_weight is not None

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n rows, or None when n exceeds max_batch (run eagerly)."""
        if n > self.max_batch:
            return None
        return next(b for b in self.buckets if b >= n)

    def check(self, host: HostDecode, num_pages: int) -> None:
        """What the ops would validate, on the host arrays: token ids in the vocabulary, pages and
        slots inside the cache, every context's pages present, one slot per row (a batch the engine
        built passes). Vectorised numpy: it runs before every replay, where the ops' own validators
        (per-sequence Python loops, with device syncs) cannot run. (Array methods, not np.any / np.unique:
        numpy's function dispatch costs more than the test on a few hundred rows.)"""
        n, w = host.table.shape
        if w > self.max_pages:
            raise RolloutError(f"internal: a decode batch needs {w} pages per sequence, the graphs hold {self.max_pages}")
        need = (host.seq_lens.astype(np.int64) + self.page_size - 1) // self.page_size
        used = np.arange(w) < need[:, None]
        if (need > w).any() or (used & ((host.table < 0) | (host.table >= num_pages))).any():
            raise RolloutError("internal: a decode batch's block table points outside the KV cache")
        if n and (host.ids.min() < 0 or host.ids.max() >= self.model.config.vocab_size):
            raise RolloutError("internal: a decode batch has a token id outside the vocabulary")
        ordered = np.sort(host.slots)
        if n and (ordered[0] < 0 or ordered[-1] >= num_pages * self.page_size or (ordered[1:] == ordered[:-1]).any()
                  or (host.positions + 1 != host.seq_lens).any()):
            raise RolloutError("internal: a decode batch's slots or positions are inconsistent")

    def width(self, w: int) -> int:
        """The block-table width (pages) the forward of a step needing ``w`` pages runs with."""
        return next(x for x in self.widths if x >= w)

    def run(self, host: HostDecode, sampler: HostSampler | None = None,
            prev_tokens: tuple[torch.Tensor, np.ndarray] | None = None,
            variant_hint: tuple[float, bool] | None = None) -> torch.Tensor:
        """Final hidden rows [n, H] of the n decode rows (valid until the next run). With ``sampler`` (a
        sampling engine, every row samples) the graph also samples them: :attr:`tokens`, :attr:`logprobs`,
        :attr:`verdicts` hold the results (valid until the next run; the caller checks the verdicts),
        else they are None and the step's finiteness verdicts are queued for the eager sampler's check.
        ``prev_tokens`` = (tokens of the previous run on the device, int64 row indices [n] on the host):
        the input ids are ``tokens[rows]``, gathered on the device (``host.ids`` is then ignored).
        ``variant_hint``: without ``sampler``, the sampler variant to replay (the one the coming sampled
        steps will use, so that the first capture is theirs; default: the last one used)."""
        n = host.ids.shape[0]
        b = self.bucket(n)
        if b is None:
            raise RolloutError(f"internal: a decode batch of {n} rows exceeds the graphs' {self.max_batch}")
        if sampler is not None and not self.samples:
            raise RolloutError("internal: a sampler given to decode graphs that do not sample")
        w = self.width(host.table.shape[1])
        variant = None
        if self.samples:
            variant = self._variant = sampler.variant if sampler is not None else (variant_hint or self._variant)
        key = (b, w, variant)
        if self.mode == "graphs" and not self._graphs and not self.width_buckets:
            self.capture_all(variant)    # fills the buffers with padding batches: before this step's fill
        elif self.mode == "graphs" and key not in self._graphs:
            self._graphs[key] = self._capture(b, w, variant)
        self._fill(host, b, sampler, variant, None if prev_tokens is None else prev_tokens[1])
        if prev_tokens is not None:   # queued after the fill's copies: overwrites its placeholder ids
            self.input_ids[:n].copy_(prev_tokens[0].index_select(0, self.prev_rows[:n]))
        use_sampler = sampler is not None
        # padded (eager) runs skip the sampler when the step samples eagerly: nothing would read it
        out = self._padded_run(b, w, variant if use_sampler else None) if self.mode == "padded" else self._replay(key)
        self.routing = None if out.routing is None else out.routing[:n]
        self.tokens = out.tokens[:n] if use_sampler else None
        self.logprobs = out.logprobs[:n] if use_sampler else None
        self.verdicts = out.verdicts if use_sampler else None
        self.verdict_messages = out.messages if use_sampler else []
        if not use_sampler and self.mode == "graphs":
            requeue_deferred_checks(out.raw_verdicts)   # checked by the eager sampler's logprob op
        return out.hidden[:n]

    def _replay(self, key) -> _Captured:
        captured = self._graphs[key]
        self.last_checks = captured.forward_checks
        if self.time_replays:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            captured.graph.replay()
            end.record()
            self.last_events = (start, end)
        else:
            captured.graph.replay()
        self.replays += 1
        return captured

    def _padded_run(self, b: int, w: int, variant) -> _Captured:
        """The body of a graph, eagerly (mode "padded"): the same static batch and sampler form."""
        with static_decode():
            hidden, routing, tokens, logprobs = self._body(self._batch(b, w), b, variant)
        flush_deferred_checks()   # eager: on a GPU the queued verdicts are checked now (on the CPU: already)
        return _Captured(None, hidden, routing, tokens, logprobs, None, [], [])

    def capture_all(self, variant=None) -> None:
        """Capture every bucket at every width (sampler ``variant``), largest first (the shared memory
        pool is sized by the first)."""
        for b in sorted(self.buckets, reverse=True):
            for w in sorted(self.widths, reverse=True):
                self._graphs[(b, w, variant)] = self._capture(b, w, variant)

    # ---- internals -----------------------------------------------------------------------------

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden rows, expert ids [rows, sparse layers, k] or None without record_routing)."""
        if not self.record_routing:
            return self.model.forward_hidden(batch), None
        with record_routing(keep_logits=False) as record:
            hidden = self.model.forward_hidden(batch)
        return hidden, record.expert_ids()

    def _body(self, batch: ForwardBatch, b: int, variant):
        """What a graph holds: the forward, then (a sampling variant) ops.sample_and_score of every row.
        -> (hidden, expert ids or None, tokens or None, logprobs or None)."""
        hidden, routing = self._forward(batch)
        return (hidden, routing, *self._sample_rows(hidden, b, variant))

    def _sample_rows(self, hidden: torch.Tensor, b: int, variant):
        """(tokens, logprobs) of the b rows from the static sampler inputs, or (None, None) (no variant)."""
        if variant is None:
            return None, None
        return ops.sample_and_score(
            hidden, self.sampler_weight, seeds=self.seeds[:b], positions=self.sample_positions[:b],
            temperature=self.temperature[:b], top_k=self.top_k[:b], top_p=self.top_p[:b],
            score_temperature=variant[0])

    def _batch(self, b: int, w: int) -> ForwardBatch:
        return ForwardBatch(input_ids=self.input_ids[:b], positions=self.positions[:b],
                            cu_seqlens=self.cu_seqlens[:b + 1], kv_cache=self.kv_cache,
                            block_table=self.block_table[:b, :w], seq_lens=self.seq_lens[:b],
                            slot_mapping=self.slot_mapping[:b])

    def _fill(self, host: HostDecode, b: int, sampler: HostSampler | None = None, variant=None,
              prev_rows: np.ndarray | None = None) -> None:
        """The static inputs of a b-row run: the n real rows, then padding rows (and, for a sampling
        graph, the sampler's rows: ``sampler``'s, or harmless ones -- seed 0, the variant's score
        temperature, no filtering -- for padding rows and eagerly sampled steps)."""
        n, w = host.table.shape
        pad = b - n
        pos = np.concatenate([host.positions, self._pad_pos[:pad]])
        page = self._pad_page[:pad]
        table = np.zeros((b, max(w, 1)), np.int32)
        table[:n, :w] = host.table
        table[n:, 0] = page
        ps = self.page_size
        pairs = [(self.input_ids[:b], np.concatenate([host.ids, np.zeros(pad, np.int64)])),
                 (self.positions[:b], pos), (self.seq_lens[:b], (pos + 1).astype(np.int32)),
                 (self.slot_mapping[:b], np.concatenate([host.slots, page * ps + self._pad_pos[:pad]])),
                 (self.block_table[:b, :table.shape[1]], table)]
        if variant is not None:
            pairs += self._sampler_rows(b, sampler, variant)
        if prev_rows is not None:
            pairs.append((self.prev_rows[:n], prev_rows))
        self._upload.copy(pairs)

    def _sampler_rows(self, b: int, sampler: HostSampler | None, variant) -> list:
        real = 0 if sampler is None else sampler.seeds.shape[0]
        pad = b - real

        def rows(field: str, fill, dtype):
            head = np.zeros(0, dtype) if sampler is None else np.asarray(getattr(sampler, field), dtype)
            return np.concatenate([head, np.full(pad, fill, dtype)])
        return [(self.seeds[:b], rows("seeds", 0, np.int64)),
                (self.sample_positions[:b], rows("positions", 0, np.int64)),
                (self.temperature[:b], rows("temperature", variant[0], np.float32)),
                (self.top_k[:b], rows("top_k", 0, np.int64)),
                (self.top_p[:b], rows("top_p", 1.0, np.float32))]

    def _capture(self, b: int, w: int, variant=None) -> _Captured:
        """Warm up (compiles kernels, fills the ops' caches) on a side stream, then capture."""
        pad_only = HostDecode(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 1), np.int32),
                              np.zeros(0, np.int32), np.zeros(0, np.int64))
        self._fill(pad_only, b, None, variant)
        if variant is not None and variant[1]:
            self.top_k[:b].fill_(1)   # warm up the filtering path too (compiled before the capture)
        batch = self._batch(b, w)
        stream = torch.cuda.Stream(device=self.input_ids.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), static_decode():
            self._body(batch, b, variant)
        torch.cuda.current_stream().wait_stream(stream)
        flush_deferred_checks()
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        hints = dict(max_query_len=1, sample_filtered=bool(variant and variant[1]))
        with capturing_graph(**hints) as verdicts, torch.cuda.graph(graph, pool=self._pool):
            hidden, routing = self._forward(batch)
            forward_checks = len(verdicts)
            tokens, logprobs = self._sample_rows(hidden, b, variant)
            stacked = torch.stack([ok for _, _, ok in verdicts]) if variant is not None and verdicts else None
        self.captures += 1
        return _Captured(graph, hidden, routing, tokens, logprobs, stacked,
                         [(op, message) for op, message, _ in verdicts], list(verdicts), forward_checks)
