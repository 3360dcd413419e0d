"""The training weights sharded over the data-parallel ranks between uses (``parallel.shard=params``, ZeRO-3 style),
gathered whole for each decoder layer's forward and again for its backward.

Layout: :class:`~rlalign.distributed.data_parallel.FlatShards`, the one ``parallel.shard=grads`` uses for the masters
and AdamW state (the trainable parameters flattened in the model's parameter order, ``dp`` contiguous ranges); rank
r keeps range r of the weights in the parameters' dtype (``local``, one tensor per piece of the range) and nothing
else of them between uses.

Units: each decoder layer's trainable parameters, and the rest (``outer``: embeddings, final norm, an untied LM
head). A unit's parameters are consecutive in parameter order, so each unit is one or a few contiguous ranges of the
flat index space (a run of one dtype each); every parameter of a unit becomes a view of its run's flat buffer (the
decoder's stacked q/k/v views are replaced: rlalign.models.modules.stack_rows says their bits are the same either
way). Released, a buffer's storage has 0 bytes (the parameters keep their shapes, dtypes and autograd identity, so
gradients accumulate in ``.grad`` exactly as without sharding); gathered, it is resized and each range broadcast from
its owner (:func:`~rlalign.distributed.data_parallel.broadcast_segments_`: byte copies, so a gathered weight has the
bits of the unsharded run's weight).

Lifecycle (:meth:`ShardedWeights.install`):

- a decoder layer: gathered by a forward pre-hook, released by its forward hook. With grad, the pre-hook passes the
  layer's inputs through :class:`_ReleaseAfterBackward` (an identity whose backward releases the layer) and the
  forward hook puts a gradient hook on the layer's outputs that gathers the layer again before its backward runs.
  The layer's backward (and, with ``optim.activation_checkpointing``, its recomputed forward) reads the re-gathered
  bytes through the same storages; the gather writes through the flat buffer, so no parameter's version counter moves.
- ranks with fewer micro-batches in a mini-batch than others run :meth:`ShardedWeights.idle_passes` for the
  missing ones: the gathers are collectives, and every rank must join each one in the same order.
- ``outer``: gathered when the embedding runs (a forward pre-hook) and kept until the next :meth:`release_all` (the
  optimizer step's gradient reduction, the trainer's weights push after a step, :meth:`whole` or
  :meth:`full_weights`): for a step's forwards and backwards (the LM head is read outside a module call, after the
  layers).
- the rollout: :meth:`whole` gathers every unit in place for the engine, which reads the policy's own tensors, and
  releases them after it; readers that take the weights away (an engine copy, a checkpoint, the exported policy) get
  :meth:`full_weights`, new tensors assembled one parameter at a time.

So between layers a rank holds its 1/dp of the weights, ``outer`` whole during a step, and one or two layers whole at a
time (the layer running; in backward also the one below it, gathered before the one above releases).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.distributed.data_parallel import FlatShards, broadcast_segments_
from rlalign.distributed.launch import Group


@dataclasses.dataclass
class _Run:
    """Consecutive trainable parameters of one unit and one dtype: global flat range [start, stop), one buffer."""
    indices: list[int]
    start: int
    stop: int
    flat: torch.Tensor

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.flat.element_size()

    @property
    def gathered(self) -> bool:
        return self.flat.untyped_storage().size() > 0


class ShardedWeights:
    """This rank's ranges of the trainable weights (``local``: one tensor per piece of ``shards.pieces(rank)``, in the
    parameters' dtype) and the per-unit gathers of the whole weights (module docstring)."""

    def __init__(self, model: torch.nn.Module, named: list, shards: FlatShards, local: list[torch.Tensor],
                 group: Group):
        self.named, self.shards, self.local, self.group = named, shards, local, group
        self.pieces = shards.pieces(group.rank)
        index = {id(p): i for i, (_, p) in enumerate(named)}
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise RLAlignError("parallel.shard=params needs a decoder (model.model.layers); this model has none")
        in_layers = [sorted(index[id(p)] for p in layer.parameters() if id(p) in index) for layer in layers]
        taken = {i for unit in in_layers for i in unit}
        self.units = [self._runs(unit) for unit in in_layers]
        self.outer = self._runs([i for i in range(len(named)) if i not in taken])
        self.layers, self.embed = layers, model.model.embed_tokens
        self.hooked: list[torch.nn.Module] = []
        self.release_all()

    def _runs(self, indices: list[int]) -> list[_Run]:
        """``indices``' parameters as runs of consecutive indices and one dtype, each made a view of one buffer."""
        groups: list[list[int]] = []
        for i in indices:
            if groups and groups[-1][-1] == i - 1 and self.named[groups[-1][-1]][1].dtype == self.named[i][1].dtype:
                groups[-1].append(i)
            else:
                groups.append([i])
        return [self._run(group) for group in groups]

    @torch.no_grad()
    def _run(self, indices: list[int]) -> _Run:
        """One flat buffer holding consecutive parameters ``indices`` (their values copied in), each rebound to its
        slice of it."""
        offsets, first = self.shards.offsets, self.named[indices[0]][1]
        start, stop = offsets[indices[0]], offsets[indices[-1]] + self.named[indices[-1]][1].numel()
        flat = torch.empty(stop - start, dtype=first.dtype, device=first.device)
        for i in indices:
            p = self.named[i][1]
            view = flat[offsets[i] - start:offsets[i] - start + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view(p.shape)   # the Parameter object stays: its name, grad and optimizer state
        return _Run(indices, start, stop, flat)

    # ---- gathers and releases --------------------------------------------------------------------------------

    def all_runs(self) -> list[_Run]:
        return [run for unit in self.units for run in unit] + self.outer

    @torch.no_grad()
    def gather(self, runs: list[_Run]) -> None:
        """``runs``' buffers whole on every rank: each rank's ranges copied in, then broadcast from their owners.
        Collective: every rank calls it for the same runs in the same order."""
        for run in runs:
            if run.gathered:
                continue
            run.flat.untyped_storage().resize_(run.nbytes)
            offsets = self.shards.offsets
            for k, (i, a, b) in enumerate(self.pieces):
                if run.indices[0] <= i <= run.indices[-1]:
                    at = offsets[i] + a - run.start
                    run.flat[at:at + b - a].copy_(self.local[k])
            broadcast_segments_(run.flat, self.shards.segments(run.start, run.stop), self.group, base=run.start)

    @staticmethod
    def release(runs: list[_Run]) -> None:
        for run in runs:
            run.flat.untyped_storage().resize_(0)

    def release_all(self) -> None:
        """Every unit back to this rank's ranges (after the last backward of a step, or a whole-model read)."""
        self.release(self.all_runs())

    @contextlib.contextmanager
    def whole(self):
        """Every unit gathered in place for the block (the rollout engine reads the policy's own tensors), all
        released after it. Collective."""
        self.gather(self.all_runs())
        try:
            yield
        finally:
            self.release_all()

    def idle_passes(self, count: int) -> None:
        """The gathers of ``count`` forward + backward passes without computing anything: a rank with fewer
        micro-batches than another (its share of a mini-batch is shorter) joins the collectives of their extra
        passes, in their order (``outer`` once, each layer for its forward, each layer from the last for its
        backward), so every rank's gathers pair up."""
        for _ in range(count):
            self.gather(self.outer)
            for unit in self.units + self.units[::-1]:
                self.gather(unit)
                self.release(unit)

    def held_bytes(self) -> int:
        """Bytes of weights this rank holds now: its ranges plus every buffer currently gathered."""
        return (sum(t.numel() * t.element_size() for t in self.local)
                + sum(run.flat.untyped_storage().nbytes() for run in self.all_runs()))

    # ---- the whole weights, for readers outside the step ---------------------------------------------------------

    @torch.no_grad()
    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every trainable weight whole, as new tensors (by name; a collective): what the rollout engine, a
        checkpoint and the exported policy take. One parameter at a time; the units are released first."""
        self.release_all()
        offsets, out = self.shards.offsets, {}
        for i, (name, p) in enumerate(self.named):
            full = torch.empty(p.numel(), dtype=p.dtype, device=p.device)
            for k, (j, a, b) in enumerate(self.pieces):
                if j == i:
                    full[a:b].copy_(self.local[k])
            broadcast_segments_(full, self.shards.segments(offsets[i], offsets[i] + p.numel()), self.group,
                                base=offsets[i])
            out[name] = full.view(p.shape)
        return out

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """This rank's ranges from whole weights (a checkpoint's; names not in ``weights`` keep their values)."""
        self.release_all()
        for k, (i, a, b) in enumerate(self.pieces):
            name = self.named[i][0]
            if name in weights:
                self.local[k].copy_(weights[name].reshape(-1)[a:b].to(self.local[k].device))

    # ---- the hooks -------------------------------------------------------------------------------------------

    def install(self) -> None:
        """The lifecycle's hooks on the decoder layers and the embedding (module docstring)."""
        for unit, layer in zip(self.units, self.layers):
            layer.register_forward_pre_hook(functools.partial(self._before_layer, unit))
            layer.register_forward_hook(functools.partial(self._after_layer, unit))
        self.hooked = list(self.layers)
        self.embed.register_forward_pre_hook(self._before_embedding)

    def _before_embedding(self, module, args) -> None:
        """A forward starts: the layers must still be the hooked modules (a layer swapped in later, e.g. by
        activation checkpointing's wrapper, would run on released weights), then ``outer`` gathered."""
        if any(a is not b for a, b in zip(self.layers, self.hooked)):
            raise RLAlignError("parallel.shard=params: a decoder layer was replaced after its weights were sharded; "
                               "wrap the layers (activation checkpointing) before the training state is built")
        self.gather(self.outer)

    def _before_layer(self, unit: list[_Run], module, args):
        self.gather(unit)
        if not torch.is_grad_enabled():
            return None
        at = [k for k, a in enumerate(args[:2]) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not at:
            return None
        passed = _ReleaseAfterBackward.apply(self, unit, *(args[k] for k in at))
        passed = passed if isinstance(passed, tuple) else (passed,)
        args = list(args)
        for k, t in zip(at, passed):
            args[k] = t
        return tuple(args)

    def _after_layer(self, unit: list[_Run], module, args, output):
        if torch.is_grad_enabled():
            outs = output if isinstance(output, tuple) else (output,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._gather_for_backward, unit))
        self.release(unit)
        return None

    def _gather_for_backward(self, unit: list[_Run], grad: torch.Tensor) -> None:
        self.gather(unit)


class _ReleaseAfterBackward(torch.autograd.Function):
    """Identity on a layer's inputs; its backward -- once the gradients of the layer's inputs are complete, that is
    after every node of the layer's backward that reads its weights -- releases the layer's weights."""

    @staticmethod
    def forward(ctx, owner: ShardedWeights, unit: list, *xs):
        ctx.owner, ctx.unit = owner, unit
        return xs if len(xs) > 1 else xs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner.release(ctx.unit)
        return (None, None, *grads)


__all__ = ["ShardedWeights"]
