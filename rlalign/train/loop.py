"""The RL loop, single process, colocated: rollout -> rewards -> advantages -> update -> push weights.

Each step takes ``P`` prompts x ``K`` scored samples, weighs every completion token by its sample's advantage (GRPO:
group-normalised rewards) and takes ``algo.ppo_epochs`` passes of one optimizer step per mini-batch on the clipped
surrogate (plus the KL and entropy terms when enabled), every term chosen by name from :mod:`rlalign.algos.registry`.

:meth:`Trainer.train_step` reads linearly, each part in a room of its own: the samples from the run's one
:class:`~rlalign.train.sources.RolloutSource` (chosen at set-up: drawn by :mod:`~rlalign.train.sampling` at the
step's start, or generated ahead), laid out once as a :class:`~rlalign.train.packing.TrainBatch`; the old policy's
log-probs (:func:`~rlalign.train.update.needs_rescore`) checked against the engine's by :mod:`~rlalign.train.agreement`
before any optimizer step; :mod:`~rlalign.train.advantages`, the source's importance weights and
:mod:`~rlalign.train.update`; the new weights version told to the source. Between steps :func:`run_training`
evaluates, logs (:mod:`rlalign.train.run`), checkpoints and decides when to stop (:mod:`~rlalign.train.stall`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
from pathlib import Path

import torch
from rich.console import Console

from rlalign import algos
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import use_profile
from rlalign.distributed.launch import Group, default_backend, spawn
from rlalign.distributed.parallelize import parallelize
from rlalign.models.moe import record_routing, sparse_layer_indices
from rlalign.train import advantages, offpolicy
from rlalign.train.adapters import adapt_policy, step_dropout
from rlalign.train import parallel as par
from rlalign.train.agreement import Agreement, MismatchError, whole_samples
from rlalign.train.budget import refuse_what_cannot_fit
from rlalign.train.checkpointing import TrainingState
from rlalign.train.config import TrainConfig
from rlalign.train.engines import WeightSync, build_rollout_engine, weights_path
from rlalign.train.export import save_run_policy
from rlalign.train.layer_recompute import recompute_layers
from rlalign.train.packing import TrainBatch
from rlalign.train.run.config_file import refuse_reward_in_run_dir, reward_fingerprint, run_inputs, write_run_config
from rlalign.train.run.directory import open_run_dir
from rlalign.train.run.logs import LOGGER, StepReporter, banner_lines, install_cli_handler
from rlalign.train.run.metrics import MetricsWriter, NoMetrics
from rlalign.train.run.trackers import Trackers
from rlalign.train.samples import StepSamples
from rlalign.train.sampling import Sampler
from rlalign.train.setup import SetupError, build_task, load_policy, resolve_model_dir
from rlalign.train.sharding import training_master
from rlalign.train.sources import rollout_source
from rlalign.train.stall import StallWatch, segment_end
from rlalign.train.stepstats import (policy_step_kl, rollout_stats, sample_stats, sampled_logprob_stats, step_costs,
                                     token_stats)
from rlalign.train.update import PolicyUpdate, UpdateInputs, needs_rescore


class Trainer:
    """One training run's objects (policy, engine, task, optimizers, run directory) and its step."""

    def __init__(self, cfg: TrainConfig, console=None):
        self.cfg, self.console = cfg, console
        # parallel.dp/tp (rlalign.train.parallel): tp shards the policy, each dp rank back-propagates a share
        self.tp, self.dp = par.parallel_groups(cfg)
        self.writer = par.is_writer(self.tp, self.dp)
        self.run_dir = Path(par.shared_run_dir(cfg))
        # The writer locks and prepares the run directory before any work (rlalign.train.run.directory): a fresh
        # run needs an empty directory (or run.overwrite), a resume a checkpoint.
        refuse_reward_in_run_dir(cfg)   # before anything is imported or written
        self.run_lock = (open_run_dir(self.run_dir, resume=cfg.run.resume, overwrite=cfg.run.overwrite,
                                      last_step=cfg.run.steps, reads=run_inputs(cfg)) if self.writer else None)
        self.task = None
        try:
            self._build(cfg)
        except BaseException:
            self.close()
            if self.run_lock is not None:
                self.run_lock.abandon()
            raise

    def close(self) -> None:
        """Stop what the trainer started besides itself: the rollout source's worker, the reward worker process."""
        if getattr(self, "source", None) is not None:   # its worker thread may be scoring with the task
            self.source.close()
        if self.task is not None:
            self.task.close()

    def _build(self, cfg: TrainConfig) -> None:
        self.device = torch.device(cfg.model.device)
        refuse_what_cannot_fit(cfg, resolve_model_dir(cfg.model.path))   # one line before any weight is loaded
        self.policy, self.tokenizer, self.model_dir = load_policy(cfg.model)
        self.lora = adapt_policy(self.policy, cfg)   # model.lora: adapters before the engine and optimizer see it
        self.moe = bool(sparse_layer_indices(self.policy.config))   # Qwen3-MoE and gpt-oss
        if cfg.algo.router_aux_coef > 0 and not self.moe:
            raise SetupError(f"algo.router_aux_coef={cfg.algo.router_aux_coef} has no effect: the model has no "
                             "mixture-of-experts layers; remove algo.router_aux_coef")
        offpolicy.check_setup(cfg)
        self.task = build_task(cfg.task, self.tokenizer, cfg.run.seed, cfg.model.device)
        reward_file = reward_fingerprint(cfg.task.reward)   # recorded with every checkpoint
        # shared (the engine steps the policy's own tensors) or a copy synced each step: rlalign.train.engines
        path = weights_path(cfg)
        self.engine = build_rollout_engine(cfg, self.policy, self.tokenizer, self.model_dir, share_weights=path.shared)
        self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False) if cfg.algo.kl_coef > 0 else None
        value_model = algos.ADVANTAGES[cfg.algo.advantage].value_model
        if self.tp is not None:
            if value_model:
                raise SetupError("parallel.tp does not support the PPO value model (algo.advantage=gae) yet")
            self.policy = parallelize(self.policy, self.tp)   # the engine and ref keep unsharded copies
        if cfg.optim.activation_checkpointing:   # before the master: parallel.shard=params hooks the layers it finds
            recompute_layers(self.policy)
        self.master = training_master(cfg, self.policy, self.dp)   # whole, or each dp rank's ranges (parallel.shard)
        self.weight_sync = WeightSync(self.engine, self.policy, path)
        self.update = PolicyUpdate(cfg, self.policy, self.master, self.dp, self.moe, value_model)
        self.state = TrainingState(cfg, self.policy, self.master, self.update, self.tp, reward_file)
        self.sampler = Sampler(cfg, self.task, self.tokenizer, self.engine, self.dp)
        self.agreement = Agreement(cfg.run.profile, cfg.run.on_mismatch, sparse_layer_indices(self.policy.config))
        # where the steps' samples come from, chosen once: drawn at each step, or generated ahead (async_steps > 0)
        self.source = rollout_source(cfg, self.sampler, self.engine, self._push, self._snapshot)
        self.verifier = offpolicy.behaviour_verifier(cfg, self.policy)   # run.verify_behaviour
        self.step = 0
        self.trackers, self.config_path = None, self.run_dir / "config.yaml"

    # ---- the run's files and state ---------------------------------------------------------------------

    def resume_if_asked(self) -> None:
        """Open metrics.jsonl, and with ``run.resume`` load the last checkpoint (the run directory was
        locked and checked in ``__init__``)."""
        if self.run_lock is not None and self.run_lock.removed:
            self._note(f"removed leftovers of an interrupted run: {', '.join(self.run_lock.removed)}")
        state = self.state.load_latest(self.run_dir) if self.cfg.run.resume else None   # its config checked
        if self.writer:   # config.yaml (what this run runs under) and the trackers
            write_run_config(self.run_dir, self.cfg)
            self.trackers = Trackers(self.run_dir, self.cfg, start_step=self.step)
        if state is not None:
            self.step, self.sampler.data_pos = self.state.restore(state)
            self._push(self.step)  # version = optimizer steps
            self.source.load_state_dict(state, self.step)
            if self.verifier is not None:
                self.verifier.load_state_dict(state)
        resumed = self.step if state is not None else None   # metrics.jsonl keeps the records through it
        self.metrics = MetricsWriter(self.run_dir, resume_after_step=resumed) if self.writer else NoMetrics()
        self._note(getattr(self.metrics, "note", None))

    def _note(self, text: "str | None") -> None:
        if text and self.console is not None:
            self.console.print(f"note: {text}")

    def log_record(self, record: dict) -> None:
        """One metrics record: metrics.jsonl (always) and the run.loggers trackers."""
        self.metrics.write(record)
        if self.trackers is not None:
            self.trackers.log(record)

    def _push(self, version: int) -> None:
        """The engine at the policy's current weights, as ``version`` (and the verifier's snapshot of them); the
        weights are gathered once, and only where something reads them."""
        weights = functools.cache(lambda: par.policy_weights(self.policy))
        self.weight_sync.push(weights, version=version)
        shards = par.weight_shards(self.policy)
        if shards is not None:   # parallel.shard=params: ranges only between steps (run.policy_kl's pass gathered some)
            shards.release_all()
        if self.verifier is not None:
            self.verifier.remember(version, weights())

    def _snapshot(self, version: int) -> dict:
        """A copy of the policy's full weights, ``version`` (and the verifier's snapshot of them): what the rollout
        worker switches to with partial rollouts (rlalign.train.sources)."""
        weights = {name: t.detach().clone() for name, t in par.policy_weights(self.policy).items()}
        if self.verifier is not None:
            self.verifier.remember(version, weights)
        return weights

    def save(self) -> None:
        extra = self.source.state_dict()   # first: waiting for the samples generated ahead settles the data position
        if self.verifier is not None:   # the versions that sampled them, for run.verify_behaviour after a resume
            extra.update(self.verifier.state_dict(self.step, self.cfg.rollout.async_steps))
        self.state.save(self.run_dir, self.writer, self.step, self.sampler.data_pos, extra)

    def save_policy(self) -> Path:
        """The trained policy as a Hugging Face model folder, ``policy/`` (and ``adapter/`` for a LoRA run)."""
        policy = par.unsharded_policy(self.policy)   # every rank joins the gather; the writer writes
        if not self.writer:
            return self.run_dir / "policy"
        return save_run_policy(policy, self.lora, self.run_dir, self.model_dir)

    # ---- one step --------------------------------------------------------------------------------

    def needs_rescore(self) -> bool:
        """Whether the old policy's log-probs need a forward of their own (:func:`rlalign.train.update.needs_rescore`),
        or, with samples generated ahead (``rollout.async_steps``), the proximal policy's: they weigh the behaviour
        log-probs before the update (rlalign.train.offpolicy)."""
        return needs_rescore(self.cfg, self.dp) or not self.source.on_policy

    def train_batch(self, samples: StepSamples) -> TrainBatch:
        """The step's :class:`TrainBatch` (layout, mask, rollout log-probs), built once."""
        cfg = self.cfg
        batch = TrainBatch.build(samples, max_tokens=cfg.optim.micro_batch_tokens, mini_batches=cfg.algo.mini_batches,
                                 device=self.policy.device)
        if cfg.algo.overlong_filter:
            truncated = samples.truncated.to(batch.mask.device)
            batch = batch.with_mask(algos.overlong_filter(batch.mask, batch.seq_ids, truncated))
        return batch

    def train_step(self, step: int) -> dict:
        """One step: the source's samples; the old policy's log-probs, checked against the engine's; advantages and
        the update; the engine's weights pushed; the step's record."""
        cfg, t0 = self.cfg, time.perf_counter()
        with use_profile(cfg.run.profile):
            with self._rollout_weights():
                samples, sampling_stats = self.source.next_step(step)   # generated ahead: the wait is time/rollout_s
            t_rollout, t1 = time.perf_counter() - t0, time.perf_counter()
            batch, record = self.train_batch(samples), {"step": step}
            old = self._old_policy(step, samples, batch, record)
            temp, scoring = cfg.rollout.logprob_temperature, cfg.rollout.sampled_scoring
            ref_lp = batch.score(self.ref, temperature=temp)[0] if self.ref is not None else None
            kl_reward = advantages.kl_in_reward(cfg.algo, old["lp"], ref_lp, batch)
            token_adv, value_targets = advantages.token_advantages(cfg.algo, samples, batch, kl_reward,
                                                                   self.update.value,
                                                                   self.source.log_ratio(old["lp"], batch))
            is_weights, corr_stats = self.source.correction(cfg.algo, old["lp"], batch, step, samples)

            def first_pass(lp, ent, routing_ids):   # strict, no rescore: the first update pass's forward is the old policy's
                old.update(lp=lp, ent=ent)
                record.update(self._agreement(step, lp, routing_ids, samples, batch))

            inputs = UpdateInputs(old["lp"], token_adv, None if kl_reward is not None else ref_lp, is_weights,
                                  value_targets)
            with step_dropout(self.lora, cfg.run.seed, step):   # adapter dropout (native): masks seeded by the step
                update = self.update.run(self.step, batch, inputs, first_pass,
                                         keep_routing=self.moe and samples.has_routing)
            if cfg.run.policy_kl:   # the updated policy on the samples its predecessor drew
                update["kl/policy_step"] = policy_step_kl(
                    old["lp"], batch.score(self.policy, temperature=temp, sampled=scoring)[0], batch.mask)
        t_train = time.perf_counter() - t1
        self.source.push_weights(step)
        lens, rewards = batch.completion_lens, samples.reward_tensor()
        with use_profile(cfg.run.profile):   # the logged statistics' reductions (the portable profile's fixed order)
            record.update({**sample_stats(rewards, samples.truncated, lens, old["ent"]), **sampling_stats,
                           **step_costs(t_rollout, t_train, int(lens.sum()), self.device, self.source.engine_version(),
                                        self.weight_sync.copy_bytes), **update, **corr_stats,
                           **rollout_stats(rewards, samples.group_tensor(), lens),
                           **token_stats(token_adv, batch.mask, old["lp"], ref_lp)})
        return record

    def _old_policy(self, step: int, samples: StepSamples, batch: TrainBatch, record: dict) -> dict:
        """The old policy's log-probs and entropies (``lp``, ``ent``: None until the first update pass supplies them
        when no rescore is needed), checked against the engine's before any optimizer step into ``record``."""
        temp, scoring = self.cfg.rollout.logprob_temperature, self.cfg.rollout.sampled_scoring
        if scoring is not None:   # logprobs=sampled: kept-set and full-softmax log-probs before the update
            scored = batch.score_sampled(self.policy, scoring)
            record.update(sampled_logprob_stats(scored.logprob, scored.full_logprob, scored.kept, batch.mask))
        old = {"lp": None, "ent": None}
        if self.needs_rescore():
            compare_routing = self.moe and samples.has_routing
            with record_routing(keep_logits=False) if compare_routing else contextlib.nullcontext() as routing:
                old["lp"], old["ent"] = batch.score(self.policy, temperature=temp, with_entropy=True, sampled=scoring)
            routing_ids = routing.expert_ids() if compare_routing else None
            record.update(self._agreement(step, old["lp"], routing_ids, samples, batch))
        if self.verifier is not None:   # the engine's log-probs against the recorded version's trainer forward
            self.verifier.forget_before(offpolicy.behaviour_version(step, self.cfg.rollout.async_steps))
            record.update(self.verifier.check(step, samples.versions, batch, routing=self.moe and samples.has_routing))
        return old

    def _agreement(self, step: int, old_lp: torch.Tensor, routing_ids: "torch.Tensor | None", samples: StepSamples,
                   batch: TrainBatch) -> dict:
        """The step's agreement checks, before any optimizer step: log-probs (of the tokens the source says the
        current weights sampled), and the routing (the forward's expert ids) where both sides recorded it."""
        fresh = self.source.fresh_mask(samples, step)
        record = self.agreement.check_logprobs(step, old_lp, batch, fresh)
        if self.moe and samples.has_routing:   # the samples the current weights drew (all, synchronously)
            record.update(self.agreement.check_routing(step, routing_ids, samples, whole_samples(fresh, samples)))
        return record

    def evaluate(self) -> dict:
        """Held-out accuracy (:meth:`rlalign.train.sampling.Sampler.evaluate`), by the trainer's current weights."""
        self.source.quiesce(self.step)
        with self._rollout_weights():
            return self.sampler.evaluate()

    def _rollout_weights(self):
        """Where the engine reads the policy's own tensors and parallel.shard=params keeps them in ranges: the whole
        weights gathered in place for the rollout and released after it (rlalign.train.weight_shards)."""
        shards = par.weight_shards(self.policy)
        return shards.whole() if shards is not None and self.weight_sync.shared else contextlib.nullcontext()


def run_training(cfg: TrainConfig, console=None) -> Path:
    """Run (or resume) the whole job; returns the run directory."""
    if par.needs_launch(cfg):   # parallel.dp/tp > 1 without torchrun: spawn the processes
        return launch_parallel(cfg)
    if console is not None:   # spawned ranks do not inherit the CLI's handler
        install_cli_handler(console)
    trainer = Trainer(cfg, console)
    try:
        trainer.resume_if_asked()   # a refused resume releases the run directory too
        _train_to_end(trainer, cfg, console)
        trainer.save_policy()
    finally:
        trainer.close()
        if trainer.run_lock is not None:
            trainer.run_lock.release()
    return trainer.run_dir


def _train_to_end(trainer: Trainer, cfg: TrainConfig, console) -> None:
    """The steps from the trainer's to run.steps (or an earlier stop), each evaluated, logged and saved on cue."""
    if trainer.writer:
        for line in banner_lines(cfg, trainer.run_dir, trainer.config_path, trainer.model_dir, trainer.policy,
                                 trainer.step, trainer.weight_sync.path.describe()):
            LOGGER.info(line)
    progress = StepReporter(cfg, console if trainer.writer else None, trainer.step)
    stall = StallWatch(cfg.run.stop_when_stalled)
    started = time.perf_counter()
    try:
        if trainer.step == 0:
            trainer.log_record({"step": 0, **trainer.evaluate()})
        step_started = time.perf_counter()
        while trainer.step < cfg.run.steps:
            step = trainer.step + 1
            record = trainer.train_step(step)
            trainer.step = step
            last = step == cfg.run.steps
            if step % cfg.run.eval_every == 0 or last:
                record.update(trainer.evaluate())
            trainer.log_record(record)
            saves = cfg.run.save_checkpoints
            saved_now = saves and (step % cfg.run.checkpoint_every == 0 or last)
            if saved_now:
                trainer.save()
            if trainer.writer:
                progress.update(record)
            warning = stall.update(record)
            if warning and trainer.writer:
                LOGGER.warning(warning)
            now = time.perf_counter()
            stalled = stall.stop_reason()
            stop = stalled or segment_end(cfg.run, step, now - started, now - step_started)
            step_started = now
            if stop and not last:
                if saves and not saved_now:   # a checkpoint is never written twice for one step
                    trainer.save()
                progress.note(f"stopping at step {step}: {stop} " + (
                    "(the run ends here)" if stalled else "(resume with run.resume=true)" if saves else
                    "(run.save_checkpoints=false: no checkpoint, the run cannot be resumed)"))
                break
    finally:
        progress.close()
        if trainer.trackers is not None:
            trainer.trackers.close()


def _parallel_rank(world: Group, cfg: TrainConfig) -> str:
    """One spawned process of a parallel run: the ordinary loop (rank 0 shows the progress)."""
    return str(run_training(cfg, Console(stderr=True) if world.rank == 0 else None))


def launch_parallel(cfg: TrainConfig) -> Path:
    """Spawn ``parallel.dp * parallel.tp`` training processes; returns the run directory when they finish."""
    if cfg.launcher != "local":
        raise RLAlignError(f"parallel.dp/tp > 1 run with launcher=local (got launcher={cfg.launcher})")
    par.check_parallel_device(cfg)
    run = dataclasses.replace(cfg.run, dir=cfg.run.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = dataclasses.replace(cfg, run=run)
    return Path(spawn(_parallel_rank, cfg.parallel.world_size, cfg, backend=default_backend(cfg.model.device))[0])


__all__ = ["Trainer", "run_training", "launch_parallel", "MismatchError"]
