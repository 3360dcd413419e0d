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

The optimizer step (:meth:`MasterWeights.step`) goes one parameter at a time and, within a
parameter, one chunk of at most ``chunk_elements`` elements at a time (``optim.step_chunk_elements``,
default 64Mi): widen the chunk's gradient, step the chunk (torch's AdamW arithmetic on views of the
master and of its AdamW state), round it back into the model. AdamW is elementwise: an element's new
value depends only on its own gradient, master, m, v and the step count, so the chunks give the bits of
one whole-parameter step, which gives the bits of widening every gradient first and stepping them all
(``foreach=False`` updates each parameter from its own gradient and state alone; tested bit for bit
over sizes and chunk sizes in tests/train/test_master.py). The working set is therefore fixed: one
chunk's fp32 gradient and AdamW's two fp32 temporaries (sqrt(v), then its bias correction), 12 bytes x
``chunk_elements`` (768 MiB at 64Mi), next to the masters -- not 12 bytes x the largest parameter
(7 GiB for an 8B model's 622M-element embedding).

Memory (per parameter, AdamW): bf16 without masters 2 (w) + 2 (grad) + 4 (bf16 m, v) = 8 bytes;
with masters 2 + 2 + 4 (fp32 master) + 8 (fp32 m, v) = 16 bytes, of which 12 move to CPU memory
with ``optim.offload=true``; plus the step's working set of one chunk.

Parameters are updated in place, never rebound: the model's tensors keep their storage for the life of
the run (a rollout engine that shares them, and its captured CUDA graphs, stay valid).

Checkpoints store a master-backed weight only as its master (:func:`weights_to_store`): the model
copy is ``m.to(p.dtype)`` by construction, so it is derived on load with the same rounding
(:meth:`MasterWeights.load_state_dict`, :func:`checkpoint_model_weights`), bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch.optim.adam import adam as adam_arithmetic

from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import Profile, current_profile
from rlalign.ops.portable import arith
from rlalign.distributed.collectives import gather_ranks_varlen

ROUNDED_KEY = "model_rounded"   # a checkpoint's {name: dtype} of the model weights it stores only as masters
DEFAULT_STEP_CHUNK = 1 << 26    # elements stepped at once: 64Mi, a 768 MiB fp32 working set (optim.step_chunk_elements)


class MasterWeights:
    def __init__(self, model: torch.nn.Module, enabled: bool = True, offload: bool = False,
                 chunk_elements: int = DEFAULT_STEP_CHUNK):
        if chunk_elements < 1:
            raise RLAlignError(f"optim.step_chunk_elements must be >= 1 (got {chunk_elements})")
        self.chunk_elements = int(chunk_elements)
        # trainable parameters only: frozen ones (a LoRA run's base weights) get no master and no optimizer state
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
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
        """One AdamW step of every parameter, one parameter at a time in the model's parameter order and,
        within a parameter, ``chunk_elements`` elements at a time (:func:`step_chunked`): the chunk's
        gradient moved next to its master and widened to fp32 (exact), torch's AdamW arithmetic on the
        chunk's views of the master (or of the parameter itself, without a master) and of its AdamW state,
        then ``p[chunk] = m[chunk].to(p.dtype)``; a parameter's gradient is freed once its last chunk is widened.
        ``optimizer`` must be the ``torch.optim.AdamW`` (or Adam) with ``foreach=False`` that steps
        :meth:`optim_params`; its state (``step``, ``exp_avg``, ``exp_avg_sq``) is kept in torch's layout,
        so checkpoints and ``optimizer.state_dict()`` are unchanged.

        Bitwise equal to the all-at-once step (:meth:`grads_to_master`, ``optimizer.step()``,
        :meth:`master_to_model`): AdamW with ``foreach=False`` updates each parameter from its own gradient
        and state alone and each element from its own values alone, so neither the order of the
        parameters nor the chunking enters any value (tests/train/test_master.py). Clip the gradients
        before (the global norm needs them all; clipping scales the model's gradients in place)."""
        groups = adamw_groups(optimizer, self.optim_params())
        grads = []
        for _, p in self.named:   # set aside, so that each gradient can be freed as soon as its parameter is stepped
            grads.append(p.grad)
            p.grad = None
        for i, ((name, p), m) in enumerate(zip(self.named, self.masters)):
            if grads[i] is None:
                continue
            stepped = p if m is None else m
            step_chunked(optimizer.state[stepped], groups[id(stepped)], stepped, grads, i,
                          None if m is None else p, self.chunk_elements, name)
        optimizer.step()   # no gradient is set: steps nothing, runs the optimizer's hooks (the lr schedule's count)

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
        check_rounded({name: (p, m is not None) for (name, p), m in zip(self.named, self.masters)}, state, rounded)


def check_rounded(here: dict, state, rounded: dict[str, str]) -> None:
    """A checkpoint's ``model_rounded`` (``rounded``: {name: dtype}) fits this run: ``here`` maps each trainable
    parameter's name to (parameter, whether it has a master); each name must have a master here, of that dtype,
    or its weight would be left unset. One line otherwise."""
    if rounded and state is None:
        raise RLAlignError("the checkpoint stores model weights only as fp32 masters but holds no masters: "
                           "it is corrupt; restore it, or start the run afresh with run.overwrite=true")
    for name, dtype in rounded.items():
        p, has_master = here.get(name, (None, False))
        if not has_master:
            raise RLAlignError(f"the checkpoint stores {name} only as its fp32 master, but this run has no master "
                               "for it: resume with the checkpoint's optim.master_weights / optim.offload")
        if _dtype_name(p.dtype) != dtype:
            raise RLAlignError(f"the checkpoint's {name} is the {dtype} rounding of its master, but the model holds "
                               f"{_dtype_name(p.dtype)}: resume with the checkpoint's model.dtype")


def adamw_groups(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[int, dict]:
    """id(parameter) -> its param group, after checking that the optimizer is the one :meth:`MasterWeights.step`
    reproduces (AdamW / Adam, single-tensor path) and that it steps ``params``."""
    if not isinstance(optimizer, torch.optim.Adam):
        raise RLAlignError(f"MasterWeights.step steps torch.optim.AdamW, got {type(optimizer).__name__}")
    groups = {}
    for group in optimizer.param_groups:
        # foreach=None would let optimizer.step() pick the multi-tensor path on a GPU (other kernels, other bits)
        unsupported = [k for k in ("fused", "capturable", "differentiable", "amsgrad") if group.get(k)]
        if group.get("foreach") is not False or unsupported:
            raise RLAlignError(f"MasterWeights.step runs AdamW's single-tensor arithmetic chunk by chunk; build the "
                               f"optimizer with foreach=False{' and without ' + ', '.join(unsupported) if unsupported else ''}")
        groups.update({id(p): group for p in group["params"]})
    missing = [i for i, p in enumerate(params) if id(p) not in groups]
    if missing:
        raise RLAlignError(f"the optimizer does not step parameter {missing[0]} of MasterWeights.optim_params()")
    return groups


def _init_adam_state(state: dict, param: torch.Tensor) -> None:
    """AdamW's lazy state, as ``torch.optim.Adam._init_group`` makes it (foreach=False, not fused or capturable):
    ``step`` a host scalar of the default float dtype's scalar type, ``exp_avg`` and ``exp_avg_sq`` zeros like
    the parameter."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    state["step"] = torch.tensor(0.0, dtype=scalar, device="cpu")
    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _flat(t: torch.Tensor, what: str, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise RLAlignError(f"{name}: the optimizer step works on flat views, but its {what} is not contiguous")
    return t.view(-1)


def step_chunked(state: dict, group: dict, stepped: torch.Tensor, grads: list, index: int,
                  model: "torch.Tensor | None", chunk: int, name: str) -> None:
    """One AdamW step of ``stepped`` (a master, or a parameter without one) with the gradient ``grads[index]``,
    ``chunk`` elements at a time; with ``model`` (the low-precision parameter of a master) each stepped chunk is
    rounded into it. The gradient is taken out of ``grads`` and freed once its last chunk is widened.

    Each chunk runs ``torch.optim.adam.adam`` (the arithmetic ``AdamW.step`` runs, foreach=False) on views
    of the chunk, with its own copy of the step count (every chunk sees step t and computes t + 1; the state
    then holds t + 1, as after one whole step). A 0-element parameter still counts its step, as torch's does.
    Numerics: elementwise only, so a chunk's elements get the bits of the whole-parameter step."""
    if not state:
        _init_adam_state(state, stepped)
    flat = _flat(stepped, "master" if model is not None else "weight", name)
    grad_flat, grads[index] = grads[index].reshape(-1), None   # the only reference from here on
    exp_avg, exp_avg_sq = _flat(state["exp_avg"], "AdamW m", name), _flat(state["exp_avg_sq"], "AdamW v", name)
    model_flat = None if model is None else _flat(model, "weight", name)
    beta1, beta2 = group["betas"]
    n = flat.numel()
    for start in range(0, max(n, 1), chunk):
        part = slice(start, min(start + chunk, n))
        # bf16 copied to the master's device first, then widened there: the same exact fp32 values
        g = grad_flat[part].to(flat.device).to(flat.dtype)
        if part.stop == n:
            grad_flat = None   # every chunk widened: free the low-precision gradient before the last chunk's step
        step = state["step"].clone()
        if current_profile() is Profile.PORTABLE:
            portable_adamw_(flat[part], g, exp_avg[part], exp_avg_sq[part], step, group)
        else:
            adam_arithmetic([flat[part]], [g], [exp_avg[part]], [exp_avg_sq[part]], [], [step], foreach=False,
                            capturable=False, differentiable=False, fused=None, has_complex=stepped.is_complex(),
                            decoupled_weight_decay=group.get("decoupled_weight_decay", False), amsgrad=False,
                            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                            eps=group["eps"], maximize=group["maximize"])
        del g
        if model_flat is not None:   # round to nearest even on the master's device, then move
            model_flat[part].copy_(flat[part].to(model.dtype))
    state["step"].copy_(step)


def portable_adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
                    group: dict) -> None:
    """One AdamW step (torch's AdamW formula, decoupled weight decay) of fp32 ``p`` in place, in the portable
    profile's arithmetic: every tensor operation one correctly rounded elementwise op (no lerp / addcmul / addcdiv,
    which a GPU kernel may contract into FMAs), scalars in Python floats (IEEE double) each rounded once to fp32 where
    they meet a tensor, divisions by tensors, the square root correctly rounded (rlalign.ops.portable.arith). The
    same bits on the CPU and a CUDA GPU; ``step`` (a host scalar) is incremented. With t the new step:

        p = p * (1 - lr wd);  m = m * b1 + g * (1 - b1);  v = v * b2 + (g * g) * (1 - b2)
        p = p - (m / (sqrt(v) / sqrt(1 - b2^t) + eps)) * (lr / (1 - b1^t))
    """
    beta1, beta2 = group["betas"]
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    if group["maximize"] or group.get("amsgrad"):
        raise RLAlignError("the portable profile's AdamW steps without maximize / amsgrad")
    step += 1
    t = float(step)
    if wd != 0.0:
        p.mul_(1.0 - lr * wd)
    m.mul_(beta1)
    m.add_(g * (1.0 - beta1))
    v.mul_(beta2)
    v.add_((g * g) * (1.0 - beta2))
    denom = arith.div(arith.sqrt(v), math.sqrt(1.0 - beta2 ** t)) + eps
    p.sub_(arith.div(m, denom) * (lr / (1.0 - beta1 ** t)))


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


__all__ = ["MasterWeights", "check_rounded", "step_chunked", "adamw_groups", "DEFAULT_STEP_CHUNK", "ROUNDED_KEY", "checkpoint_model_weights", "full_masters", "weights_to_store"]
