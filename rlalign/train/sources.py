"""Where a training step's samples come from: the trainer's one rollout-source interface, chosen once at set-up.

:class:`RolloutSource` is what :meth:`rlalign.train.loop.Trainer.train_step` reads: :meth:`~RolloutSource.next_step`
gives the step's samples (the :class:`~rlalign.train.sampling.Sampler`'s draw: one-turn completions, each DP rank a
share, or multi-turn episodes with ``task.env``) and :meth:`~RolloutSource.push_weights` is told after each update.
The source also owns what depends on how old its samples are: whether the old policy's log-probs need a forward of
their own, which tokens the agreement check compares, and the importance weights of the policy loss.

* :class:`SynchronousSource` (``rollout.async_steps=0``): each step's samples drawn at its start by the trainer's
  current weights; the engine is updated after each step; the weights are ``algo.mismatch_correction``'s.
* :class:`AsynchronousSource` (``rollout.async_steps=k > 0``): the samples generated ``k`` steps ahead in one worker
  thread on the schedule of :mod:`rlalign.train.offpolicy` (a function of the config and the step, never of thread
  timing); the engine is updated only while no generation runs; the weights are the decoupled-PPO behaviour
  weights, and a checkpoint holds the samples in flight (:meth:`AsynchronousSource.state_dict`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import use_profile
from rlalign.train import advantages, offpolicy
from rlalign.train.packing import TrainBatch
from rlalign.train.samples import StepSamples
from rlalign.train.sampling import Sampler

STATE_KEY = "async_rollout"   # the checkpoint's key of the samples in flight


class RolloutSource(Protocol):
    """The step's samples, and what the trainer must know about their age."""

    on_policy: bool   # every sample drawn by the trainer's current weights

    def next_step(self, step: int) -> tuple[StepSamples, dict]:
        """(the samples of ``step``, the trainer at version ``step - 1``; their sampling stats)."""

    def push_weights(self, version: int) -> None:
        """The trainer's weights are now ``version`` (after the step's update)."""

    def quiesce(self, version: int) -> None:
        """Before an evaluation: the engine at the trainer's weights (``version``)."""

    def fresh_mask(self, samples: StepSamples, step: int) -> "torch.Tensor | None":
        """The tokens whose log-probs must equal the trainer's (None: all)."""

    def correction(self, algo, old_lp: "torch.Tensor | None", batch: TrainBatch, step: int,
                   samples: StepSamples) -> tuple["torch.Tensor | None", dict]:
        """(per-token importance weights of the policy loss or None, their record)."""

    def log_ratio(self, old_lp: "torch.Tensor | None", batch: TrainBatch) -> "torch.Tensor | None":
        """Per token ``prox - behav`` for samples of an older policy (the value targets' V-trace), None: on policy."""

    def engine_version(self) -> int:
        """The weights version logged as ``weights_version``: the engine's after the step (a function of the step)."""

    def state_dict(self) -> dict:
        """What a checkpoint must keep for a resume (entries of the checkpoint)."""

    def load_state_dict(self, checkpoint: dict, step: int) -> None:
        """Resume after ``step`` from ``checkpoint``."""

    def close(self) -> None:
        """Stop what the source started."""


class SynchronousSource:
    """Each step's samples drawn at its start, by the trainer's current weights (``rollout.async_steps=0``)."""

    on_policy = True

    def __init__(self, sampler: Sampler, push: Callable[[int], None]):
        self.sampler, self.push = sampler, push

    def next_step(self, step: int) -> tuple[StepSamples, dict]:
        return self.sampler.draw_step(step)

    def push_weights(self, version: int) -> None:
        self.push(version)

    def quiesce(self, version: int) -> None:
        """The engine already holds the trainer's weights (pushed after each step)."""

    def engine_version(self) -> int:
        return self.sampler.engine.weights_version

    def fresh_mask(self, samples: StepSamples, step: int) -> None:
        return None

    def correction(self, algo, old_lp, batch, step, samples):
        """``algo.mismatch_correction``'s TIS / MIS weights of the trainer's old log-probs against the rollout's."""
        return advantages.mismatch_correction(algo, old_lp, batch)

    def log_ratio(self, old_lp, batch) -> None:
        """On policy: GAE's own targets."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, checkpoint: dict, step: int) -> None:
        """Nothing in flight: the sampler's data position is the checkpoint's."""

    def close(self) -> None:
        """Nothing started."""


def samples_state(samples: StepSamples) -> dict:
    """A :class:`StepSamples` as a plain dict of tensors (for a checkpoint)."""
    return {f.name: getattr(samples, f.name) for f in dataclasses.fields(StepSamples)}


class AsynchronousSource:
    """The samples of every step, generated ``k`` steps ahead in one worker thread (:mod:`rlalign.train.offpolicy`).

    ``push(version)``: put the trainer's current weights into the engine as ``version`` (a copy); called only while
    no generation runs. The proximal log-probs are a trainer forward before the update (``on_policy`` False), the
    agreement check covers the tokens the current weights sampled, the loss weighs each token by the exact
    ``exp(prox - behav)`` bounded by ``algo.mismatch_correction``.

    With ``rollout.partial_tokens=N`` (partial rollouts, :func:`rlalign.train.offpolicy.switch_version`) the
    generation of step ``s > k`` switches to version ``s - k`` after each sample's first ``N`` tokens: the worker
    thread waits for that version (published by :meth:`push_weights` after step ``s - k``'s update, as
    ``snapshot(version)``, a copy of the trainer's weights) and the engine takes it with the samples in flight
    (:meth:`rlalign.rollout.RolloutEngine.plan_weight_update`); the engine is then updated only in the worker."""

    on_policy = False

    def __init__(self, cfg, sampler: Sampler, engine, push: Callable[[int], None],
                 snapshot: "Callable[[int], dict] | None" = None):
        self.k, self.profile = cfg.rollout.async_steps, cfg.run.profile
        self.bound = offpolicy.max_staleness(cfg.rollout)
        self.sampler, self.engine, self.push, self.snapshot = sampler, engine, push, snapshot
        self.partial = getattr(cfg.rollout, "partial_tokens", 0)
        if self.partial:
            offpolicy.check_partial(engine)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlalign-rollout")
        self._pending: dict[int, Future] = {}
        self._ready: dict[int, tuple] = {}
        self._next = 1   # the next step whose generation starts
        self._published: dict[int, dict] = {}   # partial: versions the worker switches to, not yet taken
        self._mailbox = threading.Condition()
        self._closed = False

    def _generate(self, step: int) -> tuple[StepSamples, dict, float]:
        """In the worker thread: the step's samples (DAPO's redraws included), scored; its generation time."""
        started = time.perf_counter()
        switch = offpolicy.switch_version(step, self.k) if self.partial else None
        if switch is not None:
            if self.engine.weights_version != offpolicy.behaviour_version(step, self.k):
                raise RuntimeError(f"internal: step {step}'s generation starts at weights version "
                                   f"{self.engine.weights_version}, not {offpolicy.behaviour_version(step, self.k)}")
            self.engine.plan_weight_update(self.partial, lambda: (self._take(switch), switch))
        with use_profile(self.profile):
            samples, stats = self.sampler.draw_step(step)
        return samples, stats, time.perf_counter() - started

    def _take(self, version: int) -> dict:
        """In the worker thread: the weights of ``version`` once the trainer has published them."""
        with self._mailbox:
            while version not in self._published and not self._closed:
                self._mailbox.wait()
            if self._closed:
                raise RLAlignError(f"the run stopped before weights version {version} existed")
            return self._published.pop(version)

    def _wait_all(self) -> None:
        for step in sorted(self._pending):
            self._ready[step] = self._pending.pop(step).result()

    def _engine_at(self, version: int, trainer_version: int) -> None:
        if self.engine.weights_version == version:
            return
        if version != trainer_version:   # only the trainer's current weights can be pushed
            raise RuntimeError(f"internal: the engine needs version {version} but the trainer holds {trainer_version}")
        self._wait_all()   # a weight update never lands under a running generation
        self.push(version)

    def next_step(self, step: int) -> tuple[StepSamples, dict]:
        """The samples of ``step`` (the trainer at version ``step - 1``), after starting generation through step
        ``step + k``; their sampling stats and ``time/rollout_generate_s`` (time/rollout_s is the wait for them)."""
        while self._next <= step + self.k:
            s = self._next
            if not self.partial:   # partial rollouts: the worker updates the engine (each draw ends at the next's version)
                self._engine_at(offpolicy.behaviour_version(s, self.k), step - 1)
            self._pending[s] = self._pool.submit(self._generate, s)
            self._next += 1
        if step in self._pending:
            self._ready[step] = self._pending.pop(step).result()
        samples, stats, generate_s = self._ready.pop(step)
        offpolicy.check_staleness(step, samples.versions, self.bound)
        return samples, {**stats, "time/rollout_generate_s": generate_s}

    def push_weights(self, version: int) -> None:
        """Nothing now (the engine is updated when the next generation starts: :meth:`_engine_at`), or, with partial
        rollouts, ``version`` published for the generation that switches to it (step ``version + k``'s)."""
        if self.partial:
            weights = self.snapshot(version)
            with self._mailbox:
                self._published[version] = weights
                self._mailbox.notify_all()

    def engine_version(self) -> int:
        """The engine's version after the step; with partial rollouts (the worker switches it at a time of its own)
        the version the newest generation started with, the value the engine holds at that point without them."""
        if not self.partial:
            return self.engine.weights_version
        return offpolicy.behaviour_version(self._next - 1, self.k)

    def quiesce(self, version: int) -> None:
        """Wait for the generations in flight; the engine then holds the trainer's weights (``version``)."""
        self._wait_all()
        if self.engine.weights_version != version:
            self.push(version)

    def fresh_mask(self, samples: StepSamples, step: int) -> torch.Tensor:
        return offpolicy.fresh_mask(samples.versions, step - 1)

    def correction(self, algo, old_lp, batch, step, samples):
        """Decoupled PPO: the behaviour weights ``exp(prox - behav)``, bounded by ``algo.mismatch_correction``, and
        the samples' staleness."""
        weights, stats = offpolicy.behaviour_correction(algo, old_lp, batch)
        sampled = samples.versions[samples.generated_mask()]   # not a multi-turn episode's observation tokens
        return weights, {**stats, **offpolicy.staleness_record(step, sampled)}

    def log_ratio(self, old_lp, batch) -> torch.Tensor:
        """The exact ``prox - behav`` of every token (``old_lp``: the proximal forward)."""
        return offpolicy.log_ratio(old_lp, batch)

    def state_dict(self) -> dict:
        """The samples generated ahead (after waiting for them): what a resume cannot regenerate."""
        self._wait_all()
        return {STATE_KEY: {"async_steps": self.k, "next_step": self._next,
                            "ready": {s: {"samples": samples_state(x[0]), "stats": x[1], "generate_s": x[2]}
                                      for s, x in sorted(self._ready.items())}}}

    def load_state_dict(self, checkpoint: dict, step: int) -> None:
        """The checkpoint's samples in flight; the run resumes after ``step``."""
        state = checkpoint.get(STATE_KEY)
        expected = list(range(step + 1, step + 1 + self.k))
        held = sorted((state or {}).get("ready", {}))
        if state is None or state.get("async_steps") != self.k or held != expected:
            raise RLAlignError(f"the checkpoint of step {step} holds the samples of steps {held or 'none'} generated "
                               f"ahead, but rollout.async_steps={self.k} needs steps {expected}: resume with the "
                               "run's own rollout.async_steps")
        self._ready = {s: (StepSamples(**x["samples"]), x["stats"], x["generate_s"]) for s, x in state["ready"].items()}
        self._next = state["next_step"]

    def close(self) -> None:
        with self._mailbox:   # a generation waiting for weights that will not come: it ends (aborted)
            self._closed = True
            self._mailbox.notify_all()
        self._pool.shutdown(wait=True, cancel_futures=True)


def rollout_source(cfg, sampler: Sampler, engine, push: Callable[[int], None],
                   snapshot: "Callable[[int], dict] | None" = None) -> RolloutSource:
    """The run's source of samples: generated ahead with ``rollout.async_steps > 0``, else drawn at each step.
    ``snapshot(version)``: a copy of the trainer's weights (partial rollouts hand it to the worker thread)."""
    if cfg.rollout.async_steps:
        return AsynchronousSource(cfg, sampler, engine, push, snapshot)
    return SynchronousSource(sampler, push)


__all__ = ["AsynchronousSource", "RolloutSource", "STATE_KEY", "SynchronousSource", "rollout_source",
           "samples_state"]
