"""Sharded training state over the data-parallel ranks (``parallel.shard=grads``, ZeRO-2 style), bit for bit the
unsharded data-parallel run's.

Layout (:class:`~rlalign.distributed.data_parallel.FlatShards`): the trainable parameters, in the model's
parameter order, flattened one after another; rank r owns the r-th of ``parallel.dp`` contiguous ranges (sizes
differ by at most one element). For its range alone a rank holds the fp32 masters (or, without a master, works
on a view of the weight itself), AdamW's ``exp_avg`` / ``exp_avg_sq`` and, between the gradient reduction and the
optimizer step, the reduced gradient. Every rank keeps the full low-precision weights (the forward, the rollout
engine and the reference model read them) -- except with ``parallel.shard=params``, where it keeps its range of them
(``local``) and :class:`~rlalign.train.weight_shards.ShardedWeights` gathers them where they are used; the step then
rounds each master range into that range and nothing is broadcast.

One optimizer step (:meth:`ShardedMaster.reduce_gradients`, :meth:`clip`, :meth:`step`), and why each part has
the unsharded bits:

1. Reduce-scatter (:func:`~rlalign.distributed.data_parallel.reduce_scatter_gradients`): the same buckets and,
   per element, the same fixed tree of the ranks' fp32 values in rank order as ``all_reduce_gradients_``; each
   rank merges only its range, then rounds once to the parameter's dtype (as the unsharded run rounds into
   ``p.grad``). The model's local gradients are freed.
2. Gradient norm: per checkpoint tensor (rlalign.models.layout, stacked experts per expert) the same per-tensor
   part as :func:`rlalign.train.parallel.total_norm` takes (``norm_part``), computed by the one rank that holds
   the whole tensor, or by every rank on an exact copy of a tensor that lies across ranges (assembled by
   broadcasts, one tensor at a time); the parts are exchanged (widened to float64: exact) and combined by
   ``norm_from_parts`` in checkpoint order: the unsharded norm's bits.
3. Clip: ``g.mul_(clamp(max_norm / (norm + 1e-6), max=1))``, torch's clip_grads_with_norm_ arithmetic, per
   element.
4. AdamW (:func:`rlalign.train.master.step_chunked`, the unsharded step's own code): elementwise, so stepping a
   range gives the range of the whole step's bits; the stepped range is rounded into the weight, then every
   range is broadcast from its owner (bytes only) so that every rank holds the full weights again.

Checkpoints: one part file per rank (:meth:`part_state`: its ranges of the masters and AdamW state; written by
rlalign.train.checkpointing) next to the main file, which holds the full low-precision weights and the
:meth:`layout`. A resume at any ``parallel.dp`` reads the ranges it needs from the parts (:meth:`load_parts`); a
``parallel.shard=none`` run gets them assembled into the unsharded format (:func:`unsharded_state`); a sharded run
also resumes from an unsharded checkpoint (:meth:`load_state_dict`, :meth:`load_optimizer_state`).
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.distributed.collectives import gather_ranks
from rlalign.distributed.data_parallel import (DEFAULT_BUCKET_ELEMENTS, FlatShards, broadcast_segments_, comm_device,
                                               reduce_scatter_gradients)
from rlalign.distributed.launch import Group
from rlalign.models.layout import checkpoint_entries
from rlalign.train import parallel as par
from rlalign.train.master import DEFAULT_STEP_CHUNK, MasterWeights, adamw_groups, check_rounded, step_chunked
from rlalign.train.weight_shards import ShardedWeights


def training_master(cfg, policy: torch.nn.Module, group) -> "MasterWeights | ShardedMaster":
    """The optimizer-state owner of a run: each dp rank's ranges with ``parallel.shard=grads`` (and of the weights
    themselves with ``parallel.shard=params``: rlalign.train.weight_shards), else the whole state (fp32 masters for
    low-precision weights, rlalign.train.master)."""
    o = cfg.optim
    if cfg.parallel.shard in ("grads", "params"):
        return ShardedMaster(policy, group, o.master_weights, o.step_chunk_elements,
                             shard_params=cfg.parallel.shard == "params")
    return MasterWeights(policy, o.master_weights, o.offload, o.step_chunk_elements)


class ShardedMaster:
    """The masters, AdamW state and reduced gradients of this rank's range (module docstring); the interface of
    :class:`~rlalign.train.master.MasterWeights` the trainer uses, plus the gradient reduction and the clip."""

    def __init__(self, model: torch.nn.Module, group: Group, enabled: bool = True,
                 chunk_elements: int = DEFAULT_STEP_CHUNK, bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
                 shard_params: bool = False):
        self.model, self.group = model, group
        self.chunk_elements, self.bucket_elements = chunk_elements, bucket_elements
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        for name, p in self.named:
            if not p.is_contiguous():
                raise RLAlignError(f"parallel.shard: {name} is not contiguous; its range cannot be a flat view")
        self.has_master = [enabled and p.dtype != torch.float32 for _, p in self.named]
        self.shards = FlatShards(tuple(p.numel() for _, p in self.named), group.size)
        self.pieces = self.shards.pieces(group.rank)   # (parameter index, lo, hi) in parameter coordinates
        with torch.no_grad():
            # parallel.shard=params: this rank's ranges of the weights, the only copy it keeps between uses
            self.local = [self._weight(i)[a:b].clone() for i, a, b in self.pieces] if shard_params else None
            # a master range is an fp32 copy; without a master the optimizer steps (a view of) the weight itself
            self.stepped = [self._range_weight(k).float().clone() if self.has_master[i] else self._range_weight(k)
                            for k, (i, _, _) in enumerate(self.pieces)]
        self.grads: list[torch.Tensor | None] = [None] * len(self.pieces)
        self.units = self._units()
        self.weights = None
        if shard_params:   # the parameters become views of per-layer buffers, released until used
            self.weights = ShardedWeights(model, self.named, self.shards, self.local, group)
            self.weights.install()
            model.__dict__["weight_shards"] = self.weights   # rlalign.train.parallel's whole-weight readers

    # ---- layout ---------------------------------------------------------------------------------------------

    def _weight(self, i: int) -> torch.Tensor:
        return self.named[i][1].detach().view(-1)

    def _range_weight(self, k: int) -> torch.Tensor:
        """The weight elements of piece k: this rank's own copy with parallel.shard=params, else a view of the
        (whole) parameter."""
        if self.local is not None:
            return self.local[k]
        i, a, b = self.pieces[k]
        return self._weight(i)[a:b]

    def _units(self) -> list[tuple[int, int, int, tuple]]:
        """The gradient norm's tensors (the checkpoint's, in checkpoint order): (parameter index, lo, hi in the
        parameter's flat coordinates, shape)."""
        index = {name: i for i, (name, _) in enumerate(self.named)}
        out = []
        for entry in checkpoint_entries(self.model):
            i = index.get(entry.param_name)
            if i is None:
                continue
            p = self.named[i][1]
            if entry.index is None:
                out.append((i, 0, p.numel(), tuple(p.shape)))
            else:
                size = p[0].numel()
                out.append((i, entry.index * size, (entry.index + 1) * size, tuple(p.shape[1:])))
        return out

    @property
    def active(self) -> bool:
        """Whether the run has fp32 masters (a checkpoint then stores ``master`` and ``model_rounded``)."""
        return any(self.has_master)

    def optim_params(self) -> list[torch.Tensor]:
        """What the optimizer steps: this rank's ranges, in parameter order."""
        return self.stepped

    # ---- one optimizer step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """This rank's range of the gradients summed over the data-parallel ranks, each rounded once to its
        parameter's dtype; the model's gradients are freed."""
        if self.weights is not None:   # the step's backwards are done: the embeddings and head go back to ranges
            self.weights.release_all()
        params = [p for _, p in self.named]
        summed = reduce_scatter_gradients(params, self.shards, self.group, self.bucket_elements)
        self.grads = [s.to(params[i].dtype) for s, (i, _, _) in zip(summed, self.pieces)]
        for p in params:
            p.grad = None

    @torch.no_grad()
    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale this rank's gradient ranges by torch's clip factor of the global norm; returns the norm, the bits
        of :func:`rlalign.train.parallel.clip_grad_norm_` on the unsharded gradients."""
        total = self.grad_norm()
        clip_coef = max_norm / (total + 1e-6)
        clamped = torch.clamp(clip_coef, max=1.0)
        for g in self.grads:
            if g is not None:
                g.mul_(clamped.to(g.device))
        return total

    def grad_norm(self) -> torch.Tensor:
        """The unsharded global norm of the reduced gradients (module docstring, step 2)."""
        params = [p for _, p in self.named]
        mode = par.norm_mode(params)
        offsets, parts, mine = self.shards.offsets, [None] * len(self.units), []
        owner_of = []
        for u, (i, lo, hi, shape) in enumerate(self.units):
            segments = self.shards.segments(offsets[i] + lo, offsets[i] + hi)
            owner_of.append(segments[0][0] if len(segments) == 1 else None)
            if len(segments) == 1 and segments[0][0] != self.group.rank:
                continue
            part = par.norm_part(self._unit_grad(i, lo, hi, segments).view(shape), mode)
            parts[u] = part
            if len(segments) == 1:
                mine.append(part)
        # the parts of tensors held whole by one rank, exchanged in unit order (float64 holds them exactly)
        counts = [sum(1 for o in owner_of if o == r) for r in range(self.group.size)]
        device = comm_device(self.group) if self.group.size > 1 else params[0].device
        packed = torch.zeros(max(counts + [1]), dtype=torch.float64, device=device)
        for k, part in enumerate(mine):
            packed[k] = part.to(device, torch.float64)
        gathered = gather_ranks(packed, self.group)
        taken = [0] * self.group.size
        for u, owner in enumerate(owner_of):
            if owner is None:
                continue
            value = gathered[owner][taken[owner]]
            taken[owner] += 1
            i = self.units[u][0]
            dtype = torch.float32 if mode == "fixed" else params[i].dtype
            parts[u] = value.to(dtype).to(params[i].device)
        return par.norm_from_parts(parts, mode)

    def _unit_grad(self, i: int, lo: int, hi: int, segments) -> torch.Tensor:
        """The reduced gradient of elements [lo, hi) of parameter i: a view of this rank's range when it holds
        them all, else an exact copy assembled from every owner (and empty for an empty tensor)."""
        p = self.named[i][1]
        k = next((k for k, (j, a, b) in enumerate(self.pieces) if j == i and a <= lo and hi <= b), None)
        if k is not None and len(segments) == 1:
            a = self.pieces[k][1]
            return self.grads[k][lo - a:hi - a]
        full = torch.empty(hi - lo, dtype=p.dtype, device=p.device)
        base = self.shards.offsets[i]
        for k, (j, a, b) in enumerate(self.pieces):
            if j == i and max(a, lo) < min(b, hi):
                full[max(a, lo) - lo:min(b, hi) - lo] = self.grads[k][max(a, lo) - a:min(b, hi) - a]
        broadcast_segments_(full, segments, self.group, base=base + lo)
        return full

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """AdamW on this rank's ranges (``step_chunked``: the unsharded step's arithmetic; each master range
        rounded into its weight), then every range broadcast from its owner: the full new weights on every rank."""
        groups = adamw_groups(optimizer, self.stepped)
        grads, self.grads = self.grads, [None] * len(self.pieces)
        for k, (i, a, b) in enumerate(self.pieces):
            if grads[k] is None:
                continue
            stepped = self.stepped[k]
            model = self._range_weight(k) if self.has_master[i] else None
            step_chunked(optimizer.state[stepped], groups[id(stepped)], stepped, grads, k, model,
                         self.chunk_elements, self.named[i][0])
        optimizer.step()   # no gradient is set: steps nothing, runs the optimizer's hooks (the lr schedule's count)
        self.gather_weights()

    @torch.no_grad()
    def gather_weights(self) -> None:
        """Every rank's ranges of the weights broadcast from their owners (exact copies); with parallel.shard=params
        the weights stay in ranges (gathered per layer when used): any gathered unit is released."""
        if self.weights is not None:
            self.weights.release_all()
            return
        offsets = self.shards.offsets
        for i, (_, p) in enumerate(self.named):
            segments = self.shards.segments(offsets[i], offsets[i] + p.numel())
            broadcast_segments_(self._weight(i), segments, self.group, base=offsets[i])

    # ---- checkpoints: one part per rank ------------------------------------------------------------------------

    def layout(self, optimizer: torch.optim.Optimizer) -> dict:
        """What a checkpoint's main file says of its parts: the rank count, the trainable parameters (names, sizes,
        which have a master) and AdamW's hyperparameters (its param group without the parameters)."""
        group = {k: v for k, v in optimizer.state_dict()["param_groups"][0].items() if k != "params"}
        return {"ranks": self.group.size, "names": [n for n, _ in self.named], "numels": list(self.shards.numels),
                "has_master": list(self.has_master), "param_group": group}

    def part_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """This rank's part of a checkpoint: its ranges ``pieces`` [(parameter index, lo, hi)] and per range the
        master (None without one: the weight itself is in the main file), AdamW's ``exp_avg`` / ``exp_avg_sq`` and
        ``step`` (None before the first step). Plain data and flat tensors."""
        state = optimizer.state
        per = [state.get(t) or {} for t in self.stepped]
        return {"pieces": [list(p) for p in self.pieces],
                "master": [t.detach() if self.has_master[i] else None
                           for t, (i, _, _) in zip(self.stepped, self.pieces)],
                "exp_avg": [s.get("exp_avg") for s in per], "exp_avg_sq": [s.get("exp_avg_sq") for s in per],
                "step": [float(s["step"]) if "step" in s else None for s in per]}

    @torch.no_grad()
    def load_parts(self, optimizer: torch.optim.Optimizer, layout: dict, parts: list[dict]) -> None:
        """This rank's ranges from a checkpoint's parts, written at any ``parallel.dp``: each range copied from
        the old ranges that overlap it (exact copies), masters rounded into the weights (the main file's weights
        are those roundings already), the AdamW state loaded into ``optimizer``."""
        self._check_layout(layout)
        old = {}   # parameter index -> [(lo, hi, part, position)]
        for part in parts:
            for pos, (i, a, b) in enumerate(part["pieces"]):
                old.setdefault(i, []).append((a, b, part, pos))
        state = {}
        for k, (i, a, b) in enumerate(self.pieces):
            sources = [(lo, hi, part, pos) for lo, hi, part, pos in old.get(i, []) if max(lo, a) < min(hi, b)]
            if sum(min(hi, b) - max(lo, a) for lo, hi, _, _ in sources) != b - a:
                raise RLAlignError(f"the checkpoint's parts do not cover {self.named[i][0]}: it is incomplete")
            steps = {part["step"][pos] for _, _, part, pos in sources}
            if len(steps) != 1:
                raise RLAlignError(f"the checkpoint's parts hold different step counts for {self.named[i][0]}: corrupt")
            if self.has_master[i]:
                self._fill(self.stepped[k], a, sources, "master")
                self._range_weight(k).copy_(self.stepped[k].to(self.named[i][1].dtype))
            step = steps.pop()
            if step is not None:
                moments = {key: torch.empty_like(self.stepped[k]) for key in ("exp_avg", "exp_avg_sq")}
                for key, t in moments.items():
                    self._fill(t, a, sources, key)
                scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state[k] = {"step": torch.tensor(step, dtype=scalar), **moments}
        group = layout["param_group"]
        self._load_ranges_state(optimizer, state, group)

    def _load_ranges_state(self, optimizer: torch.optim.Optimizer, state: dict, group: dict) -> None:
        """``state`` (range index -> AdamW state) into ``optimizer`` with the hyperparameters ``group``."""
        params = list(range(len(self.pieces)))
        optimizer.load_state_dict({"state": state, "param_groups": [{**group, "params": params}]})

    @staticmethod
    def _fill(target: torch.Tensor, a: int, sources, key: str) -> None:
        """``target`` (this rank's range starting at element ``a`` of its parameter) from the overlapping old ranges."""
        b = a + target.numel()
        for lo, hi, part, pos in sources:
            x, y = max(lo, a), min(hi, b)
            target[x - a:y - a].copy_(part[key][pos][x - lo:y - lo])

    def _check_layout(self, layout: dict) -> None:
        if layout["names"] != [n for n, _ in self.named] or list(layout["numels"]) != list(self.shards.numels):
            raise RLAlignError("the checkpoint's sharded state does not fit this model's trainable parameters: it was "
                               "written for another model")
        if list(layout["has_master"]) != list(self.has_master):
            raise RLAlignError("the checkpoint's sharded state was written with other fp32 masters: resume with the "
                               "checkpoint's optim.master_weights and model.dtype")

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of the sharded state this rank holds: its master ranges (not the views of fp32 weights) and their
        AdamW ``exp_avg`` / ``exp_avg_sq``."""
        weights = {id(t) for t in self.local or ()}   # without masters the stepped ranges are the weights
        total = sum(t.numel() * t.element_size() for t in self.stepped if t._base is None and id(t) not in weights)
        for t in self.stepped:
            for key in ("exp_avg", "exp_avg_sq"):
                v = optimizer.state.get(t, {}).get(key)
                total += 0 if v is None else v.numel() * v.element_size()
        return total

    @torch.no_grad()
    def load_state_dict(self, state: "dict[str, torch.Tensor] | None", rounded: "dict[str, str] | None" = None) -> None:
        """This rank's master ranges from a checkpoint's unsharded masters (``None``: from the weights, which
        the caller loaded first), each rounded into its weight, then every range broadcast: the full weights."""
        check_rounded({name: (p, self.has_master[i]) for i, (name, p) in enumerate(self.named)}, state, rounded or {})
        for k, (i, a, b) in enumerate(self.pieces):
            if not self.has_master[i]:
                continue
            name, p = self.named[i]
            if state is None:
                self.stepped[k].copy_(self._range_weight(k).float())
                continue
            if name not in state:
                raise RLAlignError(f"the checkpoint's master weights lack {name}: it was written by another model")
            self.stepped[k].copy_(state[name].reshape(-1)[a:b].to(self.stepped[k].device))
            self._range_weight(k).copy_(self.stepped[k].to(p.dtype))
        self.gather_weights()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, stored) -> None:
        """A checkpoint's unsharded AdamW state (any ``parallel.dp``, sharded or not) cut to this rank's ranges."""
        if isinstance(stored, list):
            raise RLAlignError("the checkpoint's optimizer state was written with parallel.tp: resume it with the same "
                               "parallel.tp and parallel.shard=none")
        groups = stored["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.named):
            raise RLAlignError("the checkpoint's optimizer state does not fit this model's trainable parameters: it "
                               "was written for another model")
        state = {}
        for k, (i, a, b) in enumerate(self.pieces):
            s = stored["state"].get(i)
            if s is None:
                continue
            dtype = self.stepped[k].dtype
            state[k] = {"step": s["step"].clone(),
                        "exp_avg": s["exp_avg"].reshape(-1)[a:b].to(self.stepped[k].device, dtype).clone(),
                        "exp_avg_sq": s["exp_avg_sq"].reshape(-1)[a:b].to(self.stepped[k].device, dtype).clone()}
        group = {key: v for key, v in groups[0].items() if key != "params"}
        self._load_ranges_state(optimizer, state, group)




def unsharded_state(layout: dict, parts: list[dict], shapes: dict[str, torch.Size]) -> tuple[dict, dict]:
    """A checkpoint's parts (every rank's, any order) as the unsharded format: (masters by name, torch's AdamW state
    dict over every trainable parameter in order) -- what a ``parallel.shard=none`` run at any ``parallel.dp``
    loads. ``shapes``: each parameter's shape (the main file's weights)."""
    names, numels = layout["names"], layout["numels"]
    ranges: dict[int, list] = {}
    for part in parts:
        for pos, (i, a, b) in enumerate(part["pieces"]):
            ranges.setdefault(i, []).append((a, b, part, pos))
    masters, state = {}, {}
    for i, name in enumerate(names):
        pieces = sorted(ranges.get(i, []), key=lambda r: r[0])
        ends = [0] + [b for _, b, _, _ in pieces]
        if [a for a, _, _, _ in pieces] != ends[:-1] or ends[-1] != numels[i]:
            raise RLAlignError(f"the checkpoint's parts do not cover {name}: it is incomplete")
        if not pieces:   # an empty parameter: no range holds it
            if layout["has_master"][i]:
                masters[name] = torch.zeros(shapes[name])
            continue

        def whole(key: str) -> torch.Tensor:
            return torch.cat([part[key][pos] for _, _, part, pos in pieces]).view(shapes[name])

        if layout["has_master"][i]:
            masters[name] = whole("master")
        steps = {part["step"][pos] for _, _, part, pos in pieces}
        if len(steps) != 1:
            raise RLAlignError(f"the checkpoint's parts hold different step counts for {name}: it is corrupt")
        step = steps.pop()
        if step is not None:
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state[i] = {"step": torch.tensor(step, dtype=scalar), "exp_avg": whole("exp_avg"),
                        "exp_avg_sq": whole("exp_avg_sq")}
    return masters, {"state": state, "param_groups": [{**layout["param_group"], "params": list(range(len(names)))}]}


__all__ = ["ShardedMaster", "unsharded_state"]
