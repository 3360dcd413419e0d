"""What the rlalign vLLM model refuses, checked once when vLLM builds the model (fail closed)."""

from __future__ import annotations

from rlalign.contract import spec
from rlalign.integrations.vllm.errors import UnsupportedVLLMConfigError
from rlalign.models.config import ModelConfig


def check_vllm_config(vllm_config, config: ModelConfig) -> None:
    """Raise :class:`UnsupportedVLLMConfigError` for engine settings the plugin cannot honour bitwise."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1:
        raise UnsupportedVLLMConfigError(f"tensor_parallel_size={parallel.tensor_parallel_size} is not supported "
                                         "(use 1; rlalign's own engines cover tensor parallelism)")
    if parallel.pipeline_parallel_size != 1:
        raise UnsupportedVLLMConfigError(f"pipeline_parallel_size={parallel.pipeline_parallel_size} is not supported "
                                         "(use 1)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise UnsupportedVLLMConfigError("speculative decoding is not supported (drop speculative_config)")
    if getattr(vllm_config, "lora_config", None) is not None:
        raise UnsupportedVLLMConfigError("LoRA adapters are not supported (serve the merged model: `rlalign "
                                         "export` merges a LoRA run's adapters; or roll out with rlalign's engine)")
    if getattr(vllm_config, "quant_config", None) is not None or vllm_config.model_config.quantization:
        raise UnsupportedVLLMConfigError(f"quantization={vllm_config.model_config.quantization!r} is not supported "
                                         "(serve the bf16/fp32 checkpoint)")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        raise UnsupportedVLLMConfigError(f"kv_cache_dtype={cache_dtype!r} is not supported (use 'auto': the cache "
                                         "holds K/V in the model dtype)")
    dtype = vllm_config.model_config.dtype
    if str(dtype).removeprefix("torch.") not in spec.STRICT_DTYPES:
        names = ", ".join(spec.STRICT_DTYPES)
        raise UnsupportedVLLMConfigError(f"dtype={str(dtype).removeprefix('torch.')} is not supported in the strict "
                                         f"profile (pass dtype= one of {names})")
    if str(vllm_config.device_config.device_type) != "cpu" and not vllm_config.model_config.enforce_eager:
        raise UnsupportedVLLMConfigError("CUDA graphs are not supported (the strict ops validate their inputs on "
                                         "the host): pass enforce_eager=True")
    _check_head_dim(vllm_config, config)


def _check_head_dim(vllm_config, config: ModelConfig) -> None:
    """vLLM's CPU attention backend (which builds the block tables the plugin reads) only takes some
    head sizes; say so before vLLM fails deep inside its backend selection."""
    if str(vllm_config.device_config.device_type) != "cpu":
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # lazy: optional, heavy
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if config.head_dim not in sizes:
        raise UnsupportedVLLMConfigError(f"head_dim={config.head_dim} is not one of vLLM's CPU attention head sizes "
                                         f"{sizes}")
