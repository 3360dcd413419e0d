"""The RL loop, single process, colocated: rollout -> rewards -> advantages -> update -> push weights.

Each step draws ``P`` prompts x ``K`` samples from the rollout engine, scores them, weighs every completion token
by its sample's advantage (GRPO: group-normalised rewards) and takes ``algo.ppo_epochs`` passes of one optimizer
step per mini-batch on the clipped surrogate (plus the KL and entropy terms when enabled): every term a function
of :mod:`rlalign.algos`, chosen by name from :mod:`rlalign.algos.registry` (the objective: docs/training.md).

This module keeps the loop; each part of a step has a room of its own (:meth:`Trainer.train_step`):
:mod:`~rlalign.train.sampling` draws the step's samples (DAPO's redraws included) into one
:class:`~rlalign.train.samples.StepSamples` (tensors), laid out once as a :class:`~rlalign.train.packing.TrainBatch`;
the old policy's log-probs are the trainer's own forward on the sampled tokens before the update (in the strict
profile with one mini-batch the first update pass's, :func:`~rlalign.train.update.needs_rescore`), compared with
the engine's on every token, and MoE routing on every row, by :mod:`~rlalign.train.agreement` before any optimizer
step; :mod:`~rlalign.train.advantages` weighs the tokens; :mod:`~rlalign.train.update` runs the loss terms,
accumulation, optimizer steps and lr schedule. Between steps :func:`run_training` evaluates, logs
(:mod:`rlalign.train.run`), checkpoints (:mod:`~rlalign.train.checkpointing`) and decides when to stop.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from pathlib import Path

import torch
from rich.console import Console

from rlalign import algos
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import use_profile
from rlalign.distributed.launch import Group, default_backend, spawn
from rlalign.distributed.parallelize import parallelize
from rlalign.models.checkpoint import save_model
from rlalign.models.moe import record_routing, sparse_layer_indices
from rlalign.train import advantages, offpolicy
from rlalign.train.adapters import adapt_policy, exportable, save_run_adapter, step_dropout
from rlalign.train import parallel as par
from rlalign.train.agreement import Agreement, MismatchError
from rlalign.train.checkpointing import TrainingState
from rlalign.train.config import TrainConfig
from rlalign.train.engines import WeightSync, build_rollout_engine, weights_path
from rlalign.train.layer_recompute import recompute_layers
from rlalign.train.master import MasterWeights
from rlalign.train.packing import TrainBatch
from rlalign.train.run.config_file import refuse_reward_in_run_dir, reward_fingerprint, run_inputs, write_run_config
from rlalign.train.run.directory import open_run_dir
from rlalign.train.run.logs import LOGGER, StepReporter, banner_lines, install_cli_handler
from rlalign.train.run.metrics import MetricsWriter, NoMetrics
from rlalign.train.run.trackers import Trackers
from rlalign.train.samples import StepSamples
from rlalign.train.sampling import Sampler
from rlalign.train.setup import SetupError, build_task, load_policy
from rlalign.train.sharding import ShardedMaster
from rlalign.train.stall import StallWatch
from rlalign.train.stepstats import (peak_memory_mb, policy_step_kl, rollout_stats, sample_stats, sampled_logprob_stats,
                                     token_stats)
from rlalign.train.update import PolicyUpdate, UpdateInputs, needs_rescore


EXPORT_SHARD_BYTES = 5 * 2**30


class Trainer:
    """One training run's objects (policy, engine, task, optimizers, run directory) and its step."""

    def __init__(self, cfg: TrainConfig, console=None):
        self.cfg = cfg
        self.console = console
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
        """Stop what the trainer started besides itself: the reward worker process (idempotent)."""
        if getattr(self, "pipeline", None) is not None:   # its worker thread may be scoring with the task
            self.pipeline.close()
        if self.task is not None:
            self.task.close()

    def _build(self, cfg: TrainConfig) -> None:
        self.device = torch.device(cfg.model.device)
        self.policy, self.tokenizer, self.model_dir = load_policy(cfg.model)
        self.lora = adapt_policy(self.policy, cfg)   # model.lora: adapters before the engine and optimizer see it
        self.moe = self.policy.config.ffn_kind == "moe"
        if cfg.algo.router_aux_coef > 0 and not self.moe:
            raise SetupError(f"algo.router_aux_coef={cfg.algo.router_aux_coef} has no effect: the model has no "
                             "mixture-of-experts layers; remove algo.router_aux_coef")
        offpolicy.check_setup(cfg, self.moe)
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
        # low-precision weights train against fp32 masters (rlalign.train.master); fp32 ones are stepped as before
        # parallel.shard=grads: each dp rank holds the masters and AdamW state of its range (rlalign.train.sharding)
        self.master = (ShardedMaster(self.policy, self.dp, cfg.optim.master_weights, cfg.optim.step_chunk_elements)
                       if cfg.parallel.shard == "grads" else
                       MasterWeights(self.policy, cfg.optim.master_weights, cfg.optim.offload,
                                     cfg.optim.step_chunk_elements))
        self.weight_sync = WeightSync(self.engine, self.policy, path)
        self.update = PolicyUpdate(cfg, self.policy, self.master, self.dp, self.moe, value_model)
        self.state = TrainingState(cfg, self.policy, self.master, self.update, self.tp, reward_file)
        self.sampler = Sampler(cfg, self.task, self.tokenizer, self.engine, self.dp)
        self.agreement = Agreement(cfg.run.profile, cfg.run.on_mismatch, sparse_layer_indices(self.policy.config))
        # rollout.async_steps > 0: samples generated ahead in a worker thread (rlalign.train.offpolicy); 0: none
        self.pipeline = (offpolicy.AsyncRollout(cfg, self.sampler, self.engine, self._push)
                         if cfg.rollout.async_steps else None)
        self.verifier = (offpolicy.BehaviourVerifier(self.policy, cfg.rollout.logprob_temperature,
                                                     cfg.run.profile == "strict", cfg.run.on_mismatch,
                                                     sampled=cfg.rollout.sampled_scoring)
                         if cfg.run.verify_behaviour else None)
        if self.verifier is not None:
            self.verifier.remember(0, par.policy_weights(self.policy))
        self.step = 0
        self.trackers, self.config_path = None, self.run_dir / "config.yaml"
        if cfg.optim.activation_checkpointing:
            recompute_layers(self.policy)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.update.optimizer

    @property
    def value_optimizer(self) -> "torch.optim.Optimizer | None":
        return self.update.value_optimizer

    # ---- the run's files and state ---------------------------------------------------------------------

    def resume_if_asked(self) -> None:
        """Open metrics.jsonl, and with ``run.resume`` load the last checkpoint (the run directory was
        locked and checked in ``__init__``)."""
        if self.run_lock is not None and self.run_lock.removed:
            self._note(f"removed leftovers of an interrupted run: {', '.join(self.run_lock.removed)}")
        state = self.state.load_latest(self.run_dir) if self.cfg.run.resume else None   # its config checked
        self._start_run_files()
        if state is None:
            self.metrics = MetricsWriter(self.run_dir) if self.writer else NoMetrics()
            return
        self.step, self.sampler.data_pos = self.state.restore(state)
        self._push(self.step)  # version = optimizer steps
        if self.pipeline is not None:
            self.pipeline.load_state_dict(state.get(offpolicy.STATE_KEY), self.step)
        if self.verifier is not None:
            self.verifier.snapshots.update(state.get(offpolicy.SNAPSHOTS_KEY) or {})
        self.metrics = MetricsWriter(self.run_dir, resume_after_step=self.step) if self.writer else NoMetrics()
        self._note(getattr(self.metrics, "note", None))

    def _note(self, text: "str | None") -> None:
        if text and self.console is not None:
            self.console.print(f"note: {text}")

    def _start_run_files(self) -> None:
        """config.yaml (what this run runs under) and the trackers; the writer rank only."""
        if self.writer:
            write_run_config(self.run_dir, self.cfg)
            self.trackers = Trackers(self.run_dir, self.cfg, start_step=self.step)

    def log_record(self, record: dict) -> None:
        """One metrics record: metrics.jsonl (always) and the run.loggers trackers."""
        self.metrics.write(record)
        if self.trackers is not None:
            self.trackers.log(record)

    def _push(self, version: int) -> None:
        """The engine at the policy's current weights, as ``version`` (and the verifier's snapshot of them)."""
        weights = lambda: par.policy_weights(self.policy)  # noqa: E731
        self.weight_sync.push(weights, version=version)
        if self.verifier is not None:
            self.verifier.remember(version, weights())

    def save(self) -> None:
        # the samples generated ahead first: waiting for them settles the data position
        extra = {offpolicy.STATE_KEY: self.pipeline.state_dict()} if self.pipeline is not None else {}
        if self.verifier is not None:   # the versions that sampled them, for run.verify_behaviour after a resume
            extra[offpolicy.SNAPSHOTS_KEY] = self.verifier.needed_after(self.step, self.cfg.rollout.async_steps)
        self.state.save(self.run_dir, self.writer, self.step, self.sampler.data_pos, extra)

    def save_policy(self) -> Path:
        policy = par.unsharded_policy(self.policy)
        if not self.writer:
            return self.run_dir / "policy"
        if self.lora is not None:   # the adapters alone (PEFT's format) next to the merged policy
            save_run_adapter(policy, self.lora, self.run_dir / "adapter", base_model=str(self.model_dir))
            policy = exportable(policy)
        # shards of at most 5 GiB (hashed in parallel): an 8B export is 4 files, a small model's one model.safetensors
        # policy/ is replaced whole (tokenizer files included) and only when it holds a saved model's files alone
        return save_model(policy, self.run_dir / "policy", max_shard_bytes=EXPORT_SHARD_BYTES,
                          tokenizer_from=self.model_dir)

    # ---- one step --------------------------------------------------------------------------------

    def needs_rescore(self) -> bool:
        """Whether the old policy's log-probs need a forward of their own (:func:`rlalign.train.update.needs_rescore`),
        or, with samples generated ahead (``rollout.async_steps``), the proximal policy's: they weigh the behaviour
        log-probs before the update (rlalign.train.offpolicy)."""
        return needs_rescore(self.cfg, self.dp) or self.pipeline is not None

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
        cfg, t0 = self.cfg, time.perf_counter()
        with use_profile(cfg.run.profile):
            if self.pipeline is None:
                samples, sampling_stats = self.sampler.draw_step(step)
            else:   # generated ahead; time/rollout_s is then the wait for them
                samples, sampling_stats, generated = self.pipeline.draw_step(step)
                sampling_stats = {**sampling_stats, **generated}
            t_rollout = time.perf_counter() - t0
            t1 = time.perf_counter()
            temp, scoring = cfg.rollout.logprob_temperature, cfg.rollout.sampled_scoring
            batch = self.train_batch(samples)
            record = {"step": step}
            if scoring is not None:   # logprobs=sampled: kept-set and full-softmax log-probs before the update
                scored = batch.score_sampled(self.policy, scoring)
                record.update(sampled_logprob_stats(scored.logprob, scored.full_logprob, scored.kept, batch.mask))
            compare_routing = self.moe and samples.has_routing
            old = {"lp": None, "ent": None}   # the old policy's log-probs and entropies
            if self.needs_rescore():
                with record_routing(keep_logits=False) if compare_routing else contextlib.nullcontext() as routing:
                    old["lp"], old["ent"] = batch.score(self.policy, temperature=temp, with_entropy=True, sampled=scoring)
                routing_ids = routing.expert_ids() if compare_routing else None
                record.update(self._agreement(step, old["lp"], routing_ids, samples, batch, compare_routing))
            if self.verifier is not None:   # the engine's log-probs against the recorded version's trainer forward
                self.verifier.forget_before(offpolicy.behaviour_version(step, cfg.rollout.async_steps))
                record.update(self.verifier.check(step, samples.versions, batch))
            ref_lp = batch.score(self.ref, temperature=temp)[0] if self.ref is not None else None
            kl_reward = advantages.kl_in_reward(cfg.algo, old["lp"], ref_lp, batch)
            token_adv, value_targets = advantages.token_advantages(cfg.algo, samples, batch, kl_reward,
                                                                   self.update.value)
            if self.pipeline is None:
                is_weights, corr_stats = advantages.mismatch_correction(cfg.algo, old["lp"], batch)
            else:   # decoupled PPO: the behaviour weights exp(prox - behav), bounded by algo.mismatch_correction
                is_weights, corr_stats = offpolicy.behaviour_correction(cfg.algo, old["lp"], batch)
                corr_stats.update(offpolicy.staleness_record(step, samples.versions))

            def first_pass(lp, ent, routing_ids):   # strict, no rescore: the first update pass's forward is the old policy's
                old.update(lp=lp, ent=ent)
                record.update(self._agreement(step, lp, routing_ids, samples, batch, compare_routing))

            inputs = UpdateInputs(old["lp"], token_adv, None if kl_reward is not None else ref_lp, is_weights,
                                  value_targets)
            with step_dropout(self.lora, cfg.run.seed, step):   # adapter dropout (native): masks seeded by the step
                update = self.update.run(self.step, batch, inputs, first_pass, keep_routing=compare_routing)
            if cfg.run.policy_kl:   # the updated policy on the samples its predecessor drew
                update["kl/policy_step"] = policy_step_kl(
                    old["lp"], batch.score(self.policy, temperature=temp, sampled=scoring)[0], batch.mask)
        t_train = time.perf_counter() - t1
        if self.pipeline is None:   # asynchronous: the pipeline pushes when no generation runs
            self._push(step)
        lens, rewards = batch.completion_lens, samples.reward_tensor()
        record.update({**sample_stats(rewards, samples.truncated, lens, old["ent"]), **sampling_stats,
                       **self._costs(t_rollout, t_train, int(lens.sum())), **update, **corr_stats,
                       **rollout_stats(rewards, samples.group_tensor(), lens),
                       **token_stats(token_adv, batch.mask, old["lp"], ref_lp)})
        return record

    def _agreement(self, step: int, old_lp: torch.Tensor, routing_ids: "torch.Tensor | None", samples: StepSamples,
                   batch: TrainBatch, compare_routing: bool) -> dict:
        """The step's agreement checks, before any optimizer step: log-probs, and the routing (the forward's expert
        ids) where both sides recorded it."""
        fresh = (None if self.pipeline is None     # asynchronous: only the tokens the current weights sampled
                 else offpolicy.fresh_mask(samples.versions, step - 1))
        record = self.agreement.check_logprobs(step, old_lp, batch, fresh)
        if compare_routing:
            record.update(self.agreement.check_routing(step, routing_ids, samples))
        return record

    def _costs(self, t_rollout: float, t_train: float, n_tokens: int) -> dict:
        """The step's time, throughput and memory, and the engine's weights version."""
        return {"time/rollout_s": t_rollout, "time/train_s": t_train,
                "tokens_per_s/rollout": n_tokens / max(t_rollout, 1e-9),
                "memory/peak_mb": peak_memory_mb(self.device), "weights_version": self.engine.weights_version,
                "memory/engine_weight_copy_mb": self.weight_sync.copy_bytes / 2**20}   # 0: the engine shares the policy's

    def evaluate(self) -> dict:
        """Held-out accuracy (:meth:`rlalign.train.sampling.Sampler.evaluate`), by the trainer's current weights."""
        if self.pipeline is not None:
            self.pipeline.quiesce(self.step)
        return self.sampler.evaluate()


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


def _log_banner(trainer: Trainer, cfg: TrainConfig) -> None:
    for line in banner_lines(cfg, trainer.run_dir, trainer.config_path, trainer.model_dir,
                             sum(p.numel() for p in trainer.policy.parameters()),
                             str(next(trainer.policy.parameters()).dtype).removeprefix("torch."), trainer.step):
        LOGGER.info(line)
    LOGGER.info(f"  weights  {trainer.weight_sync.path.describe()}")


def _train_to_end(trainer: Trainer, cfg: TrainConfig, console) -> None:
    """The steps from the trainer's to run.steps (or an earlier stop), each evaluated, logged and saved on cue."""
    if trainer.writer:
        _log_banner(trainer, cfg)
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
            stop = stalled or _segment_end(cfg.run, step, now - started, now - step_started)
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


def _segment_end(run, step: int, elapsed_s: float, step_s: float = 0.0) -> "str | None":
    """Why this invocation ends after ``step`` before run.steps (a checkpoint is saved first), or None:
    ``run.stop_at_step`` reached (the schedule still spans run.steps: a resume continues the same run), or
    ``run.max_minutes`` reached -- or about to be: the next step, estimated to take as long as this one
    (``step_s``, its eval included), would end past it (a GPU job's wall-clock limit must not cut a step)."""
    if run.stop_at_step is not None and step >= run.stop_at_step:
        return f"run.stop_at_step={run.stop_at_step} reached"
    if run.max_minutes and elapsed_s / 60 > run.max_minutes:
        return f"run.max_minutes={run.max_minutes} reached"
    if run.max_minutes and (elapsed_s + step_s) / 60 > run.max_minutes:
        return (f"run.max_minutes={run.max_minutes}: another step (~{step_s:.0f} s, as long as the last) "
                f"would end past it")
    return None


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
