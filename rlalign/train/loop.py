"""The RL loop, single process, colocated: rollout -> rewards -> advantages -> update -> push weights.

Objective (GRPO defaults; every term is a function of :mod:`rlalign.algos`, chosen by name from
:mod:`rlalign.algos.registry`, with its exact formula): for each step, ``P`` prompts x ``K`` samples
are drawn from the rollout engine at temperature ``T``; each sample gets a scalar reward; the
advantage of sample i is group-normalised (``(r_i - mean_g) / (std_g + eps)``, unbiased std;
``dr_grpo`` drops the std); every completion token carries its sample's advantage. The loss is the
clipped surrogate ``max(-A r_t, -A clamp(r_t, 1 - clip_low, 1 + clip_high))`` with
``r_t = exp(logp_t - logp_old_t)``, aggregated by ``algo.loss_agg`` with the normaliser of the
mini-batch (so the gradient does not depend on how it is cut into micro-batches), plus
``kl_coef * KL_k(pi || ref)`` and ``- entropy_coef * H`` when enabled. Each of ``algo.ppo_epochs``
passes takes one optimizer step per mini-batch (``algo.mini_batches``).

The step's data is one :class:`~rlalign.train.packing.TrainBatch`, laid out once. ``logp_old`` is
the trainer's own forward on the sampled tokens before the update. In the strict profile with one
mini-batch it is the first update pass's forward (detached; :meth:`Trainer.needs_rescore`), which
also gives the logged entropy; otherwise a no-grad forward before the update. Either way it equals
the rollout engine's logprobs bit for bit in the strict profile; every step compares the two on
every token, before any optimizer step, and logs ``mismatch/*``. In the native profile they differ,
and ``algo.mismatch_correction`` (TIS / MIS) can correct for it.

MoE models: the same forward's routing (the experts each row was sent to) is compared with the rollout
engine's (``Completion.routing``) on every row both computed, and logged as ``moe/routing_*``; in the
strict profile a differing top-k set is a mismatch like a differing logprob (:meth:`Trainer._check_routing`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import resource
import time
from pathlib import Path

import torch
from rich.console import Console

from rlalign import algos
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import use_profile
from rlalign.distributed.data_parallel import all_reduce_gradients_, shard_for_rank, sum_scalars
from rlalign.distributed.launch import Group, default_backend, spawn
from rlalign.distributed.parallelize import parallelize
from rlalign.models.checkpoint import save_model
from rlalign.models.moe import record_routing, sparse_layer_indices
from rlalign.ops.sample import derive_seed
from rlalign.rollout.config import SamplingParams
from rlalign.train import parallel as par
from rlalign.train.config import TrainConfig
from rlalign.train.dp_rollout import generate_sharded
from rlalign.train.engines import WeightSync, build_rollout_engine, weights_path
from rlalign.train.master import ROUNDED_KEY, MasterWeights, full_masters, weights_to_store
from rlalign.train.packing import TrainBatch, logprobs
from rlalign.train.run.checkpoint_files import load_latest_checkpoint, save_checkpoint
from rlalign.train.run.config_file import check_resume, refuse_reward_in_run_dir, reward_fingerprint, write_run_config
from rlalign.train.run.directory import open_run_dir
from rlalign.train.run.logs import LOGGER, StepReporter, banner_lines, install_cli_handler
from rlalign.train.run.metrics import MetricsWriter, NoMetrics
from rlalign.train.run.trackers import Trackers
from rlalign.train.samples import StepSamples
from rlalign.train.setup import SetupError, build_task, load_policy
from rlalign.train.stall import StallWatch
from rlalign.train.stepstats import policy_step_kl, rollout_stats, token_stats
from rlalign.train.value import ValueModel


EXPORT_SHARD_BYTES = 5 * 2**30


class MismatchError(RLAlignError):
    pass


class Trainer:
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
                                      last_step=cfg.run.steps) if self.writer else None)
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
        if self.task is not None:
            self.task.close()

    def _build(self, cfg: TrainConfig) -> None:
        self.device = torch.device(cfg.model.device)
        self.policy, self.tokenizer, self.model_dir = load_policy(cfg.model)
        self.moe = self.policy.config.ffn_kind == "moe"
        self.sparse_layers = sparse_layer_indices(self.policy.config)
        if cfg.algo.router_aux_coef > 0 and not self.moe:
            raise SetupError(f"algo.router_aux_coef={cfg.algo.router_aux_coef} has no effect: the model has no "
                             "mixture-of-experts layers; remove algo.router_aux_coef")
        self.task = build_task(cfg.task, self.tokenizer, cfg.run.seed)
        self.reward_file = reward_fingerprint(cfg.task.reward)   # recorded with every checkpoint
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
        self.master = MasterWeights(self.policy, cfg.optim.master_weights, cfg.optim.offload,
                                    cfg.optim.step_chunk_elements)
        self.weight_sync = WeightSync(self.engine, self.policy, path)
        self.optimizer = torch.optim.AdamW(self.master.optim_params(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                           weight_decay=cfg.optim.weight_decay, foreach=False)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.value = self.value_optimizer = None
        if value_model:
            self.value = ValueModel(self.policy)
            self.value_optimizer = torch.optim.AdamW(self.value.parameters(), lr=cfg.algo.value_lr, foreach=False)
        self.step = 0
        self.data_pos = 0
        self.trackers, self.config_path = None, self.run_dir / "config.yaml"
        if cfg.optim.activation_checkpointing:
            _checkpoint_layers(self.policy)

    # ---- setup ---------------------------------------------------------------------------------

    def _lr_factor(self, step: int) -> float:
        """Linear warmup over ``warmup_steps``, then cosine down to ``min_lr_ratio`` at ``run.steps``."""
        o, total = self.cfg.optim, max(self.cfg.run.steps, 1)
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        progress = min((step - o.warmup_steps) / max(total - o.warmup_steps, 1), 1.0)
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def resume_if_asked(self) -> None:
        """Open metrics.jsonl, and with ``run.resume`` load the last checkpoint (the run directory was
        locked and checked in ``__init__``)."""
        if self.run_lock is not None and self.run_lock.removed:
            self._note(f"removed leftovers of an interrupted run: {', '.join(self.run_lock.removed)}")
        state = load_latest_checkpoint(self.run_dir) if self.cfg.run.resume else None
        if state is None:
            self._start_run_files()
            self.metrics = MetricsWriter(self.run_dir) if self.writer else NoMetrics()
            return
        check_resume(state["config"], self.cfg, state.get("reward_file"))   # the checkpoint's config, every key
        state = par.restack_run_state(self.policy, state)   # MoE checkpoints written with per-expert parameters
        self._start_run_files()
        rounded = state.get(ROUNDED_KEY) or {}   # weights stored only as masters: set by the masters' load
        par.load_policy_weights(self.policy, state["model"], absent=rounded)
        self.master.load_state_dict(state.get("master"), rounded)
        par.load_optimizer_state(self.optimizer, state["optimizer"], self.tp)
        self.schedule.load_state_dict(state["schedule"])
        self._apply_lr_config()
        torch.set_rng_state(state["torch_rng"])
        self.step, self.data_pos = state["step"], state["data_pos"]
        if self.value is not None:
            self.value.load_state_dict(state["value"])
            par.load_optimizer_state(self.value_optimizer, state["value_optimizer"], None)
        self.weight_sync.push(lambda: par.policy_weights(self.policy), version=self.step)  # version = optimizer steps
        self.metrics = MetricsWriter(self.run_dir, resume_after_step=self.step) if self.writer else NoMetrics()
        self._note(getattr(self.metrics, "note", None))

    def _note(self, text: "str | None") -> None:
        if text and self.console is not None:
            self.console.print(f"note: {text}")

    def _start_run_files(self) -> None:
        """config.yaml (what this run runs under) and the trackers; the writer rank only."""
        if self.writer:
            write_run_config(self.run_dir, self.cfg)
            self.trackers = Trackers(self.run_dir, self.cfg)

    def _apply_lr_config(self) -> None:
        """After a resume: the schedule's lr from this config (the same bits as the checkpoint's when
        optim.* did not change; the new lr when run.resume_override allowed a change)."""
        self.schedule.base_lrs = [self.cfg.optim.lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.cfg.optim.lr
            group["lr"] = self.cfg.optim.lr * self._lr_factor(self.schedule.last_epoch)
        self.schedule._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def log_record(self, record: dict) -> None:
        """One metrics record: metrics.jsonl (always) and the run.loggers trackers."""
        self.metrics.write(record)
        if self.trackers is not None:
            self.trackers.log(record)

    def save(self) -> None:
        model, optimizer = par.policy_weights(self.policy), par.optimizer_state(self.optimizer, self.tp)
        master = full_masters(self.master, self.policy) if self.master.active else None
        if not self.writer:   # the writer saves for every rank (TP state gathered above)
            return
        # a weight with a master is stored once, as the master (the model copy is its rounding)
        model, rounded = weights_to_store(model, master) if master is not None else (model, {})
        save_checkpoint(self.run_dir, self.step, {
            "model": model, "optimizer": optimizer,
            **({"master": master, ROUNDED_KEY: rounded} if master is not None else {}),
            "schedule": self.schedule.state_dict(), "torch_rng": torch.get_rng_state(),
            "step": self.step, "data_pos": self.data_pos, "config": dataclasses.asdict(self.cfg),
            **({"reward_file": self.reward_file} if self.reward_file else {}),
            **({"value": self.value.state_dict(), "value_optimizer": self.value_optimizer.state_dict()}
               if self.value is not None else {})}, keep=self.cfg.run.keep_checkpoints,
            facts={"reward": self.reward_file} if self.reward_file else None)

    def save_policy(self) -> Path:
        policy = par.unsharded_policy(self.policy)
        if not self.writer:
            return self.run_dir / "policy"
        # shards of at most 5 GiB (hashed in parallel): an 8B export is 4 files, a small model's one model.safetensors
        # policy/ is replaced whole (tokenizer files included) and only when it holds a saved model's files alone
        return save_model(policy, self.run_dir / "policy", max_shard_bytes=EXPORT_SHARD_BYTES,
                          tokenizer_from=self.model_dir)

    # ---- one step --------------------------------------------------------------------------------

    def _draw(self, step: int, draw_round: int, count: int, first_group: int) -> StepSamples:
        """``count`` prompts from the data stream x ``samples_per_prompt`` samples, scored."""
        cfg = self.cfg
        problems = self.task.train(self.data_pos, count)
        self.data_pos += len(problems)
        prompts = [self.task.encode(p.prompt) for p in problems]
        sampling = SamplingParams(n=cfg.rollout.samples_per_prompt, temperature=cfg.rollout.temperature,
                                  top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
                                  max_new_tokens=cfg.rollout.max_new_tokens, ignore_eos=cfg.rollout.ignore_eos,
                                  seed=derive_seed(cfg.run.seed, step, draw_round))
        samples = generate_sharded(self.engine, prompts, sampling, self.dp)   # each DP rank a share, all get all
        return samples.scored(self._rewards(problems, samples), first_group)

    def _rewards(self, problems, samples: StepSamples) -> list[float]:
        """Each sample's reward: its decoded completion scored against its prompt's problem."""
        texts = [self.tokenizer.decode(tokens) for tokens in samples.completion_token_lists()]
        return self.task.score([problems[i] for i in samples.prompt_index.tolist()], texts)

    def rollout(self, step: int) -> tuple[StepSamples, dict]:
        """The step's rollout. With ``algo.dynamic_sampling`` (DAPO): groups whose rewards are all equal
        are dropped and more prompts drawn (at most ``algo.max_draw_rounds`` rounds) until
        ``prompts_per_step`` informative groups are kept; extra groups are trimmed, first drawn first kept."""
        target = self.cfg.rollout.prompts_per_step
        ro = self._draw(step, 0, target, 0)
        if not self.cfg.algo.dynamic_sampling:
            return ro, {}
        drawn, kept_ro, rounds = target, None, 1
        while True:
            kept_ro = ro.select(algos.informative_groups(ro.reward_tensor(), ro.group_tensor()))
            kept = kept_ro.num_groups()
            more = algos.groups_to_draw(target, kept, drawn, max_draw=4 * target)
            if more == 0 or rounds >= self.cfg.algo.max_draw_rounds:
                break
            ro = StepSamples.concat([ro, self._draw(step, rounds, more, drawn)])
            drawn += more
            rounds += 1
        stats = {"dynamic_sampling/drawn_groups": drawn, "dynamic_sampling/kept_groups": min(kept, target),
                 "dynamic_sampling/rounds": rounds}
        if kept == 0:  # nothing informative: every advantage is 0, the update is a no-op
            return ro, stats
        trimmed = algos.first_groups(kept_ro.group_tensor(), torch.ones(len(kept_ro), dtype=torch.bool), target)
        return kept_ro.select(trimmed), stats

    def train_batch(self, ro: StepSamples) -> TrainBatch:
        """The step's :class:`TrainBatch` (layout, mask, rollout log-probs), built once."""
        cfg = self.cfg
        batch = TrainBatch.build(ro, max_tokens=cfg.optim.micro_batch_tokens, mini_batches=cfg.algo.mini_batches,
                                 device=self.policy.device)
        if cfg.algo.overlong_filter:
            truncated = ro.truncated.to(batch.mask.device)
            batch = batch.with_mask(algos.overlong_filter(batch.mask, batch.seq_ids, truncated))
        return batch

    def needs_rescore(self) -> bool:
        """Whether the old policy's log-probs need a forward of their own before the update.

        Not in the strict profile when one pass over every micro-batch runs before the first optimizer
        step (one mini-batch, one data-parallel rank) and no mismatch correction needs the old
        log-probs before the update: that pass's forward is the old policy's (the same ops with or
        without grad: the same bits), so its detached log-probs are the old log-probs, compared with
        the rollout's before the optimizer steps. Needed in the native profile (grad and no-grad
        forwards may take different vendor kernels), for TIS/MIS, with ``algo.mini_batches > 1``
        (later mini-batches run after an optimizer step) and with ``parallel.dp > 1`` (each rank
        forwards only its share)."""
        a = self.cfg.algo
        return (self.cfg.run.profile != "strict" or a.mismatch_correction != "none" or a.mini_batches > 1
                or self.dp.size > 1)

    def token_advantages(self, ro: StepSamples, batch: TrainBatch, kl: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """Per-token advantages [T] by ``algo.advantage`` (rlalign.algos.registry.ADVANTAGES) and, for
        estimators with a value model, the value targets. ``kl`` (per token, or None) is the KL penalty
        folded into the reward when ``algo.kl_in_reward``."""
        a = self.cfg.algo
        estimator = algos.ADVANTAGES[a.advantage]
        dev = batch.seq_ids.device
        old_values = self.value.old_values(batch) if estimator.value_model else None
        inputs = algos.AdvantageInputs(ro.reward_tensor(dev), ro.group_tensor(dev), batch.seq_ids, batch.mask,
                                       kl=kl, kl_coef=a.kl_coef, values=old_values)
        adv, returns = estimator.fn(inputs, **estimator.knob_values(dataclasses.asdict(a)))
        return adv, ({"returns": returns, "old_values": old_values} if estimator.value_model else {})

    def train_step(self, step: int) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        with use_profile(cfg.run.profile):
            ro, sampling_stats = self.rollout(step)
            t_rollout = time.perf_counter() - t0
            t1 = time.perf_counter()
            temp = cfg.rollout.logprob_temperature
            batch = self.train_batch(ro)
            record = {"step": step}
            old_lp = old_ent = None
            compare_routing = self.moe and ro.has_routing
            if self.needs_rescore():
                with record_routing(keep_logits=False) if compare_routing else contextlib.nullcontext() as routing:
                    old_lp, old_ent = batch.score(self.policy, temperature=temp, with_entropy=True)
                record.update(self._check_old_logprobs(step, old_lp, batch))
                if compare_routing:
                    record.update(self._check_routing(step, routing.expert_ids(), ro))
            ref_lp = batch.score(self.ref, temperature=temp)[0] if self.ref is not None else None
            # in the strict profile without a rescore the rollout's log-probs stand for the old policy's
            # (equal bit for bit, checked on every token in the first update pass)
            kl_reward = (algos.kl_estimate(old_lp if old_lp is not None else batch.rollout_logprobs, ref_lp,
                                           cfg.algo.kl_estimator)
                         if ref_lp is not None and cfg.algo.kl_in_reward else None)
            token_adv, value_targets = self.token_advantages(ro, batch, kl_reward)
            is_weights, corr_stats = self._mismatch_correction(old_lp, batch)

            first_lp = old_lp

            def first_pass(lp, ent, routing):   # strict, no rescore: the first update pass's forward is the old policy's
                nonlocal old_ent, first_lp
                old_ent, first_lp = ent, lp
                record.update(self._check_old_logprobs(step, lp, batch))
                if compare_routing:
                    record.update(self._check_routing(step, routing, ro))

            update = self._update(batch, old_lp, token_adv, None if kl_reward is not None else ref_lp, is_weights,
                                  value_targets, first_pass, keep_routing=compare_routing)
            if cfg.run.policy_kl:   # the updated policy on the samples its predecessor drew
                update["kl/policy_step"] = policy_step_kl(first_lp, batch.score(self.policy, temperature=temp)[0],
                                                          batch.mask)
        t_train = time.perf_counter() - t1
        self.weight_sync.push(lambda: par.policy_weights(self.policy), version=step)
        lens = batch.completion_lens
        n_tokens = int(lens.sum())
        rewards = ro.reward_tensor()
        record.update({
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "entropy": float(old_ent.mean()), "completion/mean_len": float(lens.float().mean()),
            "completion/truncated_frac": int(ro.truncated.sum()) / len(ro.truncated), **sampling_stats,
            "time/rollout_s": t_rollout, "time/train_s": t_train,
            "tokens_per_s/rollout": n_tokens / max(t_rollout, 1e-9),
            "memory/peak_mb": _peak_memory_mb(self.device), "weights_version": self.engine.weights_version,
            "memory/engine_weight_copy_mb": self.weight_sync.copy_bytes / 2**20,   # 0: the engine shares the policy's
            **update, **corr_stats, **rollout_stats(rewards, ro.group_tensor(), lens),
            **token_stats(token_adv, batch.mask, first_lp, ref_lp),
        })
        return record

    def _check_old_logprobs(self, step: int, old_lp: torch.Tensor, batch: TrainBatch) -> dict:
        """Compare the trainer's old-policy log-probs with the rollout's on every token (raw bits); the
        ``mismatch/*`` record. In the strict profile a mismatch warns or, with ``run.on_mismatch=stop``,
        raises (before any optimizer step of the step)."""
        mism = algos.logprob_mismatch_stats(old_lp, batch.rollout_logprobs, torch.ones_like(batch.mask))
        record = self._mismatch_record(mism)
        self._check_mismatch(step, record)
        return record

    def _mismatch_record(self, mism: dict) -> dict:
        return {"mismatch/tokens": int(mism["tokens"]), "mismatch/count": int(mism["count"]),
                "mismatch/max_abs": float(mism["max_abs"]), "mismatch/mean_abs": float(mism["mean_abs"]),
                "rollout_corr/kl_k3": float(mism["kl_k3"])}

    def _check_mismatch(self, step: int, record: dict) -> None:
        if self.cfg.run.profile != "strict" or record["mismatch/count"] == 0:
            return
        msg = (f"step {step}: {record['mismatch/count']} of {record['mismatch/tokens']} token logprobs differ between "
               f"the rollout engine and the trainer (max |diff| {record['mismatch/max_abs']:.3g}) in the strict profile; "
               "run `rlalign parity --localize` on this model to find the first diverging op")
        self._report_mismatch(msg)

    def _check_routing(self, step: int, trainer_ids: torch.Tensor | None, ro: StepSamples) -> dict:
        """Compare the trainer's routing (expert ids [rows of the step's packed forwards, sparse layers, k]: the
        samples in order, every token of each) with the rollout's on the rows both computed; the
        ``moe/routing_*`` record. A (row, sparse layer) pair mismatches when the top-k expert SETS differ
        (:func:`rlalign.algos.routing_mismatch`). In the strict profile a mismatch is handled like a logprob
        mismatch (``run.on_mismatch``); in the native profile it is only reported."""
        ours, theirs, rows = _rows_both_computed(step, trainer_ids, ro)
        mism = algos.routing_mismatch(ours, theirs)
        if mism["count"] and self.cfg.run.profile == "strict":
            row, layer = mism["first"]
            sample = int(torch.searchsorted(torch.tensor(rows).cumsum(0), row, right=True))
            self._report_mismatch(
                f"step {step}: {mism['count']} of {mism['tokens']} (token, sparse layer) routing choices differ between "
                f"the rollout engine and the trainer in the strict profile; first at sample {sample} token position "
                f"{row - sum(rows[:sample])}, layer {self.sparse_layers[layer]}: rollout experts "
                f"{sorted(theirs[row, layer].tolist())}, trainer {sorted(ours[row, layer].tolist())}; run "
                "`rlalign parity --localize` on this model to find the first diverging op")
        return {"moe/routing_tokens": mism["tokens"], "moe/routing_mismatch": mism["count"],
                "moe/routing_mismatch_frac": mism["count"] / max(mism["tokens"], 1)}

    def _report_mismatch(self, msg: str) -> None:
        """``run.on_mismatch``: stop raises MismatchError (before any optimizer step of the step), warn logs."""
        if self.cfg.run.on_mismatch == "stop":
            raise MismatchError(msg)
        LOGGER.warning(f"MISMATCH {msg}")

    def _mismatch_correction(self, old_lp, batch: TrainBatch):
        correction = algos.MISMATCH_CORRECTIONS[self.cfg.algo.mismatch_correction]
        if correction.fn is None:
            return None, {}
        corr = correction.fn(old_lp, batch.rollout_logprobs, batch.mask, batch.seq_ids,
                             **correction.knob_values(dataclasses.asdict(self.cfg.algo)))
        stats = {f"rollout_corr/{k}": float(v) for k, v in corr.stats.items()}
        weights = corr.weights if corr.weights is not None else corr.mask.to(torch.float32)
        return weights, stats

    def _update(self, batch: TrainBatch, old_lp, token_adv, ref_lp, is_weights, value_targets, first_pass, *,
                keep_routing: bool = False) -> dict:
        """``ppo_epochs`` passes over the step's samples; each pass takes one optimizer step per mini-batch
        after accumulating its gradient micro-batch by micro-batch. The loss of a mini-batch is
        normalised by its own counts (``algo.loss_agg``); logged losses, ``clip_frac`` and ``grad_norm``
        are means over the optimizer steps, ``lr`` the learning rate they used.

        ``old_lp`` None: the first pass's detached log-probs are the old log-probs (see
        :meth:`needs_rescore`); ``first_pass(old_lp, entropy, routing)`` checks them before the first optimizer
        step, ``routing`` being that pass's expert ids [rows, sparse layers, k] with ``keep_routing`` (else None)."""
        cfg = self.cfg
        steps = cfg.algo.ppo_epochs * len(batch.mini_batches)
        totals = {"loss/policy": 0.0, "loss/kl": 0.0, "clip_frac": 0.0, "kl/ppo": 0.0, "grad_norm": 0.0}
        if self.value is not None:
            totals["loss/value"] = 0.0
        if self.moe:
            totals.update({"moe/aux_loss": 0.0, "moe/load_entropy": 0.0})
        lr = self.optimizer.param_groups[0]["lr"]   # this step's; the schedule moves after the step
        if old_lp is None and (len(batch.mini_batches) > 1 or self.dp.size > 1):
            raise RuntimeError("Trainer._update: the first pass stands in for the old log-probs only with one "
                               "mini-batch on one data-parallel rank (needs_rescore)")
        for _ in range(cfg.algo.ppo_epochs):
            for mini in batch.mini_batches:
                stats, seen = self._accumulate(batch, mini, old_lp, token_adv, ref_lp, is_weights, value_targets,
                                               keep_routing)
                if old_lp is None:
                    old_lp, entropy = torch.cat([s[0] for s in seen]), torch.cat([s[1] for s in seen])
                    first_pass(old_lp, entropy, torch.cat([s[2] for s in seen]) if keep_routing else None)
                grad_norm = self._optimizer_step(stats)
                for k, v in stats.items():
                    totals[k] += v / steps
                totals["grad_norm"] += float(grad_norm) / steps
        self.schedule.step()
        return {**totals, "lr": lr}

    def _accumulate(self, batch: TrainBatch, mini, old_lp, token_adv, ref_lp, is_weights, value_targets,
                    keep_routing: bool = False):
        """Backward of one mini-batch's loss, micro-batch by micro-batch (this rank's share); returns its
        logged stats and, when ``old_lp`` is None, each micro-batch's detached (log-probs, entropies, expert
        ids [rows, sparse layers, k] with ``keep_routing``, else None)."""
        cfg, a = self.cfg, self.cfg.algo
        span = slice(mini[0].tokens.start, mini[-1].tokens.stop)
        n_tok, n_seq = algos.batch_counts(batch.mask[span], batch.seq_ids[span])
        agg = dict(num_tokens=n_tok, num_seqs=n_seq, max_len=cfg.rollout.max_new_tokens)
        loss_fn = algos.POLICY_LOSSES[a.policy_loss]
        knobs = loss_fn.knob_values(dataclasses.asdict(a))
        stats = {"loss/policy": 0.0, "loss/kl": 0.0, "clip_frac": 0.0, "kl/ppo": 0.0}
        if self.value is not None:
            stats["loss/value"] = 0.0
        if self.moe:
            stats.update({"moe/aux_loss": 0.0, "moe/load_entropy": 0.0})
        seen = []
        self.optimizer.zero_grad(set_to_none=True)
        if self.value is not None:
            self.value_optimizer.zero_grad(set_to_none=True)
        for mb in shard_for_rank(mini, self.dp):
            sl, mask = mb.tokens, batch.mask[mb.tokens]
            with record_routing() as routing:
                lp, ent = logprobs(self.policy, mb, temperature=cfg.rollout.logprob_temperature,
                                   with_entropy=a.entropy_coef > 0 or old_lp is None)
            if old_lp is None:
                seen.append((lp.detach(), ent.detach(), routing.expert_ids() if keep_routing else None))
            old = lp.detach() if old_lp is None else old_lp[sl]
            out = loss_fn.fn(lp, old, token_adv[sl], mask, mb.seq_ids, len(mb.samples),
                             None if is_weights is None else is_weights[sl], **knobs)
            loss = algos.aggregate_loss(out.loss, mask, mb.seq_ids, a.loss_agg, **agg)
            stats["loss/policy"] += float(loss.detach())
            if ref_lp is not None:
                kl = algos.kl_estimate(lp, ref_lp[sl], a.kl_estimator)
                kl_term = algos.aggregate_loss(kl, mask, mb.seq_ids, a.loss_agg, **agg)
                stats["loss/kl"] += float(kl_term.detach())
                loss = loss + a.kl_coef * kl_term
            if a.entropy_coef > 0:
                loss = loss - a.entropy_coef * algos.aggregate_loss(ent, mask, mb.seq_ids, a.loss_agg, **agg)
            if self.moe:
                aux, load_entropy = algos.routing_terms(routing)
                share = len(lp) / max(span.stop - span.start, 1)   # this micro-batch's share of the mini-batch's rows
                stats["moe/aux_loss"] += float(aux.detach()) * share
                stats["moe/load_entropy"] += load_entropy * share
                if a.router_aux_coef > 0:
                    loss = loss + a.router_aux_coef * share * aux
            if self.value is not None:
                v = self.value.values(mb)
                vl = algos.aggregate_loss(algos.value_loss(v, value_targets["old_values"][sl],
                                                           value_targets["returns"][sl], a.value_clip),
                                          mask, mb.seq_ids, a.loss_agg, **agg)
                vl.backward()
                stats["loss/value"] += float(vl.detach())
            w = int(mask.sum())
            stats["clip_frac"] += float(out.stats.get("clip_frac", torch.tensor(0.0))) * w / max(n_tok, 1)
            stats["kl/ppo"] += float(out.stats.get("approx_kl", torch.tensor(0.0))) * w / max(n_tok, 1)
            loss.backward()
        return stats, seen

    def _optimizer_step(self, stats: dict) -> torch.Tensor:
        """Sum gradients (and ``stats``, in place) over the data-parallel ranks, clip, step; the grad norm."""
        cfg = self.cfg
        if self.dp.size > 1:   # deterministic sum over the data-parallel ranks (rank order, fixed tree)
            all_reduce_gradients_(self.policy.parameters(), self.dp)
            if self.value is not None:
                all_reduce_gradients_(self.value.parameters(), self.dp)
            stats.update(sum_scalars(stats, self.dp))
        grad_norm = par.clip_grad_norm_(self.policy, cfg.optim.grad_clip)
        if not torch.isfinite(grad_norm):
            raise RLAlignError(f"gradient norm is {float(grad_norm)} at step {self.step}: lower optim.lr or check "
                               "the rewards; the last checkpoint is intact")
        self.master.step(self.optimizer)   # parameter by parameter; a plain optimizer.step() without masters
        if self.value is not None:
            torch.nn.utils.clip_grad_norm_(self.value.parameters(), cfg.optim.grad_clip, foreach=False)
            self.value_optimizer.step()
        return grad_norm

    # ---- eval --------------------------------------------------------------------------------------

    def evaluate(self) -> dict:
        """Held-out accuracy (mean exact-answer reward): ``eval/accuracy`` samples ``run.eval_samples``
        completions per problem at the rollout temperature with a fixed seed (the same keys at every
        eval, so curves compare models, not draws); ``eval/accuracy_greedy`` decodes greedily."""
        problems = self.task.eval_problems()
        if not problems:
            return {}
        started = time.perf_counter()
        prompts = [self.task.encode(p.prompt) for p in problems]
        r = self.cfg.rollout
        out = {}
        for key, sampling in (
                ("eval/accuracy", SamplingParams(n=self.cfg.run.eval_samples, temperature=r.temperature, top_k=r.top_k,
                                                 top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                                 seed=derive_seed(self.cfg.run.seed, -1, 0))),
                ("eval/accuracy_greedy", SamplingParams(n=1, temperature=0.0, max_new_tokens=r.max_new_tokens))):
            with use_profile(self.cfg.run.profile):
                samples = generate_sharded(self.engine, prompts, sampling, self.dp)
            rewards = self._rewards(problems, samples)
            out[key] = sum(1.0 for x in rewards if x >= 1.0) / len(rewards)
        out["time/eval_s"] = time.perf_counter() - started
        return out


def _rows_both_computed(step: int, trainer_ids: torch.Tensor | None, ro: StepSamples):
    """(trainer ids, rollout ids, rollout rows per sample) on the rows both sides computed: sample i's first
    ``routing_rows[i]`` tokens (all but the last sampled token, which the rollout never feeds) out of the
    trainer's ``sequence_lens[i]`` rows. A record that cannot line up is an error, never a silent skip."""
    lens, count = ro.sequence_lens, ro.routing_rows
    if trainer_ids is None or trainer_ids.shape[0] != int(lens.sum()) or bool((count > lens).any()):
        shape = None if trainer_ids is None else tuple(trainer_ids.shape)
        raise RLAlignError(f"step {step}: the trainer's routing record {shape} does not line up with the step's "
                           f"{int(lens.sum())} rows (rollout records of {int(count.sum())} rows)")
    theirs = ro.routing
    if theirs.shape[1:] != trainer_ids.shape[1:]:
        raise RLAlignError(f"step {step}: the rollout recorded {theirs.shape[1]} sparse layers x top-{theirs.shape[2]} "
                           f"but the policy has {trainer_ids.shape[1]} x top-{trainer_ids.shape[2]}: the rollout "
                           "engine holds a different model")
    # row j of sample i in the trainer's packing: start_i + j, start_i = len_0 + ... + len_{i-1}
    shift = lens.cumsum(0) - count.cumsum(0) - (lens - count)
    picked = torch.arange(int(count.sum()), dtype=torch.int64) + torch.repeat_interleave(shift, count)
    return trainer_ids.index_select(0, picked.to(trainer_ids.device)), theirs, count.tolist()


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _checkpoint_layers(model) -> None:
    """Recompute each decoder layer in backward (activation checkpointing, non-reentrant)."""
    from torch.utils.checkpoint import checkpoint
    for layer in model.model.layers:
        forward = layer.forward
        layer.forward = lambda *args, _f=forward: checkpoint(_f, *args, use_reentrant=False) \
            if torch.is_grad_enabled() else _f(*args)


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
    if trainer.writer:
        for line in banner_lines(cfg, trainer.run_dir, trainer.config_path, trainer.model_dir,
                                 sum(p.numel() for p in trainer.policy.parameters()),
                                 str(next(trainer.policy.parameters()).dtype).removeprefix("torch."), trainer.step):
            LOGGER.info(line)
        LOGGER.info(f"  weights  {trainer.weight_sync.path.describe()}")
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
