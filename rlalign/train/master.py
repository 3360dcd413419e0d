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

Memory (per parameter, AdamW): bf16 without masters 2 (w) + 2 (grad) + 4 (bf16 m, v) = 8 bytes;
with masters 2 + 2 + 4 (fp32 master) + 8 (fp32 m, v) = 16 bytes, of which 12 move to CPU memory
with ``optim.offload=true``.
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.distributed.collectives import gather_ranks_varlen
from rlalign.distributed.launch import Group


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
    def grads_to_master(self) -> None:
        """Widen each low-precision gradient into its master's ``.grad`` (exact) and free it on the model."""
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
    def load_state_dict(self, state: "dict[str, torch.Tensor] | None") -> None:
        """Restore the masters (then the model from them). ``None`` (a checkpoint written without
        masters): each master starts from the model's current weights."""
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


def full_masters(master: MasterWeights, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded masters by name (exact all-gathers of the TP shards of ``model``), for the checkpoint."""

    group = getattr(model, "tp_group", None) or Group.single()
    out = {}
    for (name, p), m in zip(master.named, master.masters):
        if m is None:
            continue
        dim = getattr(p, "tp_dim", None)
        t = m.detach().to(p.device)
        out[name] = (t if dim is None else torch.cat(gather_ranks_varlen(t.contiguous(), group, dim=dim), dim=dim)).cpu()
    return out


__all__ = ["MasterWeights", "full_masters"]
