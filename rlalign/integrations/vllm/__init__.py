"""vLLM as an rlalign rollout engine: a vLLM general plugin that runs Qwen3 / Qwen2 / Llama with rlalign strict ops.

Off by default. Turn it on with ``RLALIGN_VLLM=1`` in the environment of every vLLM process (the
usual way for a deployment: vLLM loads ``vllm.general_plugins`` entry points in the API server,
engine core and worker processes), or with ``rlalign.enable()`` before creating ``vllm.LLM``
(which sets the same variable, so vLLM's child processes see it too):

    import rlalign, vllm
    rlalign.enable()
    llm = vllm.LLM(model="ckpt/", dtype="float32", ...)
    out = llm.generate(prompts, vllm.SamplingParams(temperature=1.0, seed=s, logprobs=0, max_tokens=64))

When on, the plugin (1) registers :class:`~rlalign.integrations.vllm.model.RLAlignForCausalLM` for
every architecture of rlalign's registry (:mod:`rlalign.models.architectures`: ``Qwen3ForCausalLM``,
``Qwen2ForCausalLM``, ``LlamaForCausalLM``; it replaces vLLM's own classes for them), and (2) hooks vLLM's sampler so that a step whose logits came from
that model is sampled by ``ops.sample`` and its sampled-token logprob computed by
``ops.logprob_entropy`` on the same final hidden row as rlalign's trainer. Settings it cannot
run bitwise are refused with :class:`UnsupportedVLLMConfigError` (see :mod:`.checks` and
:mod:`.sampler`).
"""

from __future__ import annotations

import os

from rlalign.integrations.vllm.errors import UnsupportedVLLMConfigError

ENV = "RLALIGN_VLLM"
MODEL_CLASS = "rlalign.integrations.vllm.model:RLAlignForCausalLM"


def architectures() -> tuple[str, ...]:
    """The architectures the plugin serves: every family of rlalign's architecture registry."""
    from rlalign.models import architectures as registry
    return registry.architectures()


def is_enabled() -> bool:
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on", "strict")


def enable() -> None:
    """Turn the plugin on for this process and the vLLM processes it starts (registers the model classes and
    the sampler hook now)."""
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        raise UnsupportedVLLMConfigError("vLLM is not installed: pip install 'rlalign[vllm]' (see docs/vllm.md)")
    os.environ[ENV] = "1"
    register()


def disable() -> None:
    """Turn the plugin off (vLLM's own model classes and sampler come back for engines created afterwards)."""
    os.environ[ENV] = "0"
    _unregister()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: does nothing unless the plugin is enabled. Idempotent."""
    if not is_enabled():
        return
    from vllm import ModelRegistry

    from rlalign.integrations.vllm import sampler
    for arch in architectures():
        ModelRegistry.register_model(arch, MODEL_CLASS)
    sampler.install()


def _unregister() -> None:
    import sys
    if "vllm" not in sys.modules:
        return
    from vllm.model_executor.models import registry

    from rlalign.integrations.vllm import sampler
    sampler.uninstall()
    stock = registry._VLLM_MODELS
    for arch in architectures():
        module, cls = stock[arch]
        registry.ModelRegistry.models[arch] = registry._LazyRegisteredModel(f"vllm.model_executor.models.{module}", cls)


__all__ = ["enable", "disable", "is_enabled", "register", "UnsupportedVLLMConfigError", "ENV", "architectures"]
