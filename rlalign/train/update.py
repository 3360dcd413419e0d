"""The step's update: loss terms, gradient accumulation, the optimizer step and the learning-rate schedule.

Each of ``algo.ppo_epochs`` passes takes one optimizer step per mini-batch (``algo.mini_batches``), after
accumulating the mini-batch's gradient micro-batch by micro-batch (each data-parallel rank its share). The loss
of a micro-batch is the clipped surrogate of ``algo.policy_loss`` aggregated by ``algo.loss_agg`` with the
normaliser of the whole mini-batch (so the gradient does not depend on how it is cut into micro-batches), plus
``kl_coef * KL_k(pi || ref)``, ``- entropy_coef * H``, the MoE router's auxiliary loss and, for PPO with GAE, the
value model's loss (its own optimizer). The optimizer step sums the gradients over the data-parallel ranks
(deterministic tree), clips them by the norm of the checkpoint's tensors and steps AdamW through the fp32
masters (:class:`~rlalign.train.master.MasterWeights`).

The learning rate (:class:`LearningRate`): ``optim.lr`` times a linear warmup over ``optim.warmup_steps``, then
a cosine down to ``optim.min_lr_ratio`` at ``run.steps``; torch's ``LambdaLR`` counts the steps (its state is
the checkpoint's ``schedule``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from rlalign import algos
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import bitwise
from rlalign.distributed.data_parallel import all_reduce_gradients_, shard_for_rank, sum_scalars
from rlalign.distributed.launch import Group
from rlalign.models.moe import record_routing
from rlalign.train import parallel as par
from rlalign.train.master import MasterWeights
from rlalign.train.packing import MicroBatch, TrainBatch, logprobs, replaying
from rlalign.train.sharding import ShardedMaster
from rlalign.train.value import ValueModel


def lr_factor(optim, total_steps: int, step: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine down to ``min_lr_ratio`` at ``total_steps``."""
    total = max(total_steps, 1)
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    progress = min((step - optim.warmup_steps) / max(total - optim.warmup_steps, 1), 1.0)
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LearningRate:
    """The optimizer's learning rate over the run: ``optim.lr * lr_factor(step)``, stepped once per training step."""

    def __init__(self, optimizer: torch.optim.Optimizer, optim, total_steps: int):
        self.optimizer, self.optim, self.total_steps = optimizer, optim, total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)

    def factor(self, step: int) -> float:
        return lr_factor(self.optim, self.total_steps, step)

    @property
    def current(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's schedule, then the lr from this config: the same bits as the checkpoint's when optim.*
        did not change; the new lr when run.resume_override allowed a change."""
        self.scheduler.load_state_dict(state)
        self.scheduler.base_lrs = [self.optim.lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.optim.lr
            group["lr"] = self.optim.lr * self.factor(self.scheduler.last_epoch)


@dataclasses.dataclass
class UpdateInputs:
    """What weighs the step's tokens in the loss. ``old_lp`` None: the first pass's forward supplies the old
    log-probs (:func:`needs_rescore`); ``ref_lp`` None: no KL loss term; ``is_weights`` None: no mismatch
    correction; ``value_targets``: ``returns`` and ``old_values`` for a value model, else empty."""
    old_lp: torch.Tensor | None
    token_adv: torch.Tensor
    ref_lp: torch.Tensor | None
    is_weights: torch.Tensor | None
    value_targets: dict


# first_pass(old log-probs, entropies, routing expert ids or None): called once, before the first optimizer step
FirstPass = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], None]


def needs_rescore(cfg, dp: Group) -> bool:
    """Whether the old policy's log-probs need a forward of their own before the update.

    Not in the strict profile when one pass over every micro-batch runs before the first optimizer
    step (one mini-batch, one data-parallel rank) and no mismatch correction needs the old
    log-probs before the update: that pass's forward is the old policy's (the same ops with or
    without grad: the same bits), so its detached log-probs are the old log-probs, compared with
    the rollout's before the optimizer steps. Needed in the native profile (grad and no-grad
    forwards may take different vendor kernels), for TIS/MIS, with ``algo.mini_batches > 1``
    (later mini-batches run after an optimizer step) and with ``parallel.dp > 1`` (each rank
    forwards only its share)."""
    a = cfg.algo
    return not bitwise(cfg.run.profile) or a.mismatch_correction != "none" or a.mini_batches > 1 or dp.size > 1


class PolicyUpdate:
    """The policy's optimizer and learning rate (and the value model's, for PPO with GAE); :meth:`run` updates."""

    def __init__(self, cfg, policy, master: "MasterWeights | ShardedMaster", dp: Group, moe: bool, value_model: bool):
        self.cfg, self.policy, self.master, self.dp, self.moe = cfg, policy, master, dp, moe
        self.optimizer = torch.optim.AdamW(master.optim_params(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                           weight_decay=cfg.optim.weight_decay, foreach=False)
        self.lr = LearningRate(self.optimizer, cfg.optim, cfg.run.steps)
        self.value = self.value_optimizer = None
        if value_model:
            self.value = ValueModel(policy)
            self.value_optimizer = torch.optim.AdamW(self.value.parameters(), lr=cfg.algo.value_lr, foreach=False)

    def run(self, completed_steps: int, batch: TrainBatch, inputs: UpdateInputs, first_pass: FirstPass, *,
            keep_routing: bool = False) -> dict:
        """``ppo_epochs`` passes over the step's samples; each pass takes one optimizer step per mini-batch. Logged
        losses, ``clip_frac`` and ``grad_norm`` are means over the optimizer steps, ``lr`` the learning rate they
        used. Without ``inputs.old_lp``, ``first_pass`` receives the first pass's detached log-probs, entropies
        and (``keep_routing``) expert ids [rows, sparse layers, k] before the first optimizer step.
        ``completed_steps``: the run's steps before this one (named by a non-finite gradient's error)."""
        steps = self.cfg.algo.ppo_epochs * len(batch.mini_batches)
        totals = self._zero_stats("grad_norm")
        lr = self.lr.current   # this step's; the schedule moves after the step
        if inputs.old_lp is None and (len(batch.mini_batches) > 1 or self.dp.size > 1):
            raise RuntimeError("PolicyUpdate.run: the first pass stands in for the old log-probs only with one "
                               "mini-batch on one data-parallel rank (needs_rescore)")
        for _ in range(self.cfg.algo.ppo_epochs):
            for mini in batch.mini_batches:
                stats, seen = self._accumulate(batch, mini, inputs, keep_routing)
                if inputs.old_lp is None:
                    inputs = dataclasses.replace(inputs, old_lp=torch.cat([s[0] for s in seen]))
                    first_pass(inputs.old_lp, torch.cat([s[1] for s in seen]),
                               torch.cat([s[2] for s in seen]) if keep_routing else None)
                grad_norm = self._optimizer_step(stats, completed_steps)
                for k, v in stats.items():
                    totals[k] += v / steps
                totals["grad_norm"] += float(grad_norm) / steps
        self.lr.step()
        return {**totals, "lr": lr}

    def _zero_stats(self, *extra: str) -> dict:
        stats = dict.fromkeys(("loss/policy", "loss/kl", "clip_frac", "kl/ppo", *extra), 0.0)
        if self.value is not None:
            stats["loss/value"] = 0.0
        if self.moe:
            stats.update({"moe/aux_loss": 0.0, "moe/load_entropy": 0.0})
        return stats

    def _accumulate(self, batch: TrainBatch, mini: list[MicroBatch], inputs: UpdateInputs, keep_routing: bool):
        """Backward of one mini-batch's loss, micro-batch by micro-batch (this rank's share); returns its logged
        stats and, when ``inputs.old_lp`` is None, each micro-batch's detached (log-probs, entropies, expert ids
        [rows, sparse layers, k] with ``keep_routing``, else None)."""
        a = self.cfg.algo
        span = slice(mini[0].tokens.start, mini[-1].tokens.stop)
        n_tok, n_seq = algos.batch_counts(batch.mask[span], batch.seq_ids[span])
        terms = _LossTerms(a, n_tok, n_seq, self.cfg.rollout.max_new_tokens)
        stats, seen = self._zero_stats(), []
        self.optimizer.zero_grad(set_to_none=True)
        if self.value is not None:
            self.value_optimizer.zero_grad(set_to_none=True)
        mine = shard_for_rank(mini, self.dp)
        for mb in mine:
            with replaying(self.policy, mb):   # algo.routing_replay: forward and backward (its recomputed layers)
                self._micro_step(mb, batch, inputs, terms, stats, seen, keep_routing, span)
        weights = par.weight_shards(self.policy)   # parallel.shard=params: the layers' gathers are collectives
        if weights is not None:
            weights.idle_passes(-(-len(mini) // self.dp.size) - len(mine))
        return stats, seen

    def _micro_step(self, mb: MicroBatch, batch: TrainBatch, inputs: UpdateInputs, terms: "_LossTerms", stats: dict,
                    seen: list, keep_routing: bool, span: slice) -> None:
        """Forward and backward of one micro-batch's loss terms into the gradients; ``stats`` and ``seen`` as
        :meth:`_accumulate`."""
        a = self.cfg.algo
        sl, mask = mb.tokens, batch.mask[mb.tokens]
        with record_routing() as routing:
            lp, ent = logprobs(self.policy, mb, temperature=self.cfg.rollout.logprob_temperature,
                               with_entropy=a.entropy_coef > 0 or inputs.old_lp is None,
                               sampled=self.cfg.rollout.sampled_scoring)
        if inputs.old_lp is None:
            seen.append((lp.detach(), ent.detach(), routing.expert_ids() if keep_routing else None))
        old = lp.detach() if inputs.old_lp is None else inputs.old_lp[sl]
        loss = terms.policy(lp, old, inputs, mb, mask, stats)
        if inputs.ref_lp is not None:
            loss = loss + terms.kl(lp, inputs.ref_lp[sl], mb, mask, stats)
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * terms.aggregate(ent, mask, mb)
        if self.moe:
            loss = terms.router(loss, routing, len(lp) / max(span.stop - span.start, 1), stats)
        if self.value is not None:
            terms.value_backward(self.value, mb, inputs.value_targets, mask, stats)
        loss.backward()

    def _optimizer_step(self, stats: dict, completed_steps: int) -> torch.Tensor:
        """Sum gradients (and ``stats``, in place) over the data-parallel ranks, clip, step; the grad norm."""
        if isinstance(self.master, ShardedMaster):   # parallel.shard=grads: each rank reduces, clips, steps its range
            stats.update(sum_scalars(stats, self.dp))
            self.master.reduce_gradients()
            grad_norm = self.master.clip(self.cfg.optim.grad_clip)
            self._check_finite(grad_norm, completed_steps)
            self.master.step(self.optimizer)
            return grad_norm
        if self.dp.size > 1:   # deterministic sum over the data-parallel ranks (rank order, fixed tree)
            all_reduce_gradients_(self.policy.parameters(), self.dp)
            if self.value is not None:
                all_reduce_gradients_(self.value.parameters(), self.dp)
            stats.update(sum_scalars(stats, self.dp))
        grad_norm = par.clip_grad_norm_(self.policy, self.cfg.optim.grad_clip)
        self._check_finite(grad_norm, completed_steps)
        self.master.step(self.optimizer)   # parameter by parameter; a plain optimizer.step() without masters
        if self.value is not None:
            par.clip_params_(self.value.parameters(), self.cfg.optim.grad_clip)
            self.value_optimizer.step()
        return grad_norm

    @staticmethod
    def _check_finite(grad_norm: torch.Tensor, completed_steps: int) -> None:
        if not torch.isfinite(grad_norm):
            raise RLAlignError(f"gradient norm is {float(grad_norm)} at step {completed_steps}: lower optim.lr or check "
                               "the rewards; the last checkpoint is intact")


class _LossTerms:
    """The loss terms of one mini-batch's micro-batches, aggregated with the mini-batch's normaliser; each adds
    its logged value to ``stats``."""

    def __init__(self, algo, n_tok: int, n_seq: int, max_len: int):
        self.algo, self.n_tok = algo, n_tok
        self.agg = dict(num_tokens=n_tok, num_seqs=n_seq, max_len=max_len)
        self.loss_fn = algos.POLICY_LOSSES[algo.policy_loss]
        self.knobs = self.loss_fn.knob_values(dataclasses.asdict(algo))

    def aggregate(self, values: torch.Tensor, mask: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return algos.aggregate_loss(values, mask, mb.seq_ids, self.algo.loss_agg, **self.agg)

    def policy(self, lp, old, inputs: UpdateInputs, mb: MicroBatch, mask, stats: dict) -> torch.Tensor:
        """The policy loss (``algo.policy_loss``); also the clip fraction and the PPO KL, token-weighted."""
        sl = mb.tokens
        out = self.loss_fn.fn(lp, old, inputs.token_adv[sl], mask, mb.seq_ids, len(mb.samples),
                              None if inputs.is_weights is None else inputs.is_weights[sl], **self.knobs)
        loss = self.aggregate(out.loss, mask, mb)
        stats["loss/policy"] += float(loss.detach())
        w = int(mask.sum())
        stats["clip_frac"] += float(out.stats.get("clip_frac", torch.tensor(0.0))) * w / max(self.n_tok, 1)
        stats["kl/ppo"] += float(out.stats.get("approx_kl", torch.tensor(0.0))) * w / max(self.n_tok, 1)
        return loss

    def kl(self, lp, ref_lp, mb: MicroBatch, mask, stats: dict) -> torch.Tensor:
        """``kl_coef * KL_k(pi || ref)`` (``algo.kl_estimator``)."""
        kl_term = self.aggregate(algos.kl_estimate(lp, ref_lp, self.algo.kl_estimator), mask, mb)
        stats["loss/kl"] += float(kl_term.detach())
        return self.algo.kl_coef * kl_term

    def router(self, loss, routing, share: float, stats: dict) -> torch.Tensor:
        """``loss`` plus the MoE router's auxiliary loss (``algo.router_aux_coef``) of this micro-batch's
        ``share`` of the mini-batch's rows; logs it and the experts' load entropy either way."""
        aux, load_entropy = algos.routing_terms(routing)
        stats["moe/aux_loss"] += float(aux.detach()) * share
        stats["moe/load_entropy"] += load_entropy * share
        if self.algo.router_aux_coef > 0:
            loss = loss + self.algo.router_aux_coef * share * aux
        return loss

    def value_backward(self, value: ValueModel, mb: MicroBatch, targets: dict, mask, stats: dict) -> None:
        """The value model's loss (clipped around the old values with ``algo.value_clip``), back-propagated."""
        sl = mb.tokens
        vl = self.aggregate(algos.value_loss(value.values(mb), targets["old_values"][sl], targets["returns"][sl],
                                             self.algo.value_clip), mask, mb)
        vl.backward()
        stats["loss/value"] += float(vl.detach())


__all__ = ["LearningRate", "PolicyUpdate", "UpdateInputs", "lr_factor", "needs_rescore"]
