"""The RL loop, single process, colocated: rollout -> rewards -> advantages -> update -> push weights.

Objective (GRPO defaults; every term is a function of :mod:`rlalign.algos` with its exact formula):
for each step, ``P`` prompts x ``K`` samples are drawn from the rollout engine at temperature
``T``; each sample gets a scalar reward; the advantage of sample i is group-normalised
(``(r_i - mean_g) / (std_g + eps)``, unbiased std; ``dr_grpo`` drops the std); every completion
token carries its sample's advantage. The loss is the clipped surrogate
``max(-A r_t, -A clamp(r_t, 1 - clip_low, 1 + clip_high))`` with ``r_t = exp(logp_t - logp_old_t)``,
aggregated by ``algo.loss_agg`` with the *step-global* normaliser (so the gradient does not depend
on how the batch is cut into micro-batches), plus ``kl_coef * KL_k(pi || ref)`` and
``- entropy_coef * H`` when enabled.

``logp_old`` is the trainer's own forward on the sampled tokens before the update. In the strict
profile it equals the rollout engine's logprobs bit for bit; every step compares the two on every
token and logs ``mismatch/*``. In the native profile they differ, and ``algo.mismatch_correction``
(TIS / MIS) can correct for it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import resource
import time
from pathlib import Path

import torch

from rlalign import algos
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import use_profile
from rlalign.distributed.data_parallel import all_reduce_gradients_, shard_for_rank, sum_scalars
from rlalign.distributed import trainer as par
from rlalign.distributed.parallelize import parallelize
from rlalign.ops.sample import derive_seed
from rlalign.rollout.config import SamplingParams
from rlalign.train.engines import build_rollout_engine
from rlalign.train.config import TrainConfig
from rlalign.train.packing import micro_batches, score_completions, score_in_micro_batches
from rlalign.train.rundir import open_run_dir
from rlalign.train.runio import MetricsWriter, atomic_write, load_latest_checkpoint, save_checkpoint
from rlalign.train.setup import SetupError, build_task, load_policy
from rlalign.train.value import ValueModel, value_loss


class MismatchError(RLAlignError):
    pass


@dataclasses.dataclass
class Rollout:
    """One step's samples, sequence by sequence (group = prompt)."""
    samples: list[tuple[list[int], int]]       # (prompt + completion tokens, prompt_len)
    logprobs: list[list[float]]                # rollout engine's logprob of each completion token
    rewards: list[float]
    group_ids: list[int]
    truncated: list[bool]
    texts: list[str]

    @property
    def completion_lens(self) -> list[int]:
        return [len(t) - p for t, p in self.samples]

    def logprob_tensor(self, device="cpu") -> torch.Tensor:
        """The rollout engine's logprobs of every completion token, sample by sample (fp32, exact)."""
        return torch.tensor([x for lps in self.logprobs for x in lps], dtype=torch.float32, device=device)

    def reward_tensor(self, device="cpu") -> torch.Tensor:
        return torch.tensor(self.rewards, dtype=torch.float32, device=device)

    def group_tensor(self, device="cpu") -> torch.Tensor:
        """Group ids renumbered 0..G-1 in order of first appearance."""
        order = {g: i for i, g in enumerate(dict.fromkeys(self.group_ids))}
        return torch.tensor([order[g] for g in self.group_ids], dtype=torch.int64, device=device)

    def select(self, keep: list[bool]) -> "Rollout":
        pick = lambda xs: [x for x, k in zip(xs, keep) if k]  # noqa: E731
        return Rollout(pick(self.samples), pick(self.logprobs), pick(self.rewards), pick(self.group_ids),
                       pick(self.truncated), pick(self.texts))

    def __add__(self, other: "Rollout") -> "Rollout":
        return Rollout(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(Rollout)))


class Trainer:
    def __init__(self, cfg: TrainConfig, console=None):
        self.cfg = cfg
        self.console = console
        # parallel.dp/tp (rlalign.distributed.trainer): tp shards the policy, each dp rank back-propagates a share
        self.tp, self.dp = par.parallel_groups(cfg)
        self.writer = par.is_writer(self.tp, self.dp)
        self.run_dir = Path(par.shared_run_dir(cfg))
        # The writer locks and prepares the run directory before any work (rlalign.train.rundir): a fresh
        # run needs an empty directory (or run.overwrite), a resume a checkpoint.
        self.run_lock = (open_run_dir(self.run_dir, resume=cfg.run.resume, overwrite=cfg.run.overwrite)
                         if self.writer else None)
        try:
            self._build(cfg)
        except BaseException:
            if self.run_lock is not None:
                self.run_lock.abandon()
            raise

    def _build(self, cfg: TrainConfig) -> None:
        self.device = torch.device(cfg.model.device)
        self.policy, self.tokenizer, self.model_dir = load_policy(cfg.model)
        self.task = build_task(cfg.task, self.tokenizer, cfg.run.seed)
        self.engine = build_rollout_engine(cfg, self.policy, self.tokenizer, self.model_dir)
        self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False) if cfg.algo.kl_coef > 0 else None
        if self.tp is not None:
            if cfg.algo.advantage == "gae":
                raise SetupError("parallel.tp does not support the PPO value model (algo.advantage=gae) yet")
            self.policy = parallelize(self.policy, self.tp)   # the engine and ref keep unsharded copies
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                           weight_decay=cfg.optim.weight_decay, foreach=False)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.value = self.value_optimizer = None
        if cfg.algo.advantage == "gae":
            self.value = ValueModel(self.policy)
            self.value_optimizer = torch.optim.AdamW(self.value.parameters(), lr=cfg.algo.value_lr, foreach=False)
        self.step = 0
        self.data_pos = 0
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
            self.metrics = MetricsWriter(self.run_dir) if self.writer else par.NoMetrics()
            return
        par.load_policy_weights(self.policy, state["model"])
        par.load_optimizer_state(self.optimizer, state["optimizer"], self.tp)
        self.schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["torch_rng"])
        self.step, self.data_pos = state["step"], state["data_pos"]
        if self.value is not None:
            self.value.load_state_dict(state["value"])
            self.value_optimizer.load_state_dict(state["value_optimizer"])
        self.engine.update_weights(par.policy_weights(self.policy), version=self.step)  # version = optimizer steps
        self.metrics = MetricsWriter(self.run_dir, resume_after_step=self.step) if self.writer else par.NoMetrics()
        self._note(getattr(self.metrics, "note", None))

    def _note(self, text: "str | None") -> None:
        if text and self.console is not None:
            self.console.print(f"note: {text}")

    def save(self) -> None:
        model, optimizer = par.policy_weights(self.policy), par.optimizer_state(self.optimizer, self.tp)
        if not self.writer:   # the writer saves for every rank (TP state gathered above)
            return
        save_checkpoint(self.run_dir, self.step, {
            "model": model, "optimizer": optimizer,
            "schedule": self.schedule.state_dict(), "torch_rng": torch.get_rng_state(),
            "step": self.step, "data_pos": self.data_pos, "config": dataclasses.asdict(self.cfg),
            **({"value": self.value.state_dict(), "value_optimizer": self.value_optimizer.state_dict()}
               if self.value is not None else {})})

    def save_policy(self) -> Path:
        from rlalign.models.checkpoint import save_model
        policy = par.unsharded_policy(self.policy)
        if not self.writer:
            return self.run_dir / "policy"
        out = save_model(policy, self.run_dir / "policy")
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
            src = Path(self.model_dir) / name
            if src.exists():
                atomic_write(out / name, src.read_bytes())
        return out

    # ---- one step --------------------------------------------------------------------------------

    def _draw(self, step: int, draw_round: int, count: int, first_group: int) -> Rollout:
        """``count`` prompts from the data stream x ``samples_per_prompt`` samples, scored."""
        cfg = self.cfg
        problems = self.task.train(self.data_pos, count)
        self.data_pos += len(problems)
        prompts = [self.task.encode(p.prompt) for p in problems]
        sampling = SamplingParams(n=cfg.rollout.samples_per_prompt, temperature=cfg.rollout.temperature,
                                  top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
                                  max_new_tokens=cfg.rollout.max_new_tokens,
                                  seed=derive_seed(cfg.run.seed, step, draw_round))
        completions = self.engine.generate(prompts, sampling)
        texts = [self.tokenizer.decode(c.tokens) for c in completions]
        rewards = self.task.score([problems[c.prompt_index].prompt for c in completions], texts,
                                  [problems[c.prompt_index].answer for c in completions])
        return Rollout(samples=[(c.prompt_tokens + c.tokens, len(c.prompt_tokens)) for c in completions],
                       logprobs=[list(c.logprobs) for c in completions], rewards=rewards,
                       group_ids=[first_group + c.prompt_index for c in completions],
                       truncated=[c.finish_reason == "length" for c in completions], texts=texts)

    def rollout(self, step: int) -> tuple[Rollout, dict]:
        """The step's rollout. With ``algo.dynamic_sampling`` (DAPO): groups whose rewards are all equal
        are dropped and more prompts drawn (at most ``algo.max_draw_rounds`` rounds) until
        ``prompts_per_step`` informative groups are kept; extra groups are trimmed, first drawn first kept."""
        target = self.cfg.rollout.prompts_per_step
        ro = self._draw(step, 0, target, 0)
        if not self.cfg.algo.dynamic_sampling:
            return ro, {}
        drawn, kept_ro, rounds = target, None, 1
        while True:
            keep = algos.informative_groups(ro.reward_tensor(), ro.group_tensor())
            kept_ro = ro.select(keep.tolist())
            kept = len(set(kept_ro.group_ids))
            more = algos.groups_to_draw(target, kept, drawn, max_draw=4 * target)
            if more == 0 or rounds >= self.cfg.algo.max_draw_rounds:
                break
            ro = ro + self._draw(step, rounds, more, drawn)
            drawn += more
            rounds += 1
        stats = {"dynamic_sampling/drawn_groups": drawn, "dynamic_sampling/kept_groups": min(kept, target),
                 "dynamic_sampling/rounds": rounds}
        if kept == 0:  # nothing informative: every advantage is 0, the update is a no-op
            return ro, stats
        trimmed = algos.first_groups(kept_ro.group_tensor(), torch.ones(len(kept_ro.rewards), dtype=torch.bool), target)
        return kept_ro.select(trimmed.tolist()), stats

    def token_advantages(self, ro: Rollout, seq_ids: torch.Tensor, mask: torch.Tensor,
                         kl: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """Per-token advantages [T] (a sequence-level advantage copied to its tokens, or REINFORCE++'s /
        GAE's per-token ones) and, for GAE, the value targets. ``kl`` (per token, or None) is the KL
        penalty folded into the reward when ``algo.kl_in_reward``."""
        a = self.cfg.algo
        rewards, groups = ro.reward_tensor(seq_ids.device), ro.group_tensor(seq_ids.device)
        coef = a.kl_coef if kl is not None else 0.0
        if a.advantage == "gae":
            token_r = algos.token_rewards(rewards, seq_ids, mask, kl=kl, kl_coef=coef)
            old_values = self.value.values_in_micro_batches(ro.samples, self.cfg.optim.micro_batch_tokens)
            adv, returns = algos.gae_advantages(token_r, old_values, seq_ids, mask, gamma=a.gamma, lam=a.lam)
            return algos.whiten(adv, mask), {"returns": returns, "old_values": old_values}
        if a.advantage == "reinforce_pp":
            return algos.reinforce_pp_advantages(rewards, seq_ids, mask, group_ids=groups, kl=kl, kl_coef=coef)[0], {}
        if kl is not None:  # sequence-level reward minus the summed per-token KL penalty
            rewards = rewards - coef * torch.zeros_like(rewards).index_add_(0, seq_ids, torch.where(mask, kl, 0.0))
        if a.advantage in ("grpo", "dr_grpo"):
            adv = algos.grpo_advantages(rewards, groups, scale_by_std=a.advantage == "grpo")
        else:
            adv = algos.rloo_advantages(rewards, groups)
        return algos.expand_to_tokens(adv, seq_ids, mask), {}

    def train_step(self, step: int) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        with use_profile(cfg.run.profile):
            ro, sampling_stats = self.rollout(step)
            t_rollout = time.perf_counter() - t0
            t1 = time.perf_counter()
            temp = cfg.rollout.logprob_temperature
            mb_tokens = cfg.optim.micro_batch_tokens
            old_lp, old_ent = score_in_micro_batches(self.policy, ro.samples, temperature=temp, max_tokens=mb_tokens,
                                                     with_entropy=True)
            dev = old_lp.device  # every per-token tensor of the update lives with the model
            lens = torch.tensor(ro.completion_lens, device=dev)
            seq_ids = algos.seq_ids_from_lengths(lens)
            mask = torch.ones(seq_ids.shape[0], dtype=torch.bool, device=dev)
            if cfg.algo.overlong_filter:
                mask = algos.overlong_filter(mask, seq_ids, torch.tensor(ro.truncated, device=dev))
            rollout_lp = ro.logprob_tensor(dev)
            mism = algos.logprob_mismatch_stats(old_lp, rollout_lp, torch.ones_like(mask))
            record = {"step": step, **self._mismatch_record(mism)}
            self._check_mismatch(step, record)
            ref_lp = (score_in_micro_batches(self.ref, ro.samples, temperature=temp, max_tokens=mb_tokens)[0]
                      if self.ref is not None else None)
            kl_reward = (algos.kl_estimate(old_lp, ref_lp, self.cfg.algo.kl_estimator)
                         if ref_lp is not None and self.cfg.algo.kl_in_reward else None)
            token_adv, value_targets = self.token_advantages(ro, seq_ids, mask, kl_reward)
            is_weights, corr_stats = self._mismatch_correction(old_lp, rollout_lp, mask, seq_ids)
            update = self._update(ro, old_lp, token_adv, None if kl_reward is not None else ref_lp, mask, seq_ids,
                                  is_weights, value_targets)
        t_train = time.perf_counter() - t1
        self.engine.update_weights(par.policy_weights(self.policy), version=step)
        n_tokens = int(lens.sum())
        rewards = ro.reward_tensor()
        record.update({
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "entropy": float(old_ent.mean()), "completion/mean_len": float(lens.float().mean()),
            "completion/truncated_frac": sum(ro.truncated) / len(ro.truncated), **sampling_stats,
            "time/rollout_s": t_rollout, "time/train_s": t_train,
            "tokens_per_s/rollout": n_tokens / max(t_rollout, 1e-9), "lr": self.schedule.get_last_lr()[0],
            "memory/peak_mb": _peak_memory_mb(self.device), "weights_version": self.engine.weights_version,
            **update, **corr_stats,
        })
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
        if self.cfg.run.on_mismatch == "stop":
            raise MismatchError(msg)
        if self.console is not None:
            self.console.print(f"[bold red]MISMATCH[/bold red] {msg}")

    def _mismatch_correction(self, old_lp, rollout_lp, mask, seq_ids):
        kind = self.cfg.algo.mismatch_correction
        if kind == "none":
            return None, {}
        fn = {"token_tis": algos.token_tis, "seq_tis": algos.sequence_tis,
              "token_mis": algos.token_mis, "seq_mis": algos.sequence_mis}[kind]
        args = (old_lp, rollout_lp, mask) + ((seq_ids,) if kind.startswith("seq") else ())
        kw = {"cap": self.cfg.algo.mismatch_cap} if kind.endswith("tis") else {"high": self.cfg.algo.mismatch_cap}
        corr = fn(*args, **kw)
        stats = {f"rollout_corr/{k}": float(v) for k, v in corr.stats.items()}
        weights = corr.weights if corr.weights is not None else corr.mask.to(torch.float32)
        return weights, stats

    def _update(self, ro, old_lp, token_adv, ref_lp, mask, seq_ids, is_weights, value_targets) -> dict:
        """``ppo_epochs`` passes over the step's samples, micro-batch by micro-batch, one optimizer step each."""
        cfg, temp = self.cfg, self.cfg.rollout.logprob_temperature
        bounds = torch.tensor([0] + ro.completion_lens).cumsum(0).tolist()
        n_tok, n_seq = algos.batch_counts(mask, seq_ids)
        totals = {"loss/policy": 0.0, "loss/kl": 0.0, "clip_frac": 0.0, "grad_norm": 0.0}
        if self.value is not None:
            totals["loss/value"] = 0.0
        for _ in range(cfg.algo.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            if self.value is not None:
                self.value_optimizer.zero_grad(set_to_none=True)
            stats_acc = {k: 0.0 for k in totals if k != "grad_norm"}
            for mb in shard_for_rank(micro_batches([len(t) for t, _ in ro.samples], cfg.optim.micro_batch_tokens),
                                     self.dp):
                lo, hi = bounds[mb[0]], bounds[mb[-1] + 1]
                sl = slice(lo, hi)
                local_ids = seq_ids[sl] - mb[0]
                lp, ent = score_completions(self.policy, [ro.samples[i] for i in mb], temperature=temp,
                                            with_entropy=cfg.algo.entropy_coef > 0)
                out = self._policy_loss(lp, old_lp[sl], token_adv[sl], mask[sl], local_ids, len(mb),
                                        None if is_weights is None else is_weights[sl])
                agg = dict(num_tokens=n_tok, num_seqs=n_seq, max_len=cfg.rollout.max_new_tokens)
                loss = algos.aggregate_loss(out.loss, mask[sl], local_ids, cfg.algo.loss_agg, **agg)
                stats_acc["loss/policy"] += float(loss.detach())
                if ref_lp is not None:
                    kl = algos.kl_estimate(lp, ref_lp[sl], cfg.algo.kl_estimator)
                    kl_term = algos.aggregate_loss(kl, mask[sl], local_ids, cfg.algo.loss_agg, **agg)
                    stats_acc["loss/kl"] += float(kl_term.detach())
                    loss = loss + cfg.algo.kl_coef * kl_term
                if ent is not None:
                    loss = loss - cfg.algo.entropy_coef * algos.aggregate_loss(ent, mask[sl], local_ids,
                                                                               cfg.algo.loss_agg, **agg)
                if self.value is not None:
                    v = self.value.values([ro.samples[i] for i in mb])
                    vl = algos.aggregate_loss(value_loss(v, value_targets["old_values"][sl], value_targets["returns"][sl],
                                                         cfg.algo.value_clip), mask[sl], local_ids, cfg.algo.loss_agg, **agg)
                    vl.backward()
                    stats_acc["loss/value"] += float(vl.detach())
                w = int(mask[sl].sum())
                stats_acc["clip_frac"] += float(out.stats.get("clip_frac", torch.tensor(0.0))) * w / max(n_tok, 1)
                loss.backward()
            if self.dp.size > 1:   # deterministic sum over the data-parallel ranks (rank order, fixed tree)
                all_reduce_gradients_(self.policy.parameters(), self.dp)
                if self.value is not None:
                    all_reduce_gradients_(self.value.parameters(), self.dp)
                stats_acc = sum_scalars(stats_acc, self.dp)
            grad_norm = par.clip_grad_norm_(self.policy, cfg.optim.grad_clip)
            if not torch.isfinite(grad_norm):
                raise RLAlignError(f"gradient norm is {float(grad_norm)} at step {self.step}: lower optim.lr or check "
                                   "the rewards; the last checkpoint is intact")
            self.optimizer.step()
            if self.value is not None:
                torch.nn.utils.clip_grad_norm_(self.value.parameters(), cfg.optim.grad_clip, foreach=False)
                self.value_optimizer.step()
            for k, v in stats_acc.items():
                totals[k] += v / cfg.algo.ppo_epochs
            totals["grad_norm"] += float(grad_norm) / cfg.algo.ppo_epochs
        self.schedule.step()
        return totals

    def _policy_loss(self, lp, old_lp, adv, mask, local_ids, num_seqs, is_weights):
        a = self.cfg.algo
        if a.policy_loss == "ppo_clip":
            return algos.ppo_clip_loss(lp, old_lp, adv, mask, clip_low=a.clip_low, clip_high=a.clip_high,
                                       clip_c=a.dual_clip, is_weights=is_weights)
        if a.policy_loss == "gspo":
            return algos.gspo_loss(lp, old_lp, adv, mask, local_ids, num_seqs=num_seqs, is_weights=is_weights)
        return algos.cispo_loss(lp, old_lp, adv, mask, is_weights=is_weights)

    # ---- eval --------------------------------------------------------------------------------------

    def evaluate(self) -> dict:
        """Held-out accuracy (mean exact-answer reward): ``eval/accuracy`` samples ``run.eval_samples``
        completions per problem at the rollout temperature with a fixed seed (the same keys at every
        eval, so curves compare models, not draws); ``eval/accuracy_greedy`` decodes greedily."""
        problems = self.task.eval_problems()
        if not problems:
            return {}
        prompts = [self.task.encode(p.prompt) for p in problems]
        r = self.cfg.rollout
        out = {}
        for key, sampling in (
                ("eval/accuracy", SamplingParams(n=self.cfg.run.eval_samples, temperature=r.temperature, top_k=r.top_k,
                                                 top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                                 seed=derive_seed(self.cfg.run.seed, -1, 0))),
                ("eval/accuracy_greedy", SamplingParams(n=1, temperature=0.0, max_new_tokens=r.max_new_tokens))):
            with use_profile(self.cfg.run.profile):
                completions = self.engine.generate(prompts, sampling)
            texts = [self.tokenizer.decode(c.tokens) for c in completions]
            rewards = self.task.score([problems[c.prompt_index].prompt for c in completions], texts,
                                      [problems[c.prompt_index].answer for c in completions])
            out[key] = sum(1.0 for x in rewards if x >= 1.0) / len(rewards)
        return out


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
        return par.launch(cfg)
    trainer = Trainer(cfg, console)
    trainer.resume_if_asked()
    try:
        _train_to_end(trainer, cfg, console)
        trainer.save_policy()
    finally:
        if trainer.run_lock is not None:
            trainer.run_lock.release()
    return trainer.run_dir


def _train_to_end(trainer: Trainer, cfg: TrainConfig, console) -> None:
    progress = _Progress(cfg, console, trainer.step)
    started = time.perf_counter()
    try:
        if trainer.step == 0:
            trainer.metrics.write({"step": 0, **trainer.evaluate()})
        while trainer.step < cfg.run.steps:
            step = trainer.step + 1
            record = trainer.train_step(step)
            trainer.step = step
            last = step == cfg.run.steps
            if step % cfg.run.eval_every == 0 or last:
                record.update(trainer.evaluate())
            trainer.metrics.write(record)
            if step % cfg.run.checkpoint_every == 0 or last:
                trainer.save()
            progress.update(record)
            if cfg.run.max_minutes and (time.perf_counter() - started) / 60 > cfg.run.max_minutes and not last:
                trainer.save()
                progress.note(f"stopping at step {step}: run.max_minutes={cfg.run.max_minutes} reached "
                              "(resume with run.resume=true)")
                break
    finally:
        progress.close()


class _Progress:
    """A rich progress bar: step, reward, mismatch count, ETA."""

    def __init__(self, cfg: TrainConfig, console, start_step: int):
        self.bar = None
        if not cfg.run.progress or console is None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        self.bar = Progress(TextColumn("[bold]train[/bold]"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("reward {task.fields[reward]}  mismatches {task.fields[mism]}  "
                                       "eval {task.fields[eval]}"), TimeRemainingColumn(), console=console)
        self.task = self.bar.add_task("train", total=cfg.run.steps, completed=start_step, reward="-", mism="-",
                                      eval="-")
        self.bar.start()

    def update(self, record: dict) -> None:
        if self.bar is None:
            return
        fields = {"reward": f"{record['reward/mean']:.3f}", "mism": str(record["mismatch/count"])}
        if "eval/accuracy" in record:
            fields["eval"] = f"{record['eval/accuracy']:.3f}"
        self.bar.update(self.task, completed=record["step"], **fields)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


__all__ = ["Trainer", "run_training", "MismatchError"]
