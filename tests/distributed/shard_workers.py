"""Run inside spawned gloo processes (importable by the children): the sharded training state
(rlalign.train.sharding; with the weights sharded too, rlalign.train.weight_shards) against the unsharded
data-parallel step, on the same weights and samples."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from rlalign.distributed.data_parallel import all_reduce_gradients_, shard_for_rank
from rlalign.distributed.launch import Group, split
from rlalign.models import ForwardBatch
from rlalign.models.lora import TARGETS, LoRASpec, apply_lora
from rlalign.train import parallel as par
from rlalign.train.master import MasterWeights, full_masters
from rlalign.train.sharding import ShardedMaster, unsharded_state
from tests.distributed.workers import SHAPE, _family_model

# a dense bf16 model with fp32 masters and a bf16 Qwen3-MoE (stacked experts: the norm's tensors are per expert,
# across the stacked parameters); an fp32 model (no masters: the optimizer steps views of the weights) is the
# default model of the `rlalign train` test (test_train_parallel.py); the dense model with LoRA adapters (the base
# frozen: only the adapters are trainable, so only they are sharded)
CASES = (("qwen3", "bfloat16"), ("qwen3_moe", "bfloat16"), ("qwen3-lora", "bfloat16"))
# parallel.shard=params (the weights sharded, each decoder layer gathered when used): full fine-tuning only
PARAMS_CASES = (("qwen3", "bfloat16"), ("qwen3_moe", "bfloat16"))
STEPS, RESUMED = 2, 1
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
MAX_NORM = 0.05   # below the gradients' norm: the clip scales every step


def _model(family: str, dtype: str):
    """The family's tiny model; "-lora": rank-4 adapters on every projection, the base frozen (only the adapters
    are trainable, so only they are sharded)."""
    base, _, lora = family.partition("-")
    model = _family_model(base, dtype).train()
    if lora:
        apply_lora(model, LoRASpec(rank=4, alpha=8.0, targets=TARGETS), seed=1)
    return model


def _samples(vocab: int, step: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(50 + step)
    return [torch.randint(3, min(vocab, 320), (n,), generator=gen).tolist() for n in (9, 21, 5, 14, 30, 11, 7, 16, 12)]


def _backward(model, group: Group, step: int) -> None:
    """This rank's share of the step's samples, one micro-batch per sample, accumulated in .grad (9 samples: the
    ranks' shares differ in length; with the weights sharded a shorter share joins the extra passes' gathers, as
    rlalign.train.update does)."""
    samples = _samples(model.config.vocab_size, step)
    mine = shard_for_rank(samples, group)
    for seq in mine:
        targets = torch.tensor(seq[1:] + [0])
        lp, ent = model.logprobs(ForwardBatch.packed([seq]), targets, with_entropy=True)
        (-(lp.sum() + 0.1 * ent.sum()) / 100.0).backward()
    weights = par.weight_shards(model)
    if weights is not None:
        weights.idle_passes(-(-len(samples) // group.size) - len(mine))


class _Plain:
    """The unsharded data-parallel step (rlalign.train.update without the losses)."""

    def __init__(self, model, group: Group):
        self.model, self.group = model, group
        self.master = MasterWeights(model, enabled=True)
        self.optimizer = torch.optim.AdamW(self.master.optim_params(), **ADAMW)

    def step(self, step: int) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        _backward(self.model, self.group, step)
        if self.group.size > 1:
            all_reduce_gradients_(self.model.parameters(), self.group)
        norm = par.clip_grad_norm_(self.model, MAX_NORM)
        self.master.step(self.optimizer)
        return norm

    def state(self) -> dict:
        return {"master": full_masters(self.master, self.model), "optimizer": self.optimizer.state_dict()}

    def load(self, state: dict) -> None:
        self.master.load_state_dict(state["master"] or None)
        par.load_optimizer_state(self.optimizer, copy.deepcopy(state["optimizer"]), None)


class _Sharded(_Plain):
    shard_params = False

    def __init__(self, model, group: Group, bucket_elements: int = 1 << 28):
        self.model, self.group = model, group
        self.master = ShardedMaster(model, group, enabled=True, bucket_elements=bucket_elements,
                                    shard_params=self.shard_params)
        self.optimizer = torch.optim.AdamW(self.master.optim_params(), **ADAMW)

    def step(self, step: int) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        _backward(self.model, self.group, step)
        self.master.reduce_gradients()
        norm = self.master.clip(MAX_NORM)
        self.master.step(self.optimizer)
        return norm

    def state(self) -> dict:
        """Every rank's checkpoint part (exchanged), assembled into the unsharded format as a resume does."""
        parts = [None] * self.group.size
        dist.all_gather_object(parts, self.master.part_state(self.optimizer), group=self.group.pg)
        layout = self.master.layout(self.optimizer)
        shapes = {n: p.shape for n, p in self.model.named_parameters()}
        masters, optimizer = unsharded_state(layout, parts, shapes)
        return {"master": masters, "optimizer": optimizer, "layout": layout, "parts": parts}

    def load(self, state: dict) -> None:
        if "parts" in state:   # the parts of a sharded run, as a sharded resume reads them
            self.master.load_parts(self.optimizer, state["layout"], state["parts"])
        else:
            self.master.load_state_dict(state["master"] or None)
            self.master.load_optimizer_state(self.optimizer, state["optimizer"])


class _ShardedParams(_Sharded):
    """parallel.shard=params: the weights in ranges too; records the bytes of weights this rank holds -- the most
    after any layer's gather (``held_peak``) and between steps (``held_between_steps``)."""
    shard_params = True

    def __init__(self, model, group: Group, bucket_elements: int = 1 << 28):
        super().__init__(model, group, bucket_elements)
        weights, self.held_peak = self.master.weights, 0
        gather = weights.gather

        def measured(runs):
            gather(runs)
            self.held_peak = max(self.held_peak, weights.held_bytes())

        weights.gather = measured

    def step(self, step: int) -> torch.Tensor:
        norm = super().step(step)
        self.held_between_steps = self.master.weights.held_bytes()
        return norm


def _weights(model) -> dict:
    whole = par.policy_weights(model)   # gathered from the ranks' ranges with parallel.shard=params
    return {n: whole[n].detach().clone() for n, _ in model.named_parameters()}


def _run(kind, base, group: Group, steps, start: int = 0, state: "dict | None" = None, **kw) -> dict:
    trainer = kind(copy.deepcopy(base), group, **kw)
    if state is not None:
        par.load_policy_weights(trainer.model, state["weights"], absent=state["rounded"])
        trainer.load(state)
    norms = [trainer.step(start + s) for s in range(steps)]
    out = {"norms": norms, "weights": _weights(trainer.model), **trainer.state()}
    if isinstance(trainer, _ShardedParams):
        out.update(held_peak=trainer.held_peak, held_between_steps=trainer.held_between_steps,
                   weight_bytes=sum(p.numel() * p.element_size() for p in trainer.model.parameters()))
    if isinstance(trainer, _Sharded):
        out["state_bytes"] = trainer.master.state_bytes(trainer.optimizer)
    else:
        out["state_bytes"] = sum(t.numel() * t.element_size() for t in out["master"].values()) + sum(
            v.numel() * v.element_size() for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step")
    return out


def shard_suite(world: Group) -> dict:
    """At dp = 2 (ranks 0-1 and 2-3) and dp = 4: the unsharded and the sharded step from the same weights, STEPS
    steps (the dp=2 sharded run with buckets of 1,000 elements: ranges cut across buckets and parameters); then
    the dp=2 sharded run's checkpoint parts resumed at dp = 4, sharded (its ranges read from the parts) and not
    (the parts assembled into the unsharded format), for RESUMED steps."""
    pair = split(world, 2)[0]
    out = {}
    for family, dtype in CASES:
        base = _model(family, dtype)
        res = out[(family, dtype)] = {}
        for dp, group in {2: pair, 4: world}.items():
            res[("plain", dp)] = _run(_Plain, base, group, STEPS)
            res[("sharded", dp)] = _run(_Sharded, base, group, STEPS, bucket_elements=1000 if dp == 2 else 1 << 28)
        dp2 = res[("sharded", 2)]
        res[("resumed-plain", 4)] = _run(_Plain, base, world, RESUMED, STEPS, state_for_resume(dp2, parts=False))
        res[("resumed-sharded", 4)] = _run(_Sharded, base, world, RESUMED, STEPS, state_for_resume(dp2, parts=True))
        if (family, dtype) in PARAMS_CASES:
            for dp, group in {2: pair, 4: world}.items():
                res[("params", dp)] = _run(_ShardedParams, base, group, STEPS,
                                           bucket_elements=1000 if dp == 2 else 1 << 28)
            # the dp=2 params run's parts and weights at dp=4, with the weights sharded and not
            params2 = res[("params", 2)]
            res[("resumed-params", 4)] = _run(_ShardedParams, base, world, RESUMED, STEPS,
                                              state_for_resume(params2, parts=True))
            res[("resumed-params-plain", 4)] = _run(_Plain, base, world, RESUMED, STEPS,
                                                    state_for_resume(params2, parts=False))
        for run in res.values():
            run.pop("parts", None)
    return out


def state_for_resume(run: dict, parts: bool) -> dict:
    """What a checkpoint restore reads, from a run's results: the unsharded format (``parts`` False: the weights
    with a master left out, as a parallel.shard=none checkpoint stores them) or the sharded run's parts (every
    weight, the layout and the parts)."""
    if parts:
        return {"weights": run["weights"], "rounded": {}, "layout": run["layout"], "parts": run["parts"]}
    return {"weights": {n: w for n, w in run["weights"].items() if n not in run["master"]}, "master": run["master"],
            "rounded": run["master"], "optimizer": run["optimizer"]}
