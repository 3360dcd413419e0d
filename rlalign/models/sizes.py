"""Size facts of a decoder, from its config: the one place that counts parameters and K/V bytes.

Parameters are counted on the model built on the meta device (no memory), so nothing here restates
the decoder's shapes; the K/V cache holds one K and one V row of ``num_kv_heads * head_dim`` per layer
per token (a multi-head-latent-attention layer: its latent row). Used by the rollout engine (KV-cache pages),
the training memory budget (rlalign.train.budget) and the rollout roofline (rlalign.bench.roofline).
"""

from __future__ import annotations

import math

import torch

from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.models.latent_cache import LATENT, latent_layers, latent_width
from rlalign.models.linear_cache import linear_layers


# the input embedding table's parameter name (a tied LM head is this parameter)
INPUT_TABLE = "model.embed_tokens.weight"


def parameter_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter (each once: a tied head is the embedding, INPUT_TABLE)."""
    model = CausalLM(config, dtype=torch.float32, device="meta")
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def parameter_sizes(config: ModelConfig) -> list[int]:
    """The element count of every parameter (each counted once: a tied head is the embedding)."""
    return [math.prod(shape) for _, shape in parameter_shapes(config)]


def embedding_size(config: ModelConfig) -> int:
    """Elements of the input embedding table."""
    return config.vocab_size * config.hidden_size


def kv_bytes_per_token(config: ModelConfig, element_size: int, mla_cache: str = LATENT) -> int:
    """Bytes one token occupies in the cache, over all layers (``element_size``: bytes per value): one K and one V
    row per attention layer, a latent row (kv_lora_rank + qk_rope_head_dim) per multi-head-latent-attention layer
    (``mla_cache="expanded"``: its K and zero-padded V rows instead, rlalign.models.latent_cache). The
    linear-attention layers' stores are counted per page (rlalign.models.linear_cache.linear_page_bytes)."""
    latent = len(latent_layers(config, mla_cache))
    attention_layers = config.num_layers - len(linear_layers(config)) - latent   # linear-attention layers keep no K/V
    values = 2 * attention_layers * config.num_kv_heads * config.head_dim
    if latent:
        values += latent * latent_width(config)
    return values * element_size


__all__ = ["INPUT_TABLE", "parameter_shapes", "parameter_sizes", "embedding_size", "kv_bytes_per_token"]
