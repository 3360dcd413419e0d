"""PEFT's LoRA layers under the transformers patch: a PEFT-wrapped model computes rlalign's adapter forward.

``patch(get_peft_model(hf_model, LoraConfig(...)))`` (or ``PeftModel.from_pretrained``) patches the wrapped
``*ForCausalLM``; each ``peft.tuners.lora.Linear`` that wraps a target projection is rebound to
:func:`rlalign.models.lora.lora_linear` -- the very function rlalign's :class:`~rlalign.models.lora.LoRALinear`
runs -- on its base layer's weight and its active adapter's ``lora_A`` / ``lora_B`` / ``scaling``, with the base
projection's canonical K partition. A patched PEFT model therefore gives rlalign's trainer's bits (log-probs and
adapter gradients). What PEFT computes differently is refused in one line (:func:`layer_problem`): several active
adapters, DoRA, LoRA biases, a base layer that is not a plain ``nn.Linear`` (quantized), and dropout in the strict
profile. peft is never imported here: its layers are recognised by their attributes and module.
"""

from __future__ import annotations

from torch import nn

from rlalign import ops
from rlalign.contract.profiles import Profile
from rlalign.models.lora import lora_linear


def unwrap(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside a ``PeftModel`` (its ``get_base_model()``); any other model as it is."""
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA layer wrapping a base layer."""
    return (type(module).__module__.startswith("peft.") and hasattr(module, "base_layer")
            and hasattr(module, "lora_A") and hasattr(module, "scaling"))


def layer_problem(module: nn.Module, profile: Profile) -> "str | None":
    """Why the PEFT layer ``module`` cannot run rlalign's adapter forward (None: it can)."""
    if type(module.base_layer) is not nn.Linear:
        return f"its base layer is a {type(module.base_layer).__name__}, not a plain nn.Linear (quantized?)"
    active = list(module.active_adapters)
    if len(active) != 1:
        return f"{len(active)} active adapters (rlalign runs one)"
    name = active[0]
    if name not in module.lora_A:
        return f"the active adapter {name!r} has no LoRA weights here"
    if getattr(module, "use_dora", {}).get(name):
        return "DoRA is not supported"
    if getattr(module, "lora_bias", {}).get(name):
        return "LoRA biases are not supported"
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out weights are not supported"
    dropout = module.lora_dropout[name]
    if isinstance(dropout, nn.Dropout) and dropout.p > 0 and profile is Profile.STRICT:
        return (f"lora_dropout={dropout.p} makes the training forward differ from the rollout's, which the strict "
                "profile forbids (use lora_dropout=0)")
    return None


def lora_forward(self, x):
    """A PEFT LoRA layer's forward, rlalign's: the base projection when the adapter is disabled or merged into the
    base weight, else :func:`~rlalign.models.lora.lora_linear` with the active adapter."""
    base = self.base_layer
    k_segments = self._rlalign_k_segments
    if self.disable_adapters or self.merged:
        if self.disable_adapters and self.merged:
            raise ValueError("a disabled adapter that is merged into the base weight: unmerge it first "
                             "(model.unmerge_adapter())")
        return ops.linear(x, base.weight, base.bias, k_segments=k_segments)
    name = self.active_adapters[0]
    dropout = self.lora_dropout[name]
    p = dropout.p if isinstance(dropout, nn.Dropout) and self.training else 0.0
    return lora_linear(x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight,
                       self.scaling[name], k_segments=k_segments, dropout=p)


__all__ = ["unwrap", "is_lora_layer", "layer_problem", "lora_forward"]
