"""Parallel training runs: process groups and the trainer's parallel-aware steps (the training glue over
:mod:`rlalign.distributed`; spawning the processes is :func:`rlalign.train.loop.launch_parallel`).

``rlalign train parallel.dp=2 parallel.tp=2`` (no torchrun) spawns dp * tp processes (gloo on CPU,
NCCL on GPU, one per GPU) that each run the ordinary training loop; under
``torchrun --nproc-per-node 4 -m rlalign.cli.main train parallel.dp=2 parallel.tp=2`` each process
joins torchrun's job. Ranks are laid out TP-major: TP groups are consecutive ranks.

- dp: every rank holds the same weights; each DP rank generates a share of the step's prompts and all
  ranks receive all samples (:mod:`rlalign.train.dp_rollout`); scoring is replicated; each DP rank
  back-propagates a contiguous share of the step's micro-batches and
  :func:`rlalign.distributed.all_reduce_gradients_` sums the gradients (deterministic, rank order).
- tp: the policy is parallelized (canonical partitions, docs/distributed.md); the rollout engine
  and the reference model keep unsharded copies (their forward bits are the TP bits); the engine
  receives the gathered full weights after each step; gradient clipping uses the norm of the
  gathered full gradients (the same bits at every tp); checkpoints hold the full weights and each
  TP rank's optimizer state.
- The writer (global rank 0) alone writes metrics, checkpoints and the final policy; every rank
  resumes from them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection

import torch
import torch.distributed as dist
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from rlalign import mklmode
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import Profile, current_profile
from rlalign.distributed.launch import Group, init_from_env, split
from rlalign.distributed.parallelize import full_state
from rlalign.models.decoder import CausalLM
from rlalign.models.layout import checkpoint_entries, checkpoint_split, stack_checkpoint_names
from rlalign.reductions import norm_of_square_sums, square_sum
from rlalign.train.master import ROUNDED_KEY
from rlalign.train.run.checkpoint_files import own_optimizer_state


def needs_launch(cfg) -> bool:
    """True when this process must start the parallel job (dp * tp > 1, no process group, no torchrun)."""
    return cfg.parallel.world_size > 1 and not dist.is_initialized() and "RANK" not in os.environ


def check_parallel_device(cfg) -> None:
    """A job of several processes takes one GPU per rank (the rank's current device): a model.device that
    names one GPU (cuda:0) would put every rank on it. One line, before any process starts."""
    device = str(cfg.model.device)
    if cfg.parallel.world_size > 1 and device.startswith("cuda:"):
        raise RLAlignError(f"model.device={device} puts every one of the {cfg.parallel.world_size} processes of "
                           "parallel.dp * parallel.tp on one GPU: use model.device=cuda (rank r takes GPU r; pick "
                           "the GPUs with CUDA_VISIBLE_DEVICES)")


def parallel_groups(cfg) -> tuple[Group | None, Group]:
    """(tp group, or None when parallel.tp is unset; dp group), joining torchrun's job when needed."""
    tp = cfg.parallel.tp
    if cfg.parallel.world_size == 1:
        return (Group.single() if tp else None), Group.single()
    if cfg.launcher != "local":
        raise RLAlignError(f"parallel.dp/tp > 1 run with launcher=local (got launcher={cfg.launcher})")
    check_parallel_device(cfg)
    world = Group.world() if dist.is_initialized() else init_from_env(cfg.model.device)
    if world.size != cfg.parallel.world_size:
        raise RLAlignError(f"parallel.dp * parallel.tp = {cfg.parallel.world_size} but the job has {world.size} "
                           "processes: make them equal")
    tp_group, dp_group = split(world, tp or 1)
    return (tp_group if tp else None), dp_group


def is_writer(tp: Group | None, dp: Group) -> bool:
    return dp.rank == 0 and (tp is None or tp.rank == 0)


def shared_run_dir(cfg) -> str:
    """Rank 0's run directory on every rank (a default timestamped name could differ across ranks)."""
    chosen = [cfg.run.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"]
    if cfg.parallel.world_size > 1:   # only this job's default group (the Ray launcher's groups are its own)
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


# ---- the policy under TP ----------------------------------------------------------------------------

def parallelized(policy) -> bool:
    return getattr(policy, "tp_group", None) is not None


def weight_shards(policy):
    """The policy's :class:`~rlalign.train.weight_shards.ShardedWeights` with ``parallel.shard=params``, else None."""
    return policy.__dict__.get("weight_shards")


def policy_weights(policy) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights by name: what the rollout engine and checkpoints take (with
    ``parallel.shard=params`` gathered from every rank's ranges into new tensors: a collective)."""
    if parallelized(policy):
        return full_state(policy)
    state = policy.state_dict()
    shards = weight_shards(policy)
    return state if shards is None else {**state, **shards.full_weights()}


@torch.no_grad()
def load_policy_weights(policy, weights: dict[str, torch.Tensor], absent: Collection[str] = ()) -> None:
    """Load full weights into a (possibly parallelized) policy: each rank copies its slice. The names in
    ``absent`` are not in ``weights`` (a checkpoint stores a weight with an fp32 master only as the
    master); the caller sets them (MasterWeights.load_state_dict). Any other missing or extra name is an
    error naming it."""
    names = set(policy.state_dict()) if not parallelized(policy) else {n for n, _ in policy.named_parameters()}
    missing, extra = sorted(names - set(weights) - set(absent)), sorted(set(weights) - names)
    if missing or extra:
        what = f"lack {missing[0]}" if missing else f"hold {extra[0]}, which the policy does not have"
        raise RLAlignError(f"the checkpoint's model weights {what}: it was written for another model")
    shards = weight_shards(policy)
    if shards is not None:   # parallel.shard=params: each rank copies its ranges; anything else (buffers) as is
        shards.load_weights(weights)
        sharded = {name for name, _ in shards.named}
        policy.load_state_dict({k: v for k, v in weights.items() if k not in sharded}, strict=False)
        return
    if not parallelized(policy):
        policy.load_state_dict(weights, strict=False)
        return
    for name, p in policy.named_parameters():
        if name not in weights:
            continue
        full = weights[name]
        if getattr(p, "tp_dim", None) is not None:
            start, stop = p.tp_range
            full = full.narrow(p.tp_dim, start, stop - start)
        p.copy_(full)


def clip_grad_norm_(policy, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ (foreach=False) with the total norm taken over the gradients of the
    checkpoint's tensors in checkpoint order (rlalign.models.layout: stacked experts per expert), so it has
    the same bits whatever the storage layout; under TP over the gathered full gradients, so it has the
    tp=1 bits, and each rank scales its shards. The norm is :func:`total_norm`'s."""
    params = list(policy.parameters())
    if parallelized(policy):
        grads = full_state(policy, grads=True)
    else:
        grads = {name: p.grad for name, p in policy.named_parameters() if p.grad is not None}
    total = total_norm([g for _, g in checkpoint_split(policy, grads)])
    clip_with_norm_(params, max_norm, total)
    return total


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients' global L2 norm. CPU tensors in the cross-machine mode (``RLALIGN_CPU_CROSS_MACHINE=1``):
    rlalign.reductions.global_norm (a fixed pairwise order, the same bits on every x86 CPU whatever its vector
    width); otherwise torch's get_total_norm (foreach=False). Equal, bit for bit, to
    ``norm_from_parts([norm_part(g, mode) for g in grads], mode)`` with ``mode = norm_mode(grads)``: the form a
    sharded run computes, each rank the parts of the tensors it holds (rlalign.train.sharding)."""
    if not grads:
        return torch.nn.utils.get_total_norm(grads, foreach=False)
    mode = norm_mode(grads)
    return norm_from_parts([norm_part(g, mode) for g in grads], mode)


def norm_mode(grads: list[torch.Tensor]) -> str:
    """"fixed" (rlalign.reductions' order: CPU tensors in the cross-machine mode, any tensors in the portable
    profile) or "torch"."""
    if current_profile() is Profile.PORTABLE:
        return "fixed"   # on every device
    return "fixed" if all(g.device.type == "cpu" for g in grads) and mklmode.cross_machine() else "torch"


def norm_part(grad: torch.Tensor, mode: str) -> torch.Tensor:
    """One tensor's part of the global norm: its fp32 tree sum of squares ("fixed") or its own L2 norm in its
    dtype ("torch": what torch's get_total_norm takes per tensor, foreach=False)."""
    return square_sum(grad) if mode == "fixed" else torch.linalg.vector_norm(grad, 2.0)


def norm_from_parts(parts: list[torch.Tensor], mode: str) -> torch.Tensor:
    """The global norm from every tensor's :func:`norm_part`, in the tensors' order. "torch": get_total_norm's
    combination -- the parts grouped by (device, dtype) by torch's own grouping (the order of its hash map, not
    the list's: the parts have their tensors' devices and dtypes, so the groups come in the same order), stacked
    on the first part's device, their L2 norm."""
    if mode == "fixed":
        return norm_of_square_sums(parts, parts[0].device)
    grouped = _group_tensors_by_device_and_dtype([parts])
    first = parts[0].device
    ordered = [p.to(first) for ([group], _) in grouped.values() for p in group]
    return torch.linalg.vector_norm(torch.stack(ordered), 2.0)


def clip_params_(params, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over ``params`` (in their order) with :func:`total_norm`; the norm."""
    params = [p for p in params if p.grad is not None]
    total = total_norm([p.grad for p in params])
    clip_with_norm_(params, max_norm, total)
    return total


def clip_with_norm_(params, max_norm: float, total: torch.Tensor) -> None:
    """Scale the gradients by min(1, max_norm / (total + 1e-6)): torch's clip_grads_with_norm_ (foreach=False); in
    the portable profile the factor in Python floats (IEEE double), rounded once to fp32, one elementwise multiply
    per gradient (torch's divides by a 0-dim tensor: a reciprocal multiply on CUDA)."""
    if current_profile() is not Profile.PORTABLE:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
        return
    factor = min(max_norm / (float(total) + 1e-6), 1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(torch.full((1, ), factor, dtype=torch.float32, device=p.grad.device).to(p.grad.dtype))


def restack_run_state(policy, state: dict) -> dict:
    """A run checkpoint's state in the policy's parameter layout: a checkpoint written while MoE experts were
    one parameter per expert and projection (before 2026-12-01) has its weights, masters and the names it
    stores only as masters stacked (rlalign.models.layout), and its AdamW state too (per expert ``exp_avg``
    / ``exp_avg_sq`` stacked; every expert of a projection must have taken the same number of steps, else
    one line refuses the resume). Bit for bit: resuming equals having run with stacked experts throughout
    when every expert had a gradient at every step. Other checkpoints are returned as they are."""
    stacked = {e.checkpoint_name for e in checkpoint_entries(policy) if e.index is not None}
    if not stacked or not any(name in stacked for key in ("model", "master") for name in (state.get(key) or {})):
        return state
    out = dict(state)
    try:
        for key in ("model", "master", ROUNDED_KEY):
            if state.get(key):
                out[key] = stack_checkpoint_names(policy, state[key])
    except ValueError as exc:
        raise RLAlignError(f"the checkpoint's per-expert weights cannot be stacked ({exc}): it was written for "
                           "another model") from None
    if "optimizer" in state:
        stored = state["optimizer"]
        out["optimizer"] = ([_stack_optimizer_state(policy, s) for s in stored] if isinstance(stored, list)
                            else _stack_optimizer_state(policy, stored))
    return out


def _stack_optimizer_state(policy, stored: dict) -> dict:
    """An optimizer state dict over the per-expert parameters (one index per checkpoint tensor, in checkpoint
    order) as one over the policy's parameters."""
    entries, params = checkpoint_entries(policy), [n for n, _ in policy.named_parameters()]
    groups = stored["param_groups"]
    if len(groups) != 1 or len(groups[0]["params"]) != len(entries):
        raise RLAlignError("the checkpoint's optimizer state does not fit this model's per-expert parameters: it was "
                           "written for another model")
    found: dict[str, list] = {}
    for old_id, entry in zip(groups[0]["params"], entries):
        found.setdefault(entry.param_name, []).append(stored["state"].get(old_id))
    state = {}
    for new_id, name in enumerate(params):
        parts = found[name]
        if len(parts) == 1 or all(p is None for p in parts):
            if parts[0] is not None:
                state[new_id] = parts[0]
            continue
        steps = {None if p is None else float(p["step"]) for p in parts}
        if len(steps) != 1:
            raise RLAlignError(f"the checkpoint's experts of {name} took different numbers of optimizer steps "
                               f"({sorted(map(str, steps))}): their AdamW state cannot be stacked; export the "
                               "checkpoint (rlalign export) and start a new run from it")
        state[new_id] = {key: torch.stack([p[key] for p in parts]) if key != "step" else parts[0][key]
                         for key in parts[0]}
    return {"state": state, "param_groups": [dict(groups[0], params=list(range(len(params))))]}


def optimizer_state(optimizer, tp: Group | None):
    """What a checkpoint stores: the state dict, or under TP every TP rank's (a list in rank order)."""
    state = optimizer.state_dict()
    if tp is None:
        return state
    states = [None] * tp.size
    if tp.size > 1:
        dist.all_gather_object(states, state, group=tp.pg)
    else:
        states = [state]
    return states


def load_optimizer_state(optimizer, stored, tp: Group | None) -> None:
    """``stored`` (a checkpoint's, see :func:`optimizer_state`) into ``optimizer``, in memory of its own."""
    if isinstance(stored, list) != (tp is not None) or (tp is not None and len(stored) != tp.size):
        raise RLAlignError("the checkpoint's optimizer state was written with another parallel.tp: resume with the "
                           "same parallel.tp")
    optimizer.load_state_dict(stored if tp is None else stored[tp.rank])
    own_optimizer_state(optimizer)   # off the checkpoint file's mapping


def unsharded_policy(policy):
    """The policy as an ordinary CausalLM (a new one with the gathered weights under TP or parallel.shard=params; a
    collective there)."""
    if not parallelized(policy) and weight_shards(policy) is None:
        return policy
    model = CausalLM(policy.config, dtype=policy.dtype, device=policy.device)
    model.load_state_dict(policy_weights(policy))
    return model


__all__ = ["weight_shards", "needs_launch", "check_parallel_device", "parallel_groups", "is_writer", "shared_run_dir", "policy_weights",
           "load_policy_weights", "clip_grad_norm_", "clip_params_", "total_norm", "norm_mode", "norm_part", "norm_from_parts", "restack_run_state",
           "optimizer_state", "load_optimizer_state", "unsharded_policy"]
