"""The rollout engine: continuous batching over a paged KV cache, strict sampling, weight updates.

:class:`RolloutEngine` is the public surface (requests in, completions out, weights in place) and the
pipeline of steps; the work of a step lives in its rooms:

* :mod:`rlalign.rollout.scheduler` plans it (prefill chunks, decode tokens, recomputes; pages, copy-on-write);
* :mod:`rlalign.rollout.runner` runs it on the device: one forward (or a decode graph replay), then the
  sampler (:func:`ops.sample_and_score`: the engine's logprobs equal the trainer's bit for bit in the
  strict profile, and the tokens do not depend on any engine setting; exact statement there);
* :mod:`rlalign.rollout.stops` decides which samples end, :mod:`rlalign.rollout.outputs` builds what
  :meth:`RolloutEngine.step` returns, :mod:`rlalign.rollout.requests` keeps the requests in flight.

A step is launched (forward and sampling queued, results on their way to the host: a
:class:`rlalign.rollout.launched.LaunchedStep`) and then completed (the one wait for the device, tokens
appended, stops checked). The per-sequence state a step reads and writes lives in the scheduler's
:class:`rlalign.rollout.slots.SlotTable` (one row per running sequence), so a decode step's host work is
array operations over its rows plus Python for the sequences that change (a page fills, a sample may stop,
a leader forks); ``step()`` still returns one StepOutput per token. With ``RolloutConfig.overlap`` the next
decode step is launched between the two halves, its input ids the running step's tokens copied on the
device (:meth:`RolloutEngine._launch_continuation`; docs/rollout.md, "Overlapped scheduling"); rows do not
depend on each other, so this changes no bit.

With ``RolloutConfig.record_routing`` (MoE models) the forward also yields each row's expert ids; they are
stored by KV slot once per step (:mod:`rlalign.rollout.routing`) and a finished sample's rows are gathered
into ``Completion.routing``.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

from rlalign.rollout.block_manager import BlockManager, pages_for
from rlalign.rollout.config import RolloutConfig, SamplingParams
from rlalign.rollout.device_setup import num_pages as kv_num_pages, page_bytes
from rlalign.rollout.errors import KVCacheTooSmallError, RequestError, RolloutError, WeightsUpdateError
from rlalign.rollout.launched import LaunchedStep
from rlalign.rollout.outputs import completion_of, running_outputs
from rlalign.rollout.readback import unpack_results
from rlalign.rollout.requests import RequestsInFlight, check_prompt, new_request, read_prompt
from rlalign.rollout.runner import ModelRunner
from rlalign.rollout.scheduler import Scheduler
from rlalign.rollout.sequence import Completion, Sequence, SeqStatus, StepOutput
from rlalign.rollout.stops import Stops
from rlalign.rollout.weights import copy_weights


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off inside the block (as it was before, after it).

    A full collection walks every tracked object of the process: with torch, transformers and rlalign imported
    ~2 x 10^5 of them, 0.19 s on the 2-core CPU machine. Inside a rollout it lands on one decode step, which
    then outlasts the device's work and shows as host time on the critical path. Reference counting still
    frees everything that is not in a cycle; the cycles made during the block are collected after it.
    :meth:`RolloutEngine.generate` runs its step loop inside this; a caller driving :meth:`RolloutEngine.step`
    itself can do the same."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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
        num_pages = kv_num_pages(self.config, model, self.max_model_len)
        self.blocks = BlockManager(num_pages, self.page_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.blocks)
        self.requests = RequestsInFlight(mc.vocab_size)
        self.runner = ModelRunner(model, self.config, self.scheduler, self.requests, num_pages, self.max_model_len)
        self.stops = Stops(tokenizer, self.max_model_len)
        self._inflight: LaunchedStep | None = None   # the step queued on the device, not yet read (overlap)
        self.last_step_events: tuple | None = None   # CUDA events around the completed step's graph replay
        self.last_step_wait_seconds = 0.0            # how long completing the last step waited for the device
        self.eos_token_ids = frozenset(mc.eos_token_ids) | frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._request_counter = itertools.count()
        self._weights_broken = False
        self.counters = dict(steps=0, forward_tokens=0, sampled_tokens=0, compute_seconds=0.0, graph_steps=0,
                             overlapped_steps=0)
        self.last_forward: dict | None = None
        self._planned_update: tuple[int, Callable] | None = None   # plan_weight_update's, for the next generate()
        self._pause_at: int | None = None    # completion tokens at which a sample parks (a planned update pending)
        self._held_outputs: list[StepOutput] = []   # a step completed by update_weights, returned by the next step()

    # ---- the device side (the runner's) -----------------------------------------------------------

    @property
    def kv_cache(self):
        return self.runner.kv_cache

    @property
    def decode_graphs(self):
        return self.runner.decode_graphs

    @property
    def routing(self):
        return self.runner.routing

    @property
    def overlap(self) -> bool:
        return self.runner.overlap

    @property
    def bytes_per_page(self) -> int:
        return page_bytes(self.model, self.page_size, self.config.mla_cache)

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
        ids, text = read_prompt(prompt, self.tokenizer)
        check_prompt(ids, sampling, vocab_size=self.model.config.vocab_size, max_model_len=self.max_model_len,
                     tokenizer=self.tokenizer)
        self._check_fits(ids, sampling)
        counter = next(self._request_counter)
        request_id = str(counter) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in flight")
        prompt_index = counter if prompt_index is None else int(prompt_index)
        request = new_request(request_id, prompt_index, ids, text, sampling, self.weights_version, self.eos_token_ids)
        self.requests.add(request)
        if self.config.share_prefix and sampling.n > 1:
            request.pending_forks = request.seqs[1:]
            for seq in request.pending_forks:
                seq.status = SeqStatus.FORK_PENDING
            self.scheduler.add(request.seqs[0])
        else:
            for seq in request.seqs:
                self.scheduler.add(seq)
        return request_id

    def _check_fits(self, ids: list[int], sampling: SamplingParams) -> None:
        """One sequence of the request fits the KV cache at its longest."""
        longest = min(len(ids) + sampling.max_new_tokens, self.max_model_len) - 1  # the last token is never fed
        needed = pages_for(max(longest, len(ids)), self.page_size)
        if needed > self.blocks.num_pages:
            raise KVCacheTooSmallError(
                f"one sequence of up to {longest} cached tokens needs {needed} pages of {self.page_size} tokens but "
                f"the KV cache has {self.blocks.num_pages} ({self.blocks.num_pages * self.bytes_per_page} bytes); "
                "raise RolloutConfig.kv_cache_bytes / num_pages or lower max_new_tokens")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> list[StepOutput]:
        """Stop a request now; its unfinished samples end with finish_reason "abort" (returned)."""
        request = self.requests.get(str(request_id))
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
        return [out for rid in self.requests.ids() for out in self.abort(rid)]

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
        held, self._held_outputs = self._held_outputs, []
        if self._inflight is None and not self.requests:
            return held
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
        return held + outputs if held else outputs

    def _launch_scheduled(self) -> LaunchedStep:
        """Schedule a step and queue it on the device (:meth:`ModelRunner.launch`)."""
        plan = self.scheduler.schedule()
        if not plan.seqs:
            raise RolloutError("internal: the scheduler found nothing to run with requests in flight")
        self.requests.check_weights_version(self.weights_version)
        launched = self.runner.launch(plan)
        self.counters["graph_steps"] += launched.graph_replayed
        return launched

    def _launch_continuation(self, prev: LaunchedStep) -> LaunchedStep | None:
        """Overlapped scheduling: launch the decode step after ``prev`` (in flight, graph-sampled) before
        reading ``prev``'s tokens: the same live sequences, one token each, whose input ids are ``prev``'s
        sampled tokens gathered on the device. None (nothing changed) when the next step is anything else:
        an admission, preemption or a page shortage, copy-on-write, several logprob
        temperatures in flight -- those steps run serially once ``prev`` is read. (A running sequence never
        has forks pending here: a leader forks at the end of its prompt, which is not a decode step.)"""
        if not self.overlap or prev.device_tokens is None or len(self.requests.shared().score_temperatures) != 1:
            return None
        live = None if prev.dead is None else ~prev.dead
        seq_slots = prev.slots if live is None else prev.slots[live]
        if not seq_slots.size:
            return None
        plan = self.scheduler.schedule_continuation(seq_slots)
        if plan is None:
            return None
        self.requests.check_weights_version(self.weights_version)
        launched = self.runner.launch_continuation(plan, prev.device_tokens, live)
        self.counters["graph_steps"] += launched.graph_replayed
        self.counters["overlapped_steps"] += 1
        return launched

    def _complete(self, launched: LaunchedStep, emit_unfinished: bool) -> list[StepOutput]:
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
            self.routing.write(launched.routing[0], launched.routing[1].wait())
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

    def _free_released(self, launched: LaunchedStep) -> None:
        self.scheduler.free_pages(launched.release)
        launched.release = []

    def _abandon(self, launched: LaunchedStep) -> None:
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

    # ---- after a step: tokens appended, samples ended ---------------------------------------------

    def _append(self, seqs: list[Sequence], slots: np.ndarray, positions: np.ndarray, tokens: np.ndarray | None,
                logprobs: np.ndarray | None, emit_unfinished: bool = True) -> list[StepOutput]:
        """Append each sampled token (at ``positions``, = the sequence's num_tokens) and logprob to the
        sequences in ``slots`` (array writes: :meth:`SlotTable.append`); end the samples that stop; the
        outputs: unfinished ones (``emit_unfinished``), then finished ones. Python runs per sequence that
        may stop (:meth:`Stops.candidates`), not per sequence."""
        if not seqs:
            return []
        table = self.scheduler.slots
        may_stop = self.stops.candidates(table, slots, positions + 1, tokens, self.requests.shared().stop_strings)
        table.append(slots, positions, tokens, logprobs)
        ended = [i for i in may_stop if self.stops.check(seqs[i], int(tokens[i]))]
        # one StepOutput per token: the step() API's contract
        outputs = running_outputs(table, slots, tokens, logprobs, ended) if emit_unfinished else []
        finished = [seqs[i] for i in ended]
        self._finish(finished)
        outputs += [self._finished_output(seq, seq.tokens[-1], seq.logprobs[-1]) for seq in finished]
        if self._pause_at is not None:
            self._park_at_pause(seqs, positions + 1 - table.num_prompt[slots], ended)
        return outputs

    def _park_at_pause(self, seqs: list[Sequence], num_output: np.ndarray, ended: list[int]) -> None:
        """Park the sequences that have just sampled their ``_pause_at``-th completion token and did not end: out of
        the queues, pages freed (one step late while a step that has their rows is in flight, as :meth:`_finish`)."""
        reached = set((num_output == self._pause_at).nonzero()[0].tolist()) - set(ended)
        if not reached:
            return
        parked = [seqs[i] for i in sorted(reached)]
        inflight = self._inflight
        slots = [seq.slot for seq in parked if seq.slot is not None]
        self.scheduler.park(parked, free_pages=inflight is None)
        if inflight is not None:
            if slots:
                inflight.mark_dead(slots)
            inflight.release.extend(parked)

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

    def _finished_output(self, seq: Sequence, token, logprob) -> StepOutput:
        """The ended sample's output (with its Completion); its request leaves once every sample has ended."""
        completion = completion_of(seq, self.tokenizer)
        seq.status = SeqStatus.FINISHED
        request = seq.request
        if request.finished:
            self.requests.discard(request)
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
            raise RolloutError(f"generate() needs an idle engine but {len(self.requests)} requests are in flight; "
                               "run step() until has_unfinished() is False, or abort_all()")
        sampling = sampling or SamplingParams()
        indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        if len(indices) != len(prompts):
            raise RequestError(f"got {len(prompts)} prompts but {len(indices)} prompt_indices")
        done: dict[tuple[str, int], Completion] = {}
        planned, self._planned_update = self._planned_update, None
        try:
            ids = [self.add_request(p, sampling, prompt_index=i) for p, i in zip(prompts, indices)]
            self._pause_at = None if planned is None else planned[0]
            with collector_paused():
                while self.has_unfinished():
                    if planned is not None and self.scheduler.only_parked():
                        self._update_planned(planned)   # every unfinished sample has its first after_tokens
                        planned = None
                    with torch.no_grad():
                        outputs = self._step(emit_unfinished=False)
                    for out in outputs:
                        if out.completion is not None:
                            done[(out.request_id, out.sample_index)] = out.completion
            if planned is not None:   # every sample ended within after_tokens: the update lands now
                self._update_planned(planned)
        except BaseException:
            self._pause_at = None
            self.abort_all()
            raise
        return [done[(rid, j)] for rid in ids for j in range(sampling.n)]

    def plan_weight_update(self, after_tokens: int, fetch: Callable[[], tuple]) -> None:
        """Update the weights in the middle of the next :meth:`generate` (partial rollouts spanning a weight update).

        Every sample of that call samples its first ``after_tokens`` completion tokens with the weights the engine
        holds now, then waits, parked (its K/V pages freed), until every unfinished sample of the call has them (or
        has ended); then ``fetch()`` gives ``(weights, version)`` (it may block until the new weights exist),
        :meth:`update_weights` takes them with ``in_flight="recompute"``, and the samples continue: their K/V
        recomputed by a prefill under the new weights, their tokens from ``after_tokens`` on sampled by ``version``
        (``Completion.token_versions``). Where a sample is cut depends only on its own tokens (never on batching,
        scheduling or timing), and each token's logprob is a prefill / decode under one version's weights over its
        whole prefix: a trainer forward with that version's weights gives its bits. If every sample ends within
        ``after_tokens`` tokens, the update lands when the call returns."""
        if after_tokens < 1:
            raise RequestError(f"plan_weight_update: after_tokens must be >= 1, got {after_tokens}")
        if self.routing is not None:
            raise RolloutError("plan_weight_update does not support record_routing yet (a sample's rows would mix the "
                               "routing of two weights versions)")
        self._planned_update = (int(after_tokens), fetch)

    def _update_planned(self, planned: tuple[int, Callable]) -> None:
        self._pause_at = None
        weights, version = planned[1]()
        self.update_weights(weights, version=version, in_flight="recompute")

    # ---- weights -------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                       version: int | None = None, in_flight: str = "refuse") -> int:
        """Copy new values into the model's parameters in place (cast to their dtype/device); returns the new
        weights version (``version``, default the old one + 1). All or some parameters may be given, by
        their Hugging Face names. The prefix cache is emptied (its K/V belong to the old weights).

        With requests in flight: ``in_flight="refuse"`` (default) refuses (a request never mixes versions: finish
        them or :meth:`abort_all` first); ``in_flight="recompute"`` lets them continue under the new weights: a
        step still in flight is completed first (its outputs come with the next :meth:`step`), every sequence's
        K/V pages are dropped and recomputed by a prefill under the new weights, and its tokens from here on
        record the new version (``Completion.token_versions``).
        """
        if in_flight not in ("refuse", "recompute"):
            raise RequestError(f"update_weights: in_flight must be 'refuse' or 'recompute', got {in_flight!r}")
        if self.requests and in_flight == "refuse":
            raise WeightsUpdateError(
                f"cannot update weights with {len(self.requests)} requests in flight (ids "
                f"{sorted(self.requests.ids())[:5]}): one request never mixes weight versions; run step() until "
                "has_unfinished() is False, or abort_all(), then update (or pass in_flight='recompute')")
        if self._inflight is not None:
            if not self.requests:
                raise RolloutError("internal: a decode step is in flight with no request in flight")
            self._settle()
        self.scheduler.restart_all()   # before the prefix cache is emptied: no page of the old K/V stays referenced
        self._weights_broken = True  # until every tensor is in
        copy_weights(self.model, weights)
        self._weights_broken = False
        self.blocks.reset_prefix_cache()
        self.weights_version = self.weights_version + 1 if version is None else int(version)
        self.requests.switch_version(self.weights_version)
        return self.weights_version

    def _settle(self) -> None:
        """Complete the step in flight (its outputs held for the next :meth:`step`)."""
        launched, self._inflight = self._inflight, None
        try:
            self._held_outputs += self._complete(launched, emit_unfinished=True)
        except BaseException:
            self._abandon(launched)
            raise
        self._drain_if_dead()

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> dict:
        return dict(self.counters, num_pages=self.blocks.num_pages, free_pages=self.blocks.num_free,
                    preemptions=self.scheduler.num_preemptions, prefix_cache_hit_pages=self.blocks.prefix_hits,
                    cow_copies=self.blocks.cow_copies, weights_version=self.weights_version)
