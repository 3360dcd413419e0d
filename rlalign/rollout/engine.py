"""The rollout engine: continuous batching over a paged KV cache, strict sampling, weight updates.

Per step: the scheduler picks chunks (prefill chunks, decode tokens, recomputes); page copies for
copy-on-write are done; ONE :class:`ForwardBatch` describes every chunk; ONE model forward gives
the hidden rows (a decode-only step on a GPU: a CUDA graph replay of that forward on a padded batch,
:mod:`rlalign.rollout.decode_graphs`); the rows of the sequences that reached their last token are
sampled together by :func:`ops.sample_and_score` (the one owner of "sample a token, score it with the
trainer's op"; exact formulas there; in a decode graph the same op is captured with the
forward):

    token, logprob = ops.sample_and_score(h, W, seeds=s, positions=p, temperature=T, top_k, top_p)

with h the sequence's last hidden row, s its per-sample seed (:func:`ops.derive_seed` of the
request's seed, prompt key and sample index), p the absolute position the token will occupy.
``logprob`` is the same op on the same hidden row as the trainer's packed forward
(``model.logprobs(ForwardBatch.packed(...), targets, temperature=ops.logprob_temperature(T))``), and
in the strict profile a row does not depend on the batch, the chunking or the page layout: the
engine's logprobs equal the trainer's bit for bit, and the tokens do not depend on any engine setting.

A step is launched (forward and sampling queued, results on their way to the host) and then completed
(the one wait for the device, tokens appended, stops checked). The per-sequence state a step reads and
writes lives in the scheduler's :class:`rlalign.rollout.slots.SlotTable` (one row per running sequence), so
a decode step's host work is array operations over its rows plus Python for the sequences that change
(a page fills, a sample may stop, a leader forks); ``step()`` still returns one StepOutput per token.
With ``RolloutConfig.overlap`` the next decode step is launched between the two halves, its input ids the
running step's tokens copied on the device (:meth:`RolloutEngine._launch_continuation`; docs/rollout.md,
"Overlapped scheduling"); rows do not depend on each other, so this changes no bit.

With ``RolloutConfig.record_routing`` (MoE models) the forward also yields each row's expert ids
[rows, sparse layers, k]; they are stored by KV slot once per step (:mod:`rlalign.rollout.routing`) and a
finished sample's rows are gathered into ``Completion.routing``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import itertools
import time
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from rlalign import ops
from rlalign.contract.profiles import use_profile
from rlalign.models.batch import ForwardBatch, KVCache
from rlalign.models.generate import prompt_key
from rlalign.models.moe import StackedExperts, record_routing, sparse_layer_indices
from rlalign.models.sizes import kv_bytes_per_token
from rlalign.ops.attention import native_paged_kernel_unavailable
from rlalign.ops.moe import native_grouped_unavailable
from rlalign.ops.sample import derive_seed
from rlalign.rollout.block_manager import BlockManager, pages_for
from rlalign.rollout.config import DEFAULT_CPU_KV_CACHE_BYTES, RolloutConfig, SamplingParams
from rlalign.rollout.decode_graphs import DecodeGraphs, HostDecode, HostSampler
from rlalign.rollout.errors import (KVCacheTooSmallError, RequestError, RolloutConfigError, RolloutError,
                                    WeightsUpdateError)
from rlalign.rollout.readback import Readback, pack_results, unpack_results
from rlalign.rollout.routing import RoutingStore
from rlalign.rollout.scheduler import Scheduler, SchedulerOutput
from rlalign.rollout.sequence import Completion, Request, Sequence, SeqStatus, StepOutput

STOP_STRING_SLACK_TOKENS = 8


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off inside the block (as it was before, after it).

    A full collection walks every tracked object of the process: with torch, transformers and rlalign imported
    ~2 x 10^5 of them, 0.19 s on the 2-core CPU machine (session 14). Inside a rollout it lands on one decode
    step, which then outlasts the device's work and shows as host time on the critical path. Reference counting still frees everything that is not in a
    cycle; the cycles made during the block are collected after it. :meth:`RolloutEngine.generate` runs its
    step loop inside this; a caller driving :meth:`RolloutEngine.step` itself can do the same."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclasses.dataclass(frozen=True)
class _SharedSettings:
    """The distinct values the requests in flight hold (one element each in the usual case)."""
    weights_versions: set[int]
    sampling: set[tuple[float, int, float]]      # (temperature, top_k, top_p)
    limits: set[tuple[int, bool]]                # (max_new_tokens, has stop strings)
    score_temperatures: set[float]               # logprob temperatures (a decode graph samples with one)
    filtered: bool                               # whether a request filters (top-k < V or top-p < 1, T > 0)


@dataclasses.dataclass
class _Launched:
    """A step whose forward and sampling are queued on the device, its results not yet read.

    ``seqs`` / ``slots`` / ``positions``: the sampling sequences (row order of the results), their slots in
    the scheduler's SlotTable and the position each new token takes. A step launched as a continuation
    (overlapped scheduling) is planned before its input tokens are known: its chunks are marked computed
    when its predecessor completes (``marked``). Rows of sequences that finish or are aborted while it is
    in flight are ``dead`` (bool per row; dropped) and their pages are freed once it has run
    (``release``): it writes their K/V slots. (No slot is handed to another sequence while a step is in
    flight: only :meth:`Scheduler.schedule` admits, and it runs with nothing in flight.)"""
    plan: SchedulerOutput
    seqs: list[Sequence]
    slots: np.ndarray
    positions: np.ndarray
    results: Readback | None                     # pack_results of the tokens and logprobs (+ verdicts)
    verdict_messages: list
    routing: tuple[np.ndarray, Readback] | None  # (slots, expert ids) with record_routing
    forward_info: dict                           # engine.last_forward once completed
    device_tokens: torch.Tensor | None = None    # graph-sampled: the tokens on the device (a continuation's ids)
    events: tuple | None = None                  # CUDA events around the graph replay (time_replays)
    seconds: float = 0.0
    marked: bool = True
    dead: np.ndarray | None = None
    release: list[Sequence] = dataclasses.field(default_factory=list)

    def mark_dead(self, slots: list[int]) -> None:
        """The rows of the sequences in ``slots`` (finished or aborted) are dropped."""
        hit = _member(self.slots, slots)
        self.dead = hit if self.dead is None else self.dead | hit

    @property
    def all_dead(self) -> bool:
        return self.dead is not None and bool(self.dead.all())


class RolloutEngine:
    """``RolloutEngine(model, config, tokenizer=None)``; ``model`` is a :class:`rlalign.models.CausalLM`.

    Batch API: :meth:`generate`. Step-wise API: :meth:`add_request`, :meth:`step`,
    :meth:`has_unfinished`, :meth:`abort`. Weights: :meth:`update_weights`, :attr:`weights_version`.
    """

    def __init__(self, model, config: RolloutConfig | None = None, tokenizer=None, *, weights_version: int = 0):
        self.model = model
        self.config = config or RolloutConfig()
        self.tokenizer = tokenizer
        self.weights_version = weights_version
        self.device = model.device
        mc = model.config
        self.max_model_len = self.config.max_model_len or mc.max_position_embeddings
        self.page_size = self.config.page_size
        num_pages = self._num_pages()
        graph_mode = self._decode_graph_mode()
        graph_batch = min(self.config.decode_graph_max_batch, self.config.max_num_seqs)
        scratch = pages_for(graph_batch, self.page_size) if graph_mode else 0
        # scratch pages (for the graphs' padding rows) lie past the block manager's pages
        self.kv_cache = KVCache.for_model(mc, num_pages + scratch, self.page_size, model.dtype, self.device)
        self.blocks = BlockManager(num_pages, self.page_size, self.config.enable_prefix_caching)
        self.routing = self._routing_store(num_pages)
        # both profiles sample inside the graphs (the native sampler's static form reads nothing on the host)
        self.decode_graphs = None if not graph_mode else DecodeGraphs(
            model, self.kv_cache, list(range(num_pages, num_pages + scratch)), graph_batch,
            pages_for(self.max_model_len, self.page_size), mode=graph_mode,
            width_buckets=self._native_gathers(), record_routing=self.routing is not None,
            sampler_weight=model.lm_head_weight)
        self.overlap = self._overlap_mode(graph_mode)
        self._inflight: _Launched | None = None      # the step queued on the device, not yet read (overlap)
        self.last_step_events: tuple | None = None   # CUDA events around the completed step's graph replay
        self.last_step_wait_seconds = 0.0            # how long completing the last step waited for the device
        self.scheduler = Scheduler(self.config, self.blocks)
        self.eos_token_ids = frozenset(mc.eos_token_ids) | frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._requests: dict[str, Request] = {}
        self._shared: _SharedSettings | None = None   # of the requests in flight; None: recompute
        self._settings_in_flight: collections.Counter = collections.Counter()   # _request_settings -> requests
        self._request_counter = itertools.count()
        self._weights_broken = False
        self.counters = dict(steps=0, forward_tokens=0, sampled_tokens=0, compute_seconds=0.0, graph_steps=0,
                             overlapped_steps=0)
        self.last_forward: dict | None = None

    def _decode_graph_mode(self) -> str | None:
        """"graphs", "padded" or None (eager), from config.decode_graphs (see RolloutConfig). Both
        profiles replay decode graphs on a GPU: native is the baseline of the same machinery."""
        setting = self.config.decode_graphs
        gpu = self.device.type == "cuda"
        if setting == "on" and not gpu:
            raise RolloutConfigError(f"decode_graphs='on' needs a CUDA model (got device {self.device}); "
                                     "use 'auto' or 'off'")
        if setting == "padded":
            return "padded"
        eager_experts = gpu and self.config.profile == "native" and self._native_experts_read_host()
        if eager_experts:
            # the native MoE experts fall back to the per-expert loop, which reads the experts' loads on the
            # host: not capturable (strict MoE is: its grouped GEMMs need no host read)
            if setting == "on":
                raise RolloutConfigError(f"decode_graphs='on' cannot capture the native profile's MoE experts here "
                                         f"({eager_experts}: a per-expert cuBLAS loop that reads expert loads on "
                                         "the host); use 'auto' (native MoE decodes eagerly) or the strict profile")
            return None
        return "graphs" if setting == "on" or (setting == "auto" and gpu) else None

    def _native_experts_read_host(self) -> str | None:
        """Why a MoE model's native experts would read their loads on the host (the per-expert loop), None when
        every sparse layer's experts run as grouped GEMMs (``ops.moe.native_grouped_unavailable``) or the model
        is dense."""
        if self.model.config.ffn_kind != "moe":
            return None
        stacked = [m for m in self.model.modules() if isinstance(m, StackedExperts)]
        if len(stacked) != len(sparse_layer_indices(self.model.config)):
            return "experts other than one stacked module per sparse layer (e.g. tensor-parallel shards)"
        for m in stacked:
            rows = torch.empty(0, m.gate_proj.shape[2], dtype=m.gate_proj.dtype, device=self.device)
            with torch.no_grad():
                reason = native_grouped_unavailable(rows, m.gate_proj, m.up_proj, m.down_proj)
            if reason is not None:
                return reason
        return None

    def _native_gathers(self) -> bool:
        """Whether this is a native engine whose paged attention gathers K/V for SDPA (CPU, or a dtype the paged
        kernel does not take): its static decode form attends over the whole block-table width, so its graphs
        are keyed by width buckets too. The paged kernel reads each sequence's own length on the device (as
        strict does): full-width graphs, all captured at the first decode step."""
        if self.config.profile != "native":
            return False
        probe = torch.empty(0, 1, 2, dtype=self.model.dtype, device=self.device)
        return native_paged_kernel_unavailable(probe) is not None

    def _overlap_mode(self, graph_mode: str | None) -> bool:
        """Whether steps overlap (config.overlap): it needs decode steps sampled inside the graphs."""
        setting = self.config.overlap
        sampling_graphs = self.decode_graphs is not None and self.decode_graphs.samples
        if setting == "on" and not sampling_graphs:
            raise RolloutConfigError(
                f"overlap='on' needs decode steps sampled inside the decode graphs (decode_graphs 'auto'/'on' "
                f"on CUDA, or 'padded'; not a native MoE model whose experts decode eagerly); this engine has profile "
                f"{self.config.profile!r}, decode_graphs {self.config.decode_graphs!r} on {self.device}: "
                "use overlap='auto' or 'off'")
        if setting == "auto":
            return sampling_graphs and graph_mode == "graphs"
        return setting == "on"

    def _routing_store(self, num_pages: int) -> RoutingStore | None:
        """The routing record (config.record_routing), refused for a model without sparse layers."""
        if not self.config.record_routing:
            return None
        mc = self.model.config
        layers = sparse_layer_indices(mc)
        if not layers:
            raise RolloutConfigError("RolloutConfig.record_routing=True needs a mixture-of-experts model, but this "
                                     f"model ({mc.family}, ffn_kind={mc.ffn_kind!r}) has no sparse layers; "
                                     "leave record_routing off")
        opts = mc.ffn_options
        return RoutingStore(num_pages, self.page_size, len(layers), int(opts["num_experts_per_tok"]),
                            int(opts["num_experts"]))

    # ---- KV cache size -------------------------------------------------------------------------

    @property
    def bytes_per_page(self) -> int:
        elem = torch.empty((), dtype=self.model.dtype).element_size()
        return self.page_size * kv_bytes_per_token(self.model.config, elem)

    def _num_pages(self) -> int:
        """config.num_pages, else the byte budget (kv_cache_bytes; default 1 GiB on the CPU,
        gpu_memory_fraction of the free GPU memory) over bytes_per_page, capped at what max_num_seqs
        sequences of max_model_len tokens can use."""
        cfg = self.config
        if cfg.num_pages is not None:
            return cfg.num_pages
        if cfg.kv_cache_bytes is not None:
            budget = cfg.kv_cache_bytes
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cfg.gpu_memory_fraction)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        pages = min(budget // self.bytes_per_page, cfg.max_num_seqs * pages_for(self.max_model_len, self.page_size))
        if pages < 1:
            raise KVCacheTooSmallError(f"a KV budget of {budget} bytes holds no page of {self.page_size} tokens "
                                       f"({self.bytes_per_page} bytes each); raise kv_cache_bytes")
        return int(pages)

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: list[int] | str, sampling: SamplingParams | None = None, *,
                    request_id: str | None = None, prompt_index: int | None = None) -> str:
        """Queue ``sampling.n`` samples of ``prompt`` (token ids, or text with a tokenizer); returns the request id.

        ``prompt_index`` labels the completions and, with ``seed_by="index"``, keys their seeds
        (default: the engine's running request count; pass it for reproducible seeds).
        """
        sampling = sampling or SamplingParams()
        if self._weights_broken:
            raise WeightsUpdateError("a previous update_weights failed half-way, so the model holds a mix of old and "
                                     "new tensors; call update_weights again with a complete set of weights")
        ids, text = self._encode(prompt)
        self._check_request(ids, sampling)
        counter = next(self._request_counter)
        request_id = str(counter) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in flight")
        prompt_index = counter if prompt_index is None else int(prompt_index)
        request = Request(request_id, prompt_index, ids, text, sampling, self.weights_version,
                          frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_token_ids))
        key = prompt_index if sampling.seed_by == "index" else _prompt_key(ids)
        request.seqs = [Sequence(request, j, derive_seed(sampling.seed, key, j), ids) for j in range(sampling.n)]
        self._requests[request_id] = request
        self._count_settings(request, +1)
        if self.config.share_prefix and sampling.n > 1:
            request.pending_forks = request.seqs[1:]
            for seq in request.pending_forks:
                seq.status = SeqStatus.FORK_PENDING
            self.scheduler.add(request.seqs[0])
        else:
            for seq in request.seqs:
                self.scheduler.add(seq)
        return request_id

    def _encode(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompts need a tokenizer: RolloutEngine(model, config, tokenizer=...) "
                                   "or pass token id lists")
            return list(self.tokenizer.encode(prompt)), prompt
        try:
            return [int(t) for t in prompt], None
        except (TypeError, ValueError):
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}") from None

    def _check_request(self, ids: list[int], sampling: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        if not ids:
            raise RequestError("the prompt has no tokens")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                               "to generate (raise RolloutConfig.max_model_len or shorten the prompt)")
        if sampling.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer (RolloutEngine(..., tokenizer=...)); "
                               "use stop_token_ids otherwise")
        longest = min(len(ids) + sampling.max_new_tokens, self.max_model_len) - 1  # the last token is never fed
        needed = pages_for(max(longest, len(ids)), self.page_size)
        if needed > self.blocks.num_pages:
            raise KVCacheTooSmallError(
                f"one sequence of up to {longest} cached tokens needs {needed} pages of {self.page_size} tokens but "
                f"the KV cache has {self.blocks.num_pages} ({self.blocks.num_pages * self.bytes_per_page} bytes); "
                "raise RolloutConfig.kv_cache_bytes / num_pages or lower max_new_tokens")

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def abort(self, request_id: str) -> list[StepOutput]:
        """Stop a request now; its unfinished samples end with finish_reason "abort" (returned)."""
        request = self._requests.get(str(request_id))
        if request is None:
            raise RequestError(f"unknown request id {request_id!r} (finished, aborted or never added)")
        open_seqs = [s for s in request.seqs if s.status is not SeqStatus.FINISHED]
        request.pending_forks = []
        for seq in open_seqs:
            seq.finish_reason = "abort"
        self._finish(open_seqs)
        outputs = [self._finished_output(seq, None, None) for seq in open_seqs]
        self._drain_if_dead()
        return outputs

    def abort_all(self) -> list[StepOutput]:
        return [out for rid in list(self._requests) for out in self.abort(rid)]

    # ---- one step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Run one scheduling step (one forward); returns a StepOutput per token sampled (with the
        Completion when a sample ends)."""
        return self._step(emit_unfinished=True)

    def _step(self, emit_unfinished: bool) -> list[StepOutput]:
        """One step; ``emit_unfinished=False`` returns only the finished samples' outputs (generate()
        needs no per-token output: that saves one object per running sequence per step).

        Completes one step: the one in flight (overlap), else a newly scheduled one. Before reading its
        results back, the next decode step is launched when it can be planned without them
        (:meth:`_launch_continuation`); otherwise the pipeline drains and the next call runs serially."""
        if self._inflight is None and not self._requests:
            return []
        launched, self._inflight = self._inflight, None
        if launched is None:
            launched = self._launch_scheduled()
        try:
            self._inflight = self._launch_continuation(launched)
            outputs = self._complete(launched, emit_unfinished)
        except BaseException:
            self._abandon(launched)   # e.g. a failed verdict: abort_all() then ends its sequences
            raise
        self._drain_if_dead()
        return outputs

    # ---- launching a step (nothing read back from the device) ------------------------------------

    def _launch_scheduled(self) -> _Launched:
        """Schedule a step and queue its forward and sampling; a decode step of sampling rows only is one
        graph replay that also samples (no host read), any other step samples eagerly."""
        plan = self.scheduler.schedule()
        if not plan.seqs:
            raise RolloutError("internal: the scheduler found nothing to run with requests in flight")
        t0 = time.perf_counter()
        with use_profile(self.config.profile):
            self._check_weights_version()
            self._copy_pages(plan.copies)
            ids, positions, cu, table, seq_lens, slots = self._host_arrays(plan)
            info = dict(decode=bool(cu[-1] == len(plan.seqs)), rows=len(plan.seqs),
                        context_tokens=int(seq_lens.sum()))
            sampler = self._graph_sampler(plan, cu, seq_lens)
            if sampler is not None:
                launched = self._launch_graph(plan, HostDecode(ids, positions, table, seq_lens, slots), sampler,
                                              info)
                self.scheduler.mark_computed(plan)
            else:
                replays = self.decode_graphs.replays if self.decode_graphs is not None else 0
                hidden, routing = self._forward(plan, ids, positions, cu, table, seq_lens, slots)
                self.scheduler.mark_computed(plan)
                rows, sample_positions, seqs, seq_slots = self._sampling_rows(plan, cu, seq_lens)
                results = self._sample(hidden, rows, sample_positions, seq_slots) if seqs else None
                launched = _Launched(plan, seqs, seq_slots, sample_positions, results, [], routing, info,
                                     events=self._replay_events(replays))
        launched.seconds = time.perf_counter() - t0
        return launched

    def _launch_continuation(self, prev: _Launched) -> _Launched | None:
        """Overlapped scheduling: launch the decode step after ``prev`` (in flight, graph-sampled) before
        reading ``prev``'s tokens: the same live sequences, one token each, whose input ids are ``prev``'s
        sampled tokens gathered on the device. None (nothing changed) when the next step is anything else:
        an admission, preemption or a page shortage, copy-on-write, several logprob
        temperatures in flight -- those steps run serially once ``prev`` is read. (A running sequence never
        has forks pending here: a leader forks at the end of its prompt, which is not a decode step.)"""
        if not self.overlap or prev.device_tokens is None or len(self._shared_settings().score_temperatures) != 1:
            return None
        live = None if prev.dead is None else ~prev.dead
        seq_slots = prev.slots if live is None else prev.slots[live]
        if not seq_slots.size:
            return None
        plan = self.scheduler.schedule_continuation(seq_slots)
        if plan is None:
            return None
        t0 = time.perf_counter()
        with use_profile(self.config.profile):
            self._check_weights_version()
            count, ps, starts = seq_slots.size, self.page_size, plan.starts
            table = self.scheduler.slots.table(seq_slots)
            slots = table[np.arange(count), starts // ps].astype(np.int64) * ps + starts % ps
            seq_lens = (starts + 1).astype(np.int32)
            decode = HostDecode(np.zeros(count, np.int64), starts, table, seq_lens, slots)  # ids: from the device
            info = dict(decode=True, rows=count, context_tokens=int(seq_lens.sum()))
            sampler = self._host_sampler(seq_slots, starts + 1)
            src_rows = np.arange(count) if live is None else live.nonzero()[0]
            launched = self._launch_graph(plan, decode, sampler, info, (prev.device_tokens, src_rows))
        launched.marked = False   # its chunks are marked computed once prev's tokens are appended
        launched.seconds = time.perf_counter() - t0
        self.counters["overlapped_steps"] += 1
        return launched

    def _launch_graph(self, plan: SchedulerOutput, decode: HostDecode, sampler: HostSampler, info: dict,
                      prev_tokens=None) -> _Launched:
        """One decode graph replay that samples every row of ``plan``; its results start their copy to the host."""
        graphs = self.decode_graphs
        graphs.check(decode, self.blocks.num_pages)
        self.counters["graph_steps"] += 1
        graphs.run(decode, sampler, prev_tokens=prev_tokens)
        results = Readback(pack_results(graphs.tokens, graphs.logprobs, graphs.verdicts))
        routing = None if self.routing is None else (decode.slots, Readback(graphs.routing))
        return _Launched(plan, plan.seqs, plan.slots, sampler.positions, results, graphs.verdict_messages, routing,
                         info, device_tokens=graphs.tokens, events=self._replay_events(graphs.replays - 1))

    def _replay_events(self, replays_before: int) -> tuple | None:
        """The CUDA events around the graph replay of the step just launched (DecodeGraphs.time_replays;
        the rollout benchmark's forward_gpu_ms), None when it replayed no graph."""
        graphs = self.decode_graphs
        if graphs is None or not graphs.time_replays or graphs.replays <= replays_before:
            return None
        return graphs.last_events

    def _graph_sampler(self, plan: SchedulerOutput, cu: np.ndarray, ends: np.ndarray) -> HostSampler | None:
        """The sampler inputs of a decode step the graphs sample whole: a decode-only step that fits a
        graph, every row sampling (its chunk ends at its last token), no running leader with forks
        pending (its siblings would share its row), one logprob temperature in flight. None otherwise
        (the step samples eagerly)."""
        graphs, count = self.decode_graphs, len(plan.seqs)
        if graphs is None or not graphs.samples or cu[-1] != count or graphs.bucket(count) is None:
            return None
        if len(self._shared_settings().score_temperatures) != 1 or self.scheduler.forking_leaders():
            return None
        totals = self.scheduler.slots.num_tokens[plan.slots]
        if not (ends == totals).all():
            return None
        return self._host_sampler(plan.slots, totals)

    def _host_sampler(self, slots: np.ndarray, positions: np.ndarray) -> HostSampler:
        """Per-row sampler inputs of the sequences in ``slots`` (the requests' settings, one value each
        when they agree)."""
        shared, n, table = self._shared_settings(), slots.size, self.scheduler.slots
        seeds = table.seed[slots]
        if len(shared.sampling) == 1:
            (t, k, p), = shared.sampling
            temperature, top_k, top_p = np.full(n, t, np.float32), np.full(n, k, np.int64), np.full(n, p, np.float32)
        else:
            temperature = table.temperature[slots].astype(np.float32)
            top_k = table.top_k[slots]
            top_p = table.top_p[slots].astype(np.float32)
        (score_temperature,) = shared.score_temperatures
        return HostSampler(seeds, positions, temperature, top_k, top_p, score_temperature, shared.filtered)

    def _sampler_variant(self) -> tuple[float, bool] | None:
        """The decode graphs' sampler variant of the requests in flight (None: several logprob temperatures)."""
        shared = self._shared_settings()
        if len(shared.score_temperatures) != 1:
            return None
        return next(iter(shared.score_temperatures)), shared.filtered

    def _check_weights_version(self) -> None:
        if self._shared_settings().weights_versions != {self.weights_version}:
            stale = next(r for r in self._requests.values() if r.weights_version != self.weights_version)
            raise WeightsUpdateError(f"request {stale.request_id!r} started with weights version "
                                     f"{stale.weights_version} but the engine now has {self.weights_version}")

    # ---- completing a step (the one device-to-host wait) -----------------------------------------

    def _complete(self, launched: _Launched, emit_unfinished: bool) -> list[StepOutput]:
        """Read ``launched``'s results (raising a failed device verdict), store its routing, free the pages
        of sequences that ended while it ran, append its live rows' tokens; then the continuation in
        flight (if any) has known input tokens: mark its chunks computed."""
        seqs, slots, positions, tokens, logprobs = launched.seqs, launched.slots, launched.positions, None, None
        t0 = time.perf_counter()
        host = None if launched.results is None else launched.results.wait()
        self.last_step_wait_seconds = time.perf_counter() - t0   # blocked on the device (the benchmark's)
        self._free_released(launched)   # it has run (waited for): the pages of sequences that ended meanwhile
        if host is not None:
            tokens, logprobs = unpack_results(host, len(seqs), launched.verdict_messages)
        if launched.routing is not None:
            self._store_routing(launched.routing[0], launched.routing[1].wait())
        if launched.dead is not None and tokens is not None:
            live = ~launched.dead
            seqs = list(itertools.compress(seqs, live.tolist()))
            slots, positions, tokens, logprobs = slots[live], positions[live], tokens[live], logprobs[live]
        self.counters["steps"] += 1
        self.counters["forward_tokens"] += launched.plan.num_tokens
        self.counters["sampled_tokens"] += len(seqs)
        self.counters["compute_seconds"] += launched.seconds
        self.last_forward, self.last_step_events = launched.forward_info, launched.events
        outputs = self._append(seqs, slots, positions, tokens, logprobs, emit_unfinished)
        following = self._inflight
        if following is not None and not following.marked:
            plan = following.plan   # a continuation: its rows are its plan's
            self.scheduler.mark_computed(plan if following.dead is None else plan.select(~following.dead))
            following.marked = True
        return outputs

    def _free_released(self, launched: _Launched) -> None:
        self.scheduler.free_pages(launched.release)
        launched.release = []

    def _abandon(self, launched: _Launched) -> None:
        """A step whose completion failed: wait for it and free the pages it held for ended sequences."""
        if launched.results is not None:
            launched.results.wait()
        self._free_released(launched)

    def _drain_if_dead(self) -> None:
        """A step in flight whose every row belongs to a finished or aborted sequence: wait for it and free
        the pages it wrote (its results are dropped unread, verdicts included: nothing uses them)."""
        launched = self._inflight
        if launched is None or not launched.all_dead:
            return
        self._inflight = None
        if launched.routing is not None:
            launched.routing[1].wait()
        self._abandon(launched)

    def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.device)
        for cache in (*self.kv_cache.k, *self.kv_cache.v):
            cache.index_copy_(0, dst, cache.index_select(0, src))
        if self.routing is not None:
            self.routing.copy_pages(copies)

    def _forward(self, plan: SchedulerOutput, ids, positions, cu, table, seq_lens, slots):
        """(hidden rows of every new token of the plan, (slots, expert ids readback) or None): a graph replay
        (the step sampled eagerly from its hidden rows) for a decode step that fits one, else one eager
        forward."""
        decode_only = bool(cu[-1] == len(plan.seqs))
        graphs = self.decode_graphs
        if graphs is not None and decode_only and graphs.bucket(len(plan.seqs)) is not None:
            decode = HostDecode(ids, positions, table, seq_lens, slots)
            graphs.check(decode, self.blocks.num_pages)
            self.counters["graph_steps"] += 1
            hidden = graphs.run(decode, variant_hint=self._sampler_variant())
            return hidden, None if self.routing is None else (slots, Readback(graphs.routing))
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.from_numpy(ids).to(dev), positions=torch.from_numpy(positions).to(dev),
            cu_seqlens=torch.from_numpy(cu.astype(np.int32)).to(dev), kv_cache=self.kv_cache,
            block_table=torch.from_numpy(table).to(dev), seq_lens=torch.from_numpy(seq_lens).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev))
        if self.routing is None:
            return self.model.forward_hidden(batch), None
        with record_routing(keep_logits=False) as record:
            hidden = self.model.forward_hidden(batch)
        expert_ids = record.expert_ids()
        if expert_ids is None:
            raise RolloutError("internal: record_routing is on but the forward ran no sparse layer")
        return hidden, (slots, Readback(expert_ids))

    def _store_routing(self, slots: np.ndarray, expert_ids: torch.Tensor) -> None:
        """A step's expert ids (on the host) into the routing record, by slot."""
        self.routing.write(slots, expert_ids)

    def _host_arrays(self, plan: SchedulerOutput):
        """(ids int64, positions int64, cu_seqlens int64, block table int32, seq_lens int32, slots int64).

        Array operations on the plan's columns and the slot table only (this runs every step over every
        running sequence): a row's token is ``tokens[its slot, its position]``, its KV slot comes from its
        sequence's pages."""
        count, ps, table_of = len(plan.seqs), self.page_size, self.scheduler.slots
        starts, lengths, seq_slots = plan.starts, plan.lengths, plan.slots
        cu = np.zeros(count + 1, np.int64)
        lengths.cumsum(out=cu[1:])
        if cu[-1] == count:  # decode-only step: one token each, at its start
            positions, owner = starts, np.arange(count)
        else:
            owner = np.repeat(np.arange(count), lengths)
            positions = np.arange(cu[-1], dtype=np.int64) - cu[:-1][owner] + starts[owner]
        ids = table_of.tokens[seq_slots[owner], positions]
        table = table_of.table(seq_slots)
        slots = table[owner, positions // ps].astype(np.int64) * ps + positions % ps
        return ids, positions, cu, table, (starts + lengths).astype(np.int32), slots

    def _sampling_rows(self, plan: SchedulerOutput, cu: np.ndarray,
                       ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[Sequence], np.ndarray]:
        """(the hidden row each sampling sequence samples from, the position its new token takes = its
        num_tokens, the sequences, their slots); int64 arrays. A leader's forked siblings (forked here,
        right after it) share its row and position. ``cu``: the chunks' cumulative row counts; ``ends``:
        each chunk's start + length (a chunk samples when it ends at its sequence's last token)."""
        count = len(plan.seqs)
        totals = self.scheduler.slots.num_tokens[plan.slots]
        picked = (ends == totals).nonzero()[0]
        seqs = plan.seqs if picked.size == count else list(map(plan.seqs.__getitem__, picked.tolist()))
        rows, positions, slots = cu[1:][picked] - 1, totals[picked], plan.slots[picked]   # a chunk's last row
        leaders = self.scheduler.forking_leaders()
        if not leaders:
            return rows, positions, seqs, slots
        forking = _member(slots, [s.slot for s in leaders]).nonzero()[0]
        if not forking.size:
            return rows, positions, seqs, slots
        # each forking leader's siblings right after it: take[i] = the sampled row that result row i uses
        take, seq_list, slot_parts, prev = [], [], [], 0
        for k in forking.tolist():
            siblings = self.scheduler.fork(seqs[k])
            take += [np.arange(prev, k + 1), np.full(len(siblings), k)]
            seq_list += seqs[prev:k + 1] + siblings
            slot_parts += [slots[prev:k + 1], np.fromiter((s.slot for s in siblings), np.int64, len(siblings))]
            prev = k + 1
        take.append(np.arange(prev, len(seqs)))
        seq_list += seqs[prev:]
        slot_parts.append(slots[prev:])
        take = np.concatenate(take)
        return rows[take], positions[take], seq_list, np.concatenate(slot_parts)

    def _sample(self, hidden: torch.Tensor, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> Readback:
        """The eager sampler on the sampling rows (sequences in ``slots``): tokens (int64) and logprobs
        (fp32), on their way to the host in ONE device-to-host copy (:func:`pack_results`)."""
        dev = hidden.device
        h = hidden.index_select(0, torch.from_numpy(rows).to(dev))
        seeds = torch.from_numpy(self.scheduler.slots.seed[slots]).to(dev)
        temperature, top_k, top_p = self._sampling_settings(slots)
        tokens, logprobs = ops.sample_and_score(h, self.model.lm_head_weight, seeds=seeds,
                                                positions=torch.from_numpy(positions).to(dev),
                                                temperature=temperature, top_k=top_k, top_p=top_p)
        return Readback(pack_results(tokens, logprobs))

    def _sampling_settings(self, slots: np.ndarray):
        """(temperature, top_k, top_p): one number each when every request in flight shares them (the
        usual case: no per-sequence lists), else per-row lists (the requests' own Python numbers, read
        from the slot table). ops.sample_and_score treats a list of equal values as that value, so both
        forms give the same bits."""
        settings = self._shared_settings().sampling
        if len(settings) == 1:
            return next(iter(settings))
        table = self.scheduler.slots
        return table.temperature[slots].tolist(), table.top_k[slots].tolist(), table.top_p[slots].tolist()

    def _shared_settings(self) -> "_SharedSettings":
        """What the requests in flight set (distinct values), recomputed only when a combination of settings
        appears or disappears (:meth:`_count_settings`), from those combinations: the per-step code reads
        one value instead of one per sequence when they agree, and a request entering or leaving costs
        O(1), not a pass over the requests in flight."""
        if self._shared is None:
            combos = list(self._settings_in_flight)
            sampling = {combo[1] for combo in combos}
            vocab = self.model.config.vocab_size
            self._shared = _SharedSettings(
                weights_versions={combo[0] for combo in combos},
                sampling=sampling,
                limits={combo[2] for combo in combos},
                score_temperatures={ops.logprob_temperature(t) for t, _, _ in sampling},
                filtered=any(t > 0 and (0 < k < vocab or p < 1) for t, k, p in sampling))
        return self._shared

    def _count_settings(self, request: Request, change: int) -> None:
        """A request enters (+1) or leaves (-1) the requests in flight; the shared view is recomputed when
        its combination of settings appears or disappears."""
        sampling = request.sampling
        combo = (request.weights_version, (sampling.temperature, sampling.top_k, sampling.top_p),
                 (sampling.max_new_tokens, bool(sampling.stop)))
        counts = self._settings_in_flight
        counts[combo] += change
        if counts[combo] == 0:
            del counts[combo]
            self._shared = None
        elif counts[combo] == change:   # first of its kind
            self._shared = None

    def _append(self, seqs: list[Sequence], slots: np.ndarray, positions: np.ndarray, tokens: np.ndarray | None,
                logprobs: np.ndarray | None, emit_unfinished: bool = True) -> list[StepOutput]:
        """Append each sampled token (at ``positions``, = the sequence's num_tokens) and logprob to the
        sequences in ``slots`` (array writes: :meth:`SlotTable.append`); end the samples that stop; the
        outputs: unfinished ones (``emit_unfinished``), then finished ones. Python runs per sequence that
        may stop (:meth:`_stop_candidates`), not per sequence."""
        if not seqs:
            return []
        table = self.scheduler.slots
        may_stop = self._stop_candidates(slots, positions + 1, tokens)
        table.append(slots, positions, tokens, logprobs)
        ended = [i for i in may_stop if self._check_stop(seqs[i], int(tokens[i]))]
        outputs = []
        if emit_unfinished:   # one StepOutput per token: the step() API's contract
            going = slots
            token_list, logprob_list = tokens.tolist(), logprobs.tolist()
            if ended:
                keep = np.ones(len(seqs), bool)
                keep[ended] = False
                going, token_list = slots[keep], list(itertools.compress(token_list, keep.tolist()))
                logprob_list = list(itertools.compress(logprob_list, keep.tolist()))
            outputs = list(map(StepOutput, table.request_id[going].tolist(), table.prompt_index[going].tolist(),
                               table.sample_index[going].tolist(), token_list, logprob_list,
                               itertools.repeat(False)))
        finished = [seqs[i] for i in ended]
        self._finish(finished)
        outputs += [self._finished_output(seq, seq.tokens[-1], seq.logprobs[-1]) for seq in finished]
        return outputs

    def _stop_candidates(self, slots: np.ndarray, new_len: np.ndarray, tokens: np.ndarray) -> list[int]:
        """Indices (ascending) of the sequences (in ``slots``) that may end with this step's ``tokens``
        (appended after this call, bringing them to ``new_len`` tokens): :meth:`_check_stop` decides for
        these, every other one goes on. One array test on the slots' own stop ids and length limits
        (requests may differ in both); every sequence while a request with stop strings is in flight
        (only decoding tells)."""
        if any(has_strings for _, has_strings in self._shared_settings().limits):
            return list(range(slots.size))
        table = self.scheduler.slots
        may = new_len >= np.minimum(table.length_limit[slots], self.max_model_len)
        may |= table.hits_stop(slots, tokens)
        return may.nonzero()[0].tolist()

    def _finish(self, seqs: list[Sequence]) -> None:
        """Free the sequences' pages and slots; with record_routing, first gather their computed rows'
        routing. While a step is in flight their rows in it are dropped, and their pages freed once it has
        run (it writes their K/V slots: one step late)."""
        if self.routing is not None:
            for seq in seqs:
                seq.routing = self.routing.gather(seq.block_table, seq.num_computed)
        inflight = self._inflight
        if inflight is None:
            self.scheduler.finish(seqs)
            return
        slots = [seq.slot for seq in seqs if seq.slot is not None]
        self.scheduler.finish(seqs, free_pages=False)
        if slots:
            inflight.mark_dead(slots)
        inflight.release.extend(seqs)

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        request = seq.request
        if token in request.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", int(token)
        elif request.sampling.stop and (hit := self._stop_string(seq)) is not None:
            seq.finish_reason, seq.stop_reason = "stop", hit
        elif seq.num_output_tokens >= request.sampling.max_new_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _stop_string(self, seq: Sequence) -> str | None:
        """The first stop string in the decoded text of the last (longest stop string + 8) generated tokens
        (a token decodes to at least one byte, so a stop string just completed lies in that window)."""
        stops = seq.request.sampling.stop
        window = max(len(s) for s in stops) + STOP_STRING_SLACK_TOKENS
        text = self.tokenizer.decode(seq.tokens[max(seq.num_prompt_tokens, seq.num_tokens - window):])
        return next((s for s in stops if s in text), None)

    def _finished_output(self, seq: Sequence, token, logprob) -> StepOutput:
        request = seq.request
        completion = Completion(
            request_id=request.request_id, prompt_index=request.prompt_index, sample_index=seq.sample_index,
            prompt_tokens=request.prompt_tokens, tokens=seq.output_tokens, logprobs=list(seq.logprobs),
            finish_reason=seq.finish_reason, weights_version=request.weights_version, seed=seq.seed,
            stop_reason=seq.stop_reason, prompt=request.prompt_text,
            text=self.tokenizer.decode(seq.output_tokens) if self.tokenizer is not None else None,
            num_preemptions=seq.num_preemptions, routing=seq.routing)
        seq.status = SeqStatus.FINISHED
        if request.finished and self._requests.pop(request.request_id, None) is not None:
            self._count_settings(request, -1)
        return StepOutput(request.request_id, request.prompt_index, seq.sample_index, token, logprob, True, completion)

    # ---- batch API -----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]] | list[str], sampling: SamplingParams | None = None, *,
                 prompt_indices: list[int] | None = None) -> list[Completion]:
        """Sample ``sampling.n`` completions for every prompt; returned prompt by prompt, then by sample index.

        Prompt i gets ``prompt_index = prompt_indices[i]`` (default i), which keys its seeds with
        ``seed_by="index"``. Needs an idle engine (no request added through add_request in flight). The
        steps run with Python's cyclic garbage collector paused (:func:`collector_paused`).
        """
        if self.has_unfinished():
            raise RolloutError(f"generate() needs an idle engine but {len(self._requests)} requests are in flight; "
                               "run step() until has_unfinished() is False, or abort_all()")
        sampling = sampling or SamplingParams()
        indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        if len(indices) != len(prompts):
            raise RequestError(f"got {len(prompts)} prompts but {len(indices)} prompt_indices")
        done: dict[tuple[str, int], Completion] = {}
        try:
            ids = [self.add_request(p, sampling, prompt_index=i) for p, i in zip(prompts, indices)]
            with collector_paused():
                while self.has_unfinished():
                    with torch.no_grad():
                        outputs = self._step(emit_unfinished=False)
                    for out in outputs:
                        if out.completion is not None:
                            done[(out.request_id, out.sample_index)] = out.completion
        except BaseException:
            self.abort_all()
            raise
        return [done[(rid, j)] for rid in ids for j in range(sampling.n)]

    # ---- weights -------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                       version: int | None = None) -> int:
        """Copy new values into the model's parameters in place (cast to their dtype/device); returns the new
        weights version (``version``, default the old one + 1). All or some parameters may be given, by
        their Hugging Face names. Refused while requests are in flight (a request never mixes versions):
        finish them or :meth:`abort_all` first. The prefix cache is emptied (its K/V belong to the old weights).
        """
        if self._requests:
            raise WeightsUpdateError(
                f"cannot update weights with {len(self._requests)} requests in flight (ids "
                f"{sorted(self._requests)[:5]}): one request never mixes weight versions; run step() until "
                "has_unfinished() is False, or abort_all(), then update")
        if self._inflight is not None:
            raise RolloutError("internal: a decode step is in flight with no request in flight")
        params = dict(self.model.named_parameters())
        tied_head = self.model.lm_head is None
        items = weights.items() if isinstance(weights, Mapping) else weights
        self._weights_broken = True  # until every tensor is in
        count = 0
        for name, tensor in items:
            if tied_head and name == "lm_head.weight":
                continue  # tied to the embedding, as checkpoints do
            param = params.get(name)
            if param is None:
                raise WeightsUpdateError(f"update_weights: unknown parameter {name!r} (expected Hugging Face names "
                                         f"such as {next(iter(params))!r})")
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightsUpdateError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is "
                                         f"{tuple(param.shape)}")
            param.copy_(tensor)
            count += 1
        self._weights_broken = False
        self.blocks.reset_prefix_cache()
        self.weights_version = self.weights_version + 1 if version is None else int(version)
        return self.weights_version

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> dict:
        return dict(self.counters, num_pages=self.blocks.num_pages, free_pages=self.blocks.num_free,
                    preemptions=self.scheduler.num_preemptions, prefix_cache_hit_pages=self.blocks.prefix_hits,
                    cow_copies=self.blocks.cow_copies, weights_version=self.weights_version)


def _prompt_key(ids: list[int]) -> int:
    return prompt_key(ids)


def _member(values: np.ndarray, members: list[int]) -> np.ndarray:
    """bool [n]: whether each of ``values`` (small non-negative ints: slots) is one of ``members`` (a mask
    lookup; np.isin sorts both)."""
    if not values.size or not members:
        return np.zeros(values.shape, bool)
    mask = np.zeros(max(int(values.max()), max(members)) + 1, bool)
    mask[members] = True
    return mask[values]
