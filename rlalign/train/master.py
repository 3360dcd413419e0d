"""fp32 master weights for a low-precision policy (``optim.master_weights``, ``optim.offload``).

Why: AdamW's step at a small learning rate is far below half a bf16 ULP of most weights
(|w| ~ 0.02, lr 1e-6: the update is ~5e-5 of |w|, half an ULP is ~2e-3 of |w|), so stepping bf16
parameters directly rounds almost every update away (measured: one step at lr 1e-6 changed 1.7%
of bf16 weights vs 84.9% of fp32 ones). Here every low-precision parameter ``p`` has an fp32
master ``m``; the optimizer (and its state) works on ``m`` only, and after each step

    p = m.to(p.dtype)            # round-to-nearest-even, the one rounding from master to model

so the strict forward, the rollout engine, the reference copy and the exported checkpoint all see
the same low-precision tensor, made by one stated rounding (identical on both sides). Gradients
are computed by the low-precision model (as before), clipped there, and widened to fp32 exactly.

fp32 parameters have no master (``m`` would be ``p``): an fp32 run is unchanged bit for bit. With
``optim.offload=true`` every parameter gets a master in CPU memory, and the optimizer state lives
with it: the device keeps only the model copy and its gradients.

The optimizer step (:meth:`MasterWeights.step`) goes one parameter at a time: widen its gradient,
step it, round it back. So at most one fp32 gradient exists at a time, next to its master (4 bytes x
the largest parameter, not 4 bytes x every parameter), with the same bits as widening every gradient
first and stepping them all: AdamW with ``foreach=False`` updates each parameter from its own
gradient and state alone.

Memory (per parameter, AdamW): bf16 without masters 2 (w) + 2 (grad) + 4 (bf16 m, v) = 8 bytes;
with masters 2 + 2 + 4 (fp32 master) + 8 (fp32 m, v) = 16 bytes, of which 12 move to CPU memory
with ``optim.offload=true``; plus the step's working set of the largest parameter.

Checkpoints store a master-backed weight only as its master (:func:`weights_to_store`): the model
copy is ``m.to(p.dtype)`` by construction, so it is derived on load with the same rounding
(:meth:`MasterWeights.load_state_dict`, :func:`checkpoint_model_weights`), bit for bit.
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.distributed.collectives import gather_ranks_varlen

ROUNDED_KEY = "model_rounded"   # a checkpoint's {name: dtype} of the model weights it stores only as masters


class MasterWeights:
    def __init__(self, model: torch.nn.Module, enabled: bool = True, offload: bool = False):
        self.named = list(model.named_parameters())
        self.masters: list[torch.Tensor | None] = []
        for _, p in self.named:
            wants = enabled and (p.dtype != torch.float32 or offload)
            device = torch.device("cpu") if offload else p.device
            self.masters.append(p.detach().to(device=device, dtype=torch.float32, copy=True).requires_grad_(True)
                                if wants else None)

    @property
    def active(self) -> bool:
        return any(m is not None for m in self.masters)

    def optim_params(self) -> list[torch.Tensor]:
        """What the optimizer steps, in the model's parameter order: the master, or the parameter itself."""
        return [m if m is not None else p for (_, p), m in zip(self.named, self.masters)]

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step of every parameter, one parameter at a time in the model's parameter order:
        its gradient moved next to its master and widened to fp32 (exact), an ``optimizer.step()`` with only
        that gradient set (AdamW skips parameters without one), then ``p = m.to(p.dtype)`` and the gradient
        freed. ``optimizer`` must step :meth:`optim_params`.

        Bitwise equal to the all-at-once step (:meth:`grads_to_master`, ``optimizer.step()``,
        :meth:`master_to_model`): AdamW with ``foreach=False`` updates each parameter from its own gradient
        and state alone, in a loop over the parameters, so the order of the loop and the calls does not
        enter any value (tests/train/test_master.py). Clip the gradients before (the global norm needs
        them all; clipping scales the model's gradients in place). Without masters: ``optimizer.step()``."""
        if not self.active:
            optimizer.step()
            return
        grads = []
        for _, p in self.named:   # set aside: one optimizer.step() per parameter must see only its gradient
            grads.append(p.grad)
            p.grad = None
        for i, ((_, p), m) in enumerate(zip(self.named, self.masters)):
            grad, grads[i] = grads[i], None
            if grad is None:
                continue
            stepped = p if m is None else m
            # bf16 copied to the master's device first, then widened there: the same exact fp32 values
            stepped.grad = grad if m is None else grad.to(m.device).to(torch.float32)
            del grad
            optimizer.step()
            stepped.grad = None
            if m is not None:
                p.copy_(m.to(p.dtype).to(p.device))

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """Widen each low-precision gradient into its master's ``.grad`` (exact) and free it on the model.
        With ``optimizer.step()`` and :meth:`master_to_model` this is the all-at-once step that :meth:`step`
        equals bit for bit while holding every widened gradient at once; the tests' reference."""
        for (_, p), m in zip(self.named, self.masters):
            if m is None:
                continue
            m.grad = None if p.grad is None else p.grad.to(device=m.device, dtype=torch.float32)
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """``p = m.to(p.dtype)``: round to nearest even on the master's device, then move."""
        for (_, p), m in zip(self.named, self.masters):
            if m is not None:
                p.copy_(m.to(p.dtype).to(p.device))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """name -> master (plain CPU fp32 tensors; under TP each rank's shard: see :func:`full_masters`)."""
        return {name: m.detach().to("cpu") for (name, _), m in zip(self.named, self.masters) if m is not None}

    @torch.no_grad()
    def load_state_dict(self, state: "dict[str, torch.Tensor] | None", rounded: "dict[str, str] | None" = None) -> None:
        """Restore the masters (then the model from them: ``p = m.to(p.dtype)``). ``None`` (a checkpoint
        written without masters): each master starts from the model's current weights. ``rounded``: the
        checkpoint's {name: dtype} of the model weights it stores only as masters (:func:`weights_to_store`);
        each must be a parameter with a master here, of that dtype, or its weight would be left unset."""
        self._check_rounded(state, rounded or {})
        for (name, p), m in zip(self.named, self.masters):
            if m is None:
                continue
            if state is None:
                m.copy_(p.detach().to(m.device, torch.float32))
                continue
            if name not in state:
                raise RLAlignError(f"the checkpoint's master weights lack {name}: it was written by another model")
            src = state[name]
            dim = getattr(p, "tp_dim", None)
            if dim is not None and src.shape != m.shape:
                start, stop = p.tp_range
                src = src.narrow(dim, start, stop - start)
            m.copy_(src.to(m.device))
        self.master_to_model()

    def _check_rounded(self, state, rounded: dict[str, str]) -> None:
        if rounded and state is None:
            raise RLAlignError("the checkpoint stores model weights only as fp32 masters but holds no masters: "
                               "it is corrupt; restore it, or start the run afresh with run.overwrite=true")
        here = {name: (p, m) for (name, p), m in zip(self.named, self.masters)}
        for name, dtype in rounded.items():
            p, m = here.get(name, (None, None))
            if m is None:
                raise RLAlignError(f"the checkpoint stores {name} only as its fp32 master, but this run has no master "
                                   "for it: resume with the checkpoint's optim.master_weights / optim.offload")
            if _dtype_name(p.dtype) != dtype:
                raise RLAlignError(f"the checkpoint's {name} is the {dtype} rounding of its master, but the model holds "
                                   f"{_dtype_name(p.dtype)}: resume with the checkpoint's model.dtype")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_FLOAT_DTYPES = {_dtype_name(d): d for d in (torch.bfloat16, torch.float16, torch.float32)}


def _rounding_dtype(name: str) -> torch.dtype:
    if name not in _FLOAT_DTYPES:
        raise RLAlignError(f"the checkpoint names {name!r} as a model dtype (expected one of "
                           f"{', '.join(_FLOAT_DTYPES)}): it is corrupt")
    return _FLOAT_DTYPES[name]


def weights_to_store(weights: dict[str, torch.Tensor], masters: dict[str, torch.Tensor]
                     ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split the model weights for a checkpoint: (the weights to store, {name: dtype} of those left out).

    A weight with a master is left out: after every optimizer step and every load it is exactly
    ``masters[name].to(dtype)`` (:meth:`MasterWeights.step`, :meth:`MasterWeights.master_to_model`), so
    storing it again would only cost its bytes (2 per parameter in bf16). Buffers and weights without a
    master are stored."""
    rounded = {name: _dtype_name(w.dtype) for name, w in weights.items() if name in masters}
    return {name: w for name, w in weights.items() if name not in rounded}, rounded


def checkpoint_model_weights(state: dict) -> dict[str, torch.Tensor]:
    """Every model weight of a checkpoint state, by name: each one left out (``state["model_rounded"]``)
    rounded from its master with the trainer's one rounding (bit for bit the weight the run used), then
    the stored ones. A checkpoint written before 2026-12-01 stores them all."""
    rounded = state.get(ROUNDED_KEY) or {}
    masters = state.get("master") or {}
    missing = [name for name in rounded if name not in masters]
    if missing:
        raise RLAlignError(f"the checkpoint stores {missing[0]} only as its fp32 master but holds no such master: it "
                           "is corrupt")
    out = {name: masters[name].to(_rounding_dtype(dtype)) for name, dtype in rounded.items()}
    out.update(state["model"])
    return out


def full_masters(master: MasterWeights, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded masters by name, for the checkpoint. Without TP: the masters themselves, where they are
    (no copy; torch.save moves a device tensor to the host one at a time as it writes it). Under TP: exact
    all-gathers of the shards of ``model``, on the host (a full copy of the masters)."""

    group = getattr(model, "tp_group", None)
    out = {}
    for (name, p), m in zip(master.named, master.masters):
        if m is None:
            continue
        dim = getattr(p, "tp_dim", None) if group is not None else None
        if dim is None:
            out[name] = m.detach()
            continue
        t = m.detach().to(p.device)
        out[name] = torch.cat(gather_ranks_varlen(t.contiguous(), group, dim=dim), dim=dim).cpu()
    return out


__all__ = ["MasterWeights", "ROUNDED_KEY", "checkpoint_model_weights", "full_masters", "weights_to_store"]
