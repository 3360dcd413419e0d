"""LoRA adapters on the strict ops, and PEFT's file format for them.

A target projection ``y = x W^T (+ b)`` of the decoder becomes (:class:`LoRALinear`, unmerged)

    base  = ops.linear(x, W, b, k_segments)               # the frozen weight, exactly the plain projection's bits
    delta = ops.linear(ops.linear(drop(x), A, k_segments), B)   # A [r, in], B [out, r]: two strict GEMMs
    y     = (base.float() + delta.float() * s).to(dtype)   # s = alpha / r (alpha / sqrt(r) with rsLoRA)

Every piece is a per-row op of the contract, and the combine is elementwise in fp32 with one rounding to the
stream dtype, so a row's ``y`` depends only on that row: the rollout engine and the trainer, which run the same
modules, get the same bits (docs/design/lora.md: why unmerged). ``A``'s reduction over ``in`` follows the base
projection's canonical K partition (o_proj, down_proj). Only ``A`` and ``B`` train: :func:`apply_lora` freezes
every other parameter (no gradient, no fp32 master, no optimizer state).

PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``): tensor names are
``base_model.model.`` + the parameter name (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``),
A [r, in], B [out, r]; :func:`save_adapter` writes it, :func:`read_adapter` reads one (what rlalign cannot run the
same way -- DoRA, per-module ranks, biases, extra trained modules -- is refused in one line).

:func:`merged_copy` folds the adapters into plain weights: ``W' = (W.float() + s * (B.float() @ A.float()))``
rounded once to the weight dtype; it equals the unmerged forward within the rounding of ``W'`` (a Hugging Face
checkpoint holds one weight per projection), not bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from rlalign import ops
from rlalign.contract.errors import RLAlignError
from rlalign.models.atomic import default_file_mode
from rlalign.models.modules import Linear
from rlalign.models.ownership import OutputRefused, check_output_folder

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class LoRAError(RLAlignError):
    """A LoRA setting, adapter folder or model that rlalign cannot run as asked."""


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """rank r >= 1, alpha (scale s = alpha / r, or alpha / sqrt(r) with ``rslora``), dropout on the adapter's
    input in [0, 1), and the projections it adapts (names of :data:`TARGETS`)."""
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ATTENTION_TARGETS
    rslora: bool = False

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise LoRAError(f"model.lora.rank must be an integer >= 1 (got {self.rank!r})")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise LoRAError(f"model.lora.dropout must be in [0, 1) (got {self.dropout!r})")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise LoRAError(f"model.lora.targets must be distinct names of {', '.join(TARGETS)} "
                            f"(got {list(self.targets)})")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class LoRAFactor(nn.Module):
    """One factor (``lora_A`` or ``lora_B``): a ``weight`` parameter, named as PEFT names it."""

    def __init__(self, rows: int, cols: int, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros((rows, cols), dtype=dtype, device=device))


class LoRALinear(Linear):
    """A :class:`Linear` whose frozen ``weight`` (and ``bias``) keep their names and tensors, plus ``lora_A``
    [r, in] and ``lora_B`` [out, r]; forward = :func:`lora_linear` (module docstring)."""

    def __init__(self, base: Linear, spec: LoRASpec):
        nn.Module.__init__(self)
        self.weight, self.bias, self.k_segments = base.weight, base.bias, base.k_segments
        out_features, in_features = base.weight.shape
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_A = LoRAFactor(spec.rank, in_features, dtype, device)
        self.lora_B = LoRAFactor(out_features, spec.rank, dtype, device)
        self.scaling = spec.scaling
        self.dropout = float(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora_linear(x, self.weight, self.bias, self.lora_A.weight, self.lora_B.weight, self.scaling,
                           k_segments=self.k_segments, dropout=self.dropout if self.training else 0.0)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: "torch.Tensor | None", a: torch.Tensor,
                b: torch.Tensor, scaling: float, *, k_segments: "int | None" = None,
                dropout: float = 0.0) -> torch.Tensor:
    """``x W^T (+ bias) + s (drop(x) A^T) B^T``, unmerged, on the strict ops (module docstring: the roundings).
    Dropout applies only where a gradient is being taken (scoring forwards and the rollout run without it); its
    masks come from :func:`dropout_seed`'s generator (torch's global one outside it). A strict run refuses it: the
    training forward would drop what the rollout kept, so their log-probs could not agree."""
    base = ops.linear(x, weight, bias, k_segments=k_segments)
    if dropout > 0.0 and torch.is_grad_enabled():
        x = _dropout(x, dropout)
    delta = ops.linear(ops.linear(x, a, k_segments=k_segments), b)
    # fp32 combine: the product and the sum are elementwise (no reduction), one rounding to the stream dtype
    return (base.float() + delta.float() * scaling).to(base.dtype)


_DROPOUT_GENERATOR: "list[torch.Generator]" = []   # the innermost dropout_seed's generator


@contextlib.contextmanager
def dropout_seed(seed: int):
    """Draw the adapters' dropout masks inside the block from a CPU generator seeded with ``seed`` (the trainer
    seeds each step from the run's seed and the step: the masks are then a function of (seed, step, call order),
    the same in a resumed run, whatever ran in the process before)."""
    _DROPOUT_GENERATOR.append(torch.Generator().manual_seed(seed))
    try:
        yield
    finally:
        _DROPOUT_GENERATOR.pop()


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout (kept elements scaled by 1 / (1 - p)); the mask is drawn on the CPU, then moved."""
    gen = _DROPOUT_GENERATOR[-1] if _DROPOUT_GENERATOR else None
    keep = torch.empty(x.shape, dtype=torch.float32).bernoulli_(1.0 - p, generator=gen)
    return x * (keep / (1.0 - p)).to(device=x.device, dtype=x.dtype)


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(module name, module) of every adapted projection, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def apply_lora(model: nn.Module, spec: LoRASpec, seed: int = 0) -> nn.Module:
    """Adapt ``spec.targets`` of every decoder layer of ``model`` (a CausalLM) in place and freeze every other
    parameter. Init as PEFT's default: A ~ kaiming-uniform(a=sqrt(5)) (bound 1/sqrt(in)), B = 0 -- so the adapted
    model starts as the base model's function -- drawn from a CPU generator seeded with ``seed``, in module order.
    A mixture-of-experts layer's FFN (stacked experts) is refused for gate/up/down; its attention is adapted."""
    if has_lora(model):
        raise LoRAError("the model already holds LoRA adapters")
    if getattr(model, "tp_group", None) is not None:
        raise LoRAError("model.lora with parallel.tp is not supported yet; use parallel.tp=1 (or parallel.dp)")
    if model.config.linear_attention:
        raise LoRAError(f"model.lora is not supported for {model.config.family} models yet (linear-attention layers); "
                        "train the full model (remove model.lora)")
    gen = torch.Generator().manual_seed(seed)
    model.requires_grad_(False)
    for index, layer in enumerate(model.model.layers):
        for target in spec.targets:
            owner = layer.self_attn if target in ATTENTION_TARGETS else layer.mlp
            base = getattr(owner, target, None)
            if type(base) is not Linear:
                raise LoRAError(f"model.lora.targets: layers.{index} has no dense {target} (a mixture-of-experts "
                                "layer's experts are not supported); adapt the attention projections only "
                                "(model.lora.targets=[q_proj,k_proj,v_proj,o_proj])")
            adapted = LoRALinear(base, spec)
            _init_factors(adapted, gen)
            setattr(owner, target, adapted)
    return model


@torch.no_grad()
def _init_factors(module: LoRALinear, gen: torch.Generator) -> None:
    a = module.lora_A.weight
    bound = 1.0 / math.sqrt(a.shape[1])   # kaiming_uniform_(a=sqrt(5)) on [r, in]: gain sqrt(1/3) * sqrt(3 / in)
    a.copy_((torch.rand(a.shape, generator=gen, dtype=torch.float32) * 2 - 1).mul_(bound).to(a.dtype))
    module.lora_B.weight.zero_()


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every adapter factor, in parameter order."""
    return [(n, p) for n, p in model.named_parameters() if n.endswith((".lora_A.weight", ".lora_B.weight"))]


# ---- PEFT's format --------------------------------------------------------------------------------------------

def peft_config(spec: LoRASpec, base_model: str = "") -> dict:
    """The ``adapter_config.json`` PEFT writes for ``spec`` (``peft.LoraConfig`` reads every key)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": sorted(spec.targets), "bias": "none", "use_rslora": spec.rslora, "use_dora": False,
            "fan_in_fan_out": False, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
            "alpha_pattern": {}, "init_lora_weights": True, "inference_mode": True}


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's tensor names (CPU copies, contiguous)."""
    return {PEFT_PREFIX + n: p.detach().to("cpu").contiguous().clone() for n, p in adapter_parameters(model)}


def is_adapter_folder_file(path: Path) -> bool:
    return path.is_file() and path.name in (CONFIG_FILE, WEIGHTS_FILE)


def save_adapter(model: nn.Module, spec: LoRASpec, directory: "str | os.PathLike", *, base_model: str = "",
                 overwrite: bool = False, reads=()) -> Path:
    """Write ``model``'s adapters to ``directory`` in PEFT's format, whole (a temporary sibling renamed into
    place). An existing folder is replaced only with ``overwrite`` and only when it holds an adapter's files."""
    from safetensors.torch import save_file

    target = Path(directory)
    try:
        check_output_folder(target, what="adapter folder", owns=is_adapter_folder_file, overwrite=overwrite,
                            reads=reads, hint=", or pass --overwrite to replace an adapter folder rlalign wrote")
    except OutputRefused as exc:
        raise LoRAError(str(exc)) from None
    target = target.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        save_file(adapter_tensors(model), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(peft_config(spec, base_model), indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, default_file_mode(directory=True))
        for file in tmp.iterdir():
            os.chmod(file, default_file_mode())
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def spec_from_peft(config: dict, where: str = "adapter_config.json") -> LoRASpec:
    """The :class:`LoRASpec` of a PEFT ``adapter_config.json``; what rlalign would run differently is refused."""
    def refuse(what: str):
        raise LoRAError(f"{where}: {what} is not supported (rlalign runs plain LoRA on q/k/v/o and gate/up/down)")

    if config.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {config.get('peft_type')!r}")
    for key, plain in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key, plain) not in (plain, None):
            refuse(f"{key}={config[key]!r}")
    for key in ("modules_to_save", "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern",
                "target_parameters", "trainable_token_indices"):
        if config.get(key):
            refuse(f"{key}={config[key]!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str):   # PEFT: a regex over module names; "all-linear" is its shorthand
        pattern = targets
        targets = [t for t in TARGETS if pattern == "all-linear" or any(
            re.fullmatch(pattern, f"model.layers.0.{owner}.{t}") for owner in ("self_attn", "mlp"))]
    elif targets is not None:   # PEFT matches a listed name as a suffix of the module's name: "self_attn.q_proj"
        targets = [str(t).rpartition(".")[2] for t in targets]
    try:
        return LoRASpec(rank=int(config["r"]), alpha=float(config.get("lora_alpha", 8)),
                        dropout=float(config.get("lora_dropout", 0.0) or 0.0), targets=tuple(targets or ()),
                        rslora=bool(config.get("use_rslora", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise LoRAError(f"{where}: not a LoRA adapter config ({exc})") from None


def read_adapter(directory: "str | os.PathLike") -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """(spec, {parameter name: tensor}) of a PEFT adapter folder (names without PEFT's prefix and adapter name)."""
    from safetensors.torch import load_file

    folder = Path(directory)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise LoRAError(f"{folder} is not a PEFT adapter folder (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{config_file}: not readable JSON ({exc})") from None
    spec = spec_from_peft(config, str(config_file))
    tensors = {}
    for key, t in load_file(str(weights_file)).items():
        name = key.removeprefix(PEFT_PREFIX).replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.",
                                                                                            ".lora_B.")
        tensors[name] = t
    return spec, tensors


@torch.no_grad()
def load_adapter_weights(model: nn.Module, tensors: dict[str, torch.Tensor], where: str = "the adapter") -> None:
    """Copy adapter tensors (parameter names) into ``model``'s adapters; a missing, extra or misshapen tensor is
    one line naming it."""
    params = dict(adapter_parameters(model))
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which the model's adapters do not have"
        raise LoRAError(f"{where} {what}: it was written for another model or other targets")
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise LoRAError(f"{where}: {name} has shape {tuple(t.shape)}, the model's is {tuple(p.shape)}")
        p.copy_(t)


def load_adapter(model: nn.Module, directory: "str | os.PathLike", seed: int = 0) -> LoRASpec:
    """Adapt ``model`` as the PEFT folder ``directory`` says and load its tensors; returns its spec."""
    spec, tensors = read_adapter(directory)
    apply_lora(model, spec, seed)
    load_adapter_weights(model, tensors, where=str(directory))
    return spec


@torch.no_grad()
def merged_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every adapter folded into its weight (``W + s B A`` in fp32, rounded once) and plain
    :class:`Linear` modules again: what a Hugging Face checkpoint of the adapted model holds."""
    merged = copy.deepcopy(model)
    for name, module in lora_modules(merged):
        w = module.weight
        delta = module.lora_B.weight.float() @ module.lora_A.weight.float()
        plain = Linear(w.shape[1], w.shape[0], module.bias is not None, w.dtype, w.device,
                       k_segments=module.k_segments)
        plain.weight.copy_((w.float() + delta * module.scaling).to(w.dtype))
        if module.bias is not None:
            plain.bias.copy_(module.bias)
        owner_name, _, attr = name.rpartition(".")
        setattr(merged.get_submodule(owner_name), attr, plain)
    for module in merged.modules():
        if module is not merged and hasattr(module, "stack_projections"):
            module.stack_projections()
    return merged.requires_grad_(True)


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the adapters: the base model's tensors by name."""
    return {n: t for n, t in model.state_dict().items() if not n.endswith((".lora_A.weight", ".lora_B.weight"))}


__all__ = ["TARGETS", "ATTENTION_TARGETS", "MLP_TARGETS", "CONFIG_FILE", "WEIGHTS_FILE", "PEFT_PREFIX", "LoRAError",
           "LoRASpec", "LoRAFactor", "LoRALinear", "lora_linear", "dropout_seed", "lora_modules", "has_lora",
           "apply_lora", "adapter_parameters", "peft_config", "adapter_tensors", "is_adapter_folder_file",
           "save_adapter", "spec_from_peft", "read_adapter", "load_adapter_weights", "load_adapter", "merged_copy",
           "base_state"]
