"""The model runner: the device side of a rollout step -- the KV cache, the decode graphs, the forward and the sampler.

Per step (a plan of the scheduler): page copies for copy-on-write are done; ONE :class:`ForwardBatch`
describes every chunk; ONE model forward gives the hidden rows (a decode-only step on a GPU: a CUDA graph
replay of that forward on a padded batch, :mod:`rlalign.rollout.decode_graphs`); the rows of the sequences
that reached their last token are sampled together by :func:`ops.sample_and_score` (the one owner of
"sample a token, score it with the trainer's op"; exact formulas there; in a decode graph the same op is
captured with the forward):

    token, logprob = ops.sample_and_score(h, W, seeds=s, positions=p, temperature=T, top_k, top_p)

with h the sequence's last hidden row, s its per-sample seed (:func:`ops.derive_seed` of the
request's seed, prompt key and sample index), p the absolute position the token will occupy.
``logprob`` is the same op on the same hidden row as the trainer's packed forward
(``model.logprobs(ForwardBatch.packed(...), targets, temperature=ops.logprob_temperature(T))``), and
in the strict profile a row does not depend on the batch, the chunking or the page layout: the
engine's logprobs equal the trainer's bit for bit, and the tokens do not depend on any engine setting.
Requests with ``min_p`` or ``logprobs="sampled"`` (the kept set's log-prob, ``ops.sampled_logprob``) sample
eagerly, outside the decode graphs.

The runner only launches: the forward and the sampling are queued, their results start their copy to the
host (:class:`rlalign.rollout.readback.Readback`), and a :class:`LaunchedStep` says what to read back. The
host inputs are array operations over the plan's columns and the scheduler's slot table. With
``RolloutConfig.record_routing`` (MoE models) the forward also yields each row's expert ids
[rows, sparse layers, k], stored by KV slot (:mod:`rlalign.rollout.routing`) once the step is read.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from rlalign import ops
from rlalign.contract.profiles import use_profile
from rlalign.models.batch import ForwardBatch, KVCache
from rlalign.models.moe import record_routing
from rlalign.rollout.block_manager import pages_for
from rlalign.rollout.config import RolloutConfig
from rlalign.rollout.decode_graphs import DecodeGraphs, HostDecode, HostSampler
from rlalign.rollout.device_setup import decode_graph_mode, native_gathers, overlap_mode, routing_store
from rlalign.rollout.errors import RolloutError
from rlalign.rollout.launched import LaunchedStep, member
from rlalign.rollout.readback import Readback, pack_results
from rlalign.rollout.requests import RequestsInFlight
from rlalign.rollout.scheduler import Scheduler, SchedulerOutput
from rlalign.rollout.sequence import Sequence


class ModelRunner:
    """Runs the scheduler's plans on ``model``: owns the KV cache (``num_pages`` pages for the block manager,
    then the graphs' scratch pages), the decode graphs, the routing record and whether steps overlap.
    Reads the sequences' state from ``scheduler.slots`` and the settings of ``requests``."""

    def __init__(self, model, config: RolloutConfig, scheduler: Scheduler, requests: RequestsInFlight,
                 num_pages: int, max_model_len: int):
        self.model = model
        self.config = config
        self.scheduler = scheduler
        self.requests = requests
        self.device = model.device
        self.page_size = config.page_size
        self.num_pages = num_pages
        graph_mode = decode_graph_mode(config, model)
        graph_batch = min(config.decode_graph_max_batch, config.max_num_seqs)
        scratch = pages_for(graph_batch, self.page_size) if graph_mode else 0
        # scratch pages (for the graphs' padding rows) lie past the block manager's pages
        self.kv_cache = KVCache.for_model(model.config, num_pages + scratch, self.page_size, model.dtype, self.device,
                                          mla_cache=config.mla_cache)
        self.routing = routing_store(config, model, num_pages)
        # both profiles sample inside the graphs (the native sampler's static form reads nothing on the host)
        self.decode_graphs = None if not graph_mode else DecodeGraphs(
            model, self.kv_cache, list(range(num_pages, num_pages + scratch)), graph_batch,
            pages_for(max_model_len, self.page_size), mode=graph_mode,
            width_buckets=native_gathers(config, model), record_routing=self.routing is not None,
            sampler_weight=model.lm_head_weight)
        sampling_graphs = self.decode_graphs is not None and self.decode_graphs.samples
        self.overlap = overlap_mode(config, self.device, sampling_graphs, graph_mode)

    # ---- launching a step (nothing read back from the device) ------------------------------------

    def launch(self, plan: SchedulerOutput) -> LaunchedStep:
        """Queue ``plan``'s forward and sampling; a decode step of sampling rows only is one graph replay that
        also samples (no host read), any other step samples eagerly. Marks the plan's chunks computed (and
        forks the leaders whose prompt is in)."""
        t0 = time.perf_counter()
        with use_profile(self.config.profile):
            self.copy_pages(plan.copies)
            ids, positions, cu, table, seq_lens, slots = self.host_arrays(plan)
            info = dict(decode=bool(cu[-1] == len(plan.seqs)), rows=len(plan.seqs),
                        context_tokens=int(seq_lens.sum()))
            sampler = self._graph_sampler(plan, cu, seq_lens)
            if sampler is not None:
                launched = self._launch_graph(plan, HostDecode(ids, positions, table, seq_lens, slots), sampler,
                                              info)
                self.scheduler.mark_computed(plan)
            else:
                replays = self.decode_graphs.replays if self.decode_graphs is not None else 0
                replayed = self._replays_graph(plan, cu)
                hidden, routing = self._forward(replayed, ids, positions, cu, table, seq_lens, slots)
                self.scheduler.mark_computed(plan)
                rows, sample_positions, seqs, seq_slots = self._sampling_rows(plan, cu, seq_lens)
                results = self._sample(hidden, rows, sample_positions, seq_slots) if seqs else None
                launched = LaunchedStep(plan, seqs, seq_slots, sample_positions, results, [], routing, info,
                                        events=self._replay_events(replays), graph_replayed=replayed)
        launched.seconds = time.perf_counter() - t0
        return launched

    def launch_continuation(self, plan: SchedulerOutput, prev_tokens: torch.Tensor,
                            live: np.ndarray | None) -> LaunchedStep:
        """Overlapped scheduling: the decode step ``plan`` (one token per sequence, planned by
        ``Scheduler.schedule_continuation``) launched before the step in flight is read: its input ids are that
        step's sampled tokens ``prev_tokens``, gathered on the device from its ``live`` rows (bool per row;
        None: all). Its chunks are marked computed once those tokens are appended (``marked`` False)."""
        t0 = time.perf_counter()
        seq_slots = plan.slots
        with use_profile(self.config.profile):
            count, ps, starts = seq_slots.size, self.page_size, plan.starts
            table = self.scheduler.slots.table(seq_slots)
            slots = table[np.arange(count), starts // ps].astype(np.int64) * ps + starts % ps
            seq_lens = (starts + 1).astype(np.int32)
            decode = HostDecode(np.zeros(count, np.int64), starts, table, seq_lens, slots)  # ids: from the device
            info = dict(decode=True, rows=count, context_tokens=int(seq_lens.sum()))
            sampler = self._host_sampler(seq_slots, starts + 1)
            src_rows = np.arange(count) if live is None else live.nonzero()[0]
            launched = self._launch_graph(plan, decode, sampler, info, (prev_tokens, src_rows))
        launched.marked = False   # its chunks are marked computed once prev's tokens are appended
        launched.seconds = time.perf_counter() - t0
        return launched

    def _launch_graph(self, plan: SchedulerOutput, decode: HostDecode, sampler: HostSampler, info: dict,
                      prev_tokens=None) -> LaunchedStep:
        """One decode graph replay that samples every row of ``plan``; its results start their copy to the host."""
        graphs = self.decode_graphs
        graphs.check(decode, self.num_pages)
        graphs.run(decode, sampler, prev_tokens=prev_tokens)
        results = Readback(pack_results(graphs.tokens, graphs.logprobs, graphs.verdicts))
        routing = None if self.routing is None else (decode.slots, Readback(graphs.routing))
        return LaunchedStep(plan, plan.seqs, plan.slots, sampler.positions, results, graphs.verdict_messages, routing,
                            info, device_tokens=graphs.tokens, events=self._replay_events(graphs.replays - 1),
                            graph_replayed=True)

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
        pending (its siblings would share its row), one logprob temperature in flight, no request with min-p or
        sampled logprobs. None otherwise (the step samples eagerly)."""
        graphs, count = self.decode_graphs, len(plan.seqs)
        if graphs is None or not graphs.samples or cu[-1] != count or graphs.bucket(count) is None:
            return None
        shared = self.requests.shared()
        if len(shared.score_temperatures) != 1 or shared.eager_sampling or self.scheduler.forking_leaders():
            return None
        totals = self.scheduler.slots.num_tokens[plan.slots]
        if not (ends == totals).all():
            return None
        return self._host_sampler(plan.slots, totals)

    def _host_sampler(self, slots: np.ndarray, positions: np.ndarray) -> HostSampler:
        """Per-row sampler inputs of the sequences in ``slots`` (the requests' settings, one value each
        when they agree)."""
        shared, n, table = self.requests.shared(), slots.size, self.scheduler.slots
        seeds = table.seed[slots]
        if len(shared.sampling) == 1:
            (t, k, p, _, _), = shared.sampling   # (graphs only sample requests without min-p / sampled logprobs)
            temperature, top_k, top_p = np.full(n, t, np.float32), np.full(n, k, np.int64), np.full(n, p, np.float32)
        else:
            temperature = table.temperature[slots].astype(np.float32)
            top_k = table.top_k[slots]
            top_p = table.top_p[slots].astype(np.float32)
        (score_temperature,) = shared.score_temperatures
        return HostSampler(seeds, positions, temperature, top_k, top_p, score_temperature, shared.filtered)

    def _sampler_variant(self) -> tuple[float, bool] | None:
        """The decode graphs' sampler variant of the requests in flight (None: several logprob temperatures)."""
        shared = self.requests.shared()
        if len(shared.score_temperatures) != 1:
            return None
        return next(iter(shared.score_temperatures)), shared.filtered

    # ---- the forward -------------------------------------------------------------------------------

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: the K/V (linear-attention stores, routing rows) of each (src page, dst page)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.device)
        for cache in self.kv_cache.paged_tensors():
            cache.index_copy_(0, dst, cache.index_select(0, src))
        if self.routing is not None:
            self.routing.copy_pages(copies)

    def _replays_graph(self, plan: SchedulerOutput, cu: np.ndarray) -> bool:
        """Whether the forward of ``plan`` is a graph replay: a decode-only step that fits a graph."""
        graphs = self.decode_graphs
        return graphs is not None and bool(cu[-1] == len(plan.seqs)) and graphs.bucket(len(plan.seqs)) is not None

    def _forward(self, replay: bool, ids, positions, cu, table, seq_lens, slots):
        """(hidden rows of every new token of the plan, (slots, expert ids readback) or None): a graph replay
        (the step sampled eagerly from its hidden rows) for a decode step that fits one (``replay``:
        :meth:`_replays_graph`), else one eager forward."""
        graphs = self.decode_graphs
        if replay:
            decode = HostDecode(ids, positions, table, seq_lens, slots)
            graphs.check(decode, self.num_pages)
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

    def host_arrays(self, plan: SchedulerOutput):
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

    # ---- sampling ----------------------------------------------------------------------------------

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
        forking = member(slots, [s.slot for s in leaders]).nonzero()[0]
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
        pos = torch.from_numpy(positions).to(dev)
        temperature, top_k, top_p, min_p, mode = self._sampling_settings(slots)
        if isinstance(mode, str):
            tokens, logprobs = ops.sample_and_score(h, self.model.lm_head_weight, seeds=seeds, positions=pos,
                                                    temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                                    logprobs=mode)
            return Readback(pack_results(tokens, logprobs))
        # requests of both logprob modes: each mode's rows in one call (a row's token and logprob are its own)
        tokens = torch.empty(len(mode), dtype=torch.int64, device=dev)
        logprobs = torch.empty(len(mode), dtype=torch.float32, device=dev)
        for m in sorted(set(mode)):
            idx = [i for i, x in enumerate(mode) if x == m]
            at = torch.tensor(idx, dtype=torch.int64, device=dev)
            tokens[at], logprobs[at] = ops.sample_and_score(
                h.index_select(0, at), self.model.lm_head_weight, seeds=seeds[at], positions=pos[at],
                temperature=[temperature[i] for i in idx], top_k=[top_k[i] for i in idx],
                top_p=[top_p[i] for i in idx], min_p=[min_p[i] for i in idx], logprobs=m)
        return Readback(pack_results(tokens, logprobs))

    def _sampling_settings(self, slots: np.ndarray):
        """(temperature, top_k, top_p, min_p, logprobs mode): one value each when every request in flight
        shares them (the usual case: no per-sequence lists), else per-row lists (the requests' own Python
        numbers, read from the slot table). ops.sample_and_score treats a list of equal values as that value,
        so both forms give the same bits."""
        settings = self.requests.shared().sampling
        if len(settings) == 1:
            return next(iter(settings))
        table = self.scheduler.slots
        modes = ["sampled" if m else "full" for m in table.sampled_logprobs[slots].tolist()]
        return (table.temperature[slots].tolist(), table.top_k[slots].tolist(), table.top_p[slots].tolist(),
                table.min_p[slots].tolist(), modes[0] if len(set(modes)) == 1 else modes)
