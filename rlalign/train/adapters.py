"""A run's LoRA adapters (``model.lora``): the policy adapted before the engine and the optimizer see it.

With ``model.lora.rank >= 1`` the trainer adapts the loaded policy (:func:`adapt_policy`,
:mod:`rlalign.models.lora`): the targeted projections gain ``lora_A`` / ``lora_B``, every other parameter is
frozen. What follows from that needs nothing of its own: the rollout engine is built on the adapted module tree
(shared or copied, :mod:`rlalign.train.engines`), so it runs the same unmerged adapter forward as the trainer;
the fp32 masters and the optimizer hold the trainable parameters only (:class:`rlalign.train.master.MasterWeights`);
checkpoints hold the adapters next to the base weights and resume them bit for bit. The final ``policy/`` is the
merged model (:func:`exportable`) and ``adapter/`` the adapters alone in PEFT's format (:func:`save_run_adapter`).
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from rlalign.models.lora import (LoRAError, LoRASpec, apply_lora, dropout_seed, has_lora, load_adapter_weights,
                                 merged_copy, read_adapter, save_adapter)


def lora_spec(model_section) -> "LoRASpec | None":
    """The :class:`LoRASpec` of a ``model`` config section (``model.lora``); None when ``rank`` is 0."""
    lora = model_section.lora
    if lora.rank == 0:
        return None
    return LoRASpec(rank=lora.rank, alpha=float(lora.alpha), dropout=float(lora.dropout), targets=tuple(lora.targets))


def adapt_policy(policy, cfg) -> "LoRASpec | None":
    """Adapt ``policy`` in place as ``model.lora`` says (A drawn from ``run.seed``; with ``model.lora.path`` the
    PEFT folder's adapters loaded, its rank, alpha and targets equal to the config's); None without LoRA. What
    the run cannot combine with adapters was refused with the config (``LoRASection.conflict``)."""
    spec = lora_spec(cfg.model)
    if spec is None:
        return None
    apply_lora(policy, spec, seed=cfg.run.seed)
    if cfg.model.lora.path is not None:
        found, tensors = read_adapter(cfg.model.lora.path)
        if (found.rank, found.alpha, set(found.targets), found.rslora) != (spec.rank, spec.alpha, set(spec.targets),
                                                                           False):
            raise LoRAError(f"model.lora.path {cfg.model.lora.path}: the adapter has rank {found.rank}, alpha "
                            f"{found.alpha}, targets {sorted(found.targets)}{', rsLoRA' if found.rslora else ''}; "
                            "set model.lora.rank/alpha/targets to match it")
        load_adapter_weights(policy, tensors, where=f"model.lora.path {cfg.model.lora.path}")
    return spec


def step_dropout(spec: "LoRASpec | None", seed: int, step: int):
    """The context a training step's update runs in: with adapter dropout, its masks drawn from a generator seeded
    by (run.seed, step) (:func:`rlalign.models.lora.dropout_seed`), so a resumed step draws the same masks."""
    if spec is None or spec.dropout == 0:
        return contextlib.nullcontext()
    digest = hashlib.sha256(f"lora-dropout:{seed}:{step}".encode()).digest()
    return dropout_seed(int.from_bytes(digest[:8], "little") >> 1)


def exportable(policy):
    """The policy as a Hugging Face checkpoint holds it: merged when it has adapters (:func:`merged_copy`)."""
    return merged_copy(policy) if has_lora(policy) else policy


def save_run_adapter(policy, spec: LoRASpec, directory: Path, base_model: str) -> Path:
    """The run's adapters alone, in PEFT's format, replacing a previous one of rlalign's."""
    return save_adapter(policy, spec, directory, base_model=base_model, overwrite=True)


__all__ = ["lora_spec", "adapt_policy", "step_dropout", "exportable", "save_run_adapter"]
