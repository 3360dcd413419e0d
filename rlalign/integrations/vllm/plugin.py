"""The plugin switch: ``enable`` / ``disable`` / ``register`` (the ``vllm.general_plugins`` entry point,
re-exported by :mod:`rlalign.integrations.vllm`)."""

from __future__ import annotations

import importlib.util
import os
import sys

from rlalign import envvars
from rlalign.integrations.vllm import sampler
from rlalign.integrations.vllm.errors import UnsupportedVLLMConfigError
from rlalign.models import architectures as model_families

ENV = "RLALIGN_VLLM"
# The architectures the plugin serves: the families of rlalign's architecture registry it implements (gpt_oss: not yet).
ARCHITECTURES = model_families.integration_architectures()
MODEL_CLASS = "rlalign.integrations.vllm.model:RLAlignForCausalLM"


def is_enabled() -> bool:
    """RLALIGN_VLLM (read through rlalign.envvars: a value its rule refuses is one line, never "off")."""
    return envvars.read(ENV)


def enable() -> None:
    """Turn the plugin on for this process and the vLLM processes it starts (registers the model classes and
    the sampler hook now)."""
    if importlib.util.find_spec("vllm") is None:
        raise UnsupportedVLLMConfigError("vLLM is not installed: pip install 'rlalign[vllm]' (see docs/vllm.md)")
    os.environ[ENV] = "1"
    register()


def disable() -> None:
    """Turn the plugin off (vLLM's own model classes and sampler come back for engines created afterwards)."""
    os.environ[ENV] = "0"
    _restore_stock_models()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: does nothing unless the plugin is enabled. Idempotent."""
    if not is_enabled():
        return
    from vllm import ModelRegistry   # lazy: vLLM is optional; this runs only inside a vLLM process, enabled

    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, MODEL_CLASS)
    sampler.install()


def _restore_stock_models() -> None:
    if "vllm" not in sys.modules:
        return
    from vllm.model_executor.models import registry   # lazy: vLLM is optional (and already imported here)

    sampler.uninstall()
    stock = registry._VLLM_MODELS
    for arch in ARCHITECTURES:
        module, cls = stock[arch]
        registry.ModelRegistry.models[arch] = registry._LazyRegisteredModel(f"vllm.model_executor.models.{module}", cls)


__all__ = ["enable", "disable", "is_enabled", "register", "ENV", "ARCHITECTURES", "MODEL_CLASS"]
