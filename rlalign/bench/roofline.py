"""Bytes a decode step must move, for the rollout benchmark's roofline (``rlalign bench rollout``).

A decode step (every running sequence feeds one token) must at least read every weight it uses once
and every running sequence's cached keys and values once; that is the step's memory-bandwidth
roofline (bytes / peak bandwidth = the shortest possible step). Counted, in the model's dtype:

    weights   every parameter once, except the input embedding table, of which only the ``rows``
              gathered rows are read (a tied embedding IS the LM head: read whole, once); MoE: every
              expert (at hundreds of rows every expert is routed to)
    kv_read   context_tokens x layers x 2 (K and V) x kv_heads x head_dim, context_tokens = the sum
              over running sequences of their context length including the new token
    kv_write  rows x layers x 2 x kv_heads x head_dim (the new token's K and V)

Not counted: activations (O(rows x hidden) per op) and the sampler's fp32 logits (rows x vocab x 4
bytes written and re-read): the figure is the minimum, so achieved bandwidth against it is a lower
bound on the traffic the engine really generates.
"""

from __future__ import annotations

import dataclasses

import torch

from rlalign.models.config import ModelConfig
from rlalign.models.sizes import embedding_size, parameter_sizes
from rlalign.models.sizes import kv_bytes_per_token as sizes_kv_bytes_per_token


@dataclasses.dataclass(frozen=True)
class StepBytes:
    weights: int
    kv_read: int
    kv_write: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_read + self.kv_write


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(all parameters, input embedding table) element counts (rlalign.models.sizes)."""
    return sum(parameter_sizes(config)), embedding_size(config)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies in the cache, over all layers, for values of ``dtype``."""
    return sizes_kv_bytes_per_token(config, torch.empty((), dtype=dtype).element_size())


def decode_step_bytes(config: ModelConfig, dtype: torch.dtype, rows: int, context_tokens: int,
                      counts: tuple[int, int] | None = None) -> StepBytes:
    """The minimum bytes of one decode step of ``rows`` sequences whose contexts (new token included) sum
    to ``context_tokens`` (module docstring). ``counts``: :func:`parameter_counts`, when already known."""
    elem = torch.empty((), dtype=dtype).element_size()
    total, embed = counts or parameter_counts(config)
    read_once = total if config.tie_word_embeddings else total - embed
    weights = (read_once + rows * config.hidden_size) * elem
    per_token = kv_bytes_per_token(config, dtype)
    return StepBytes(weights=weights, kv_read=context_tokens * per_token, kv_write=rows * per_token)


__all__ = ["StepBytes", "parameter_counts", "kv_bytes_per_token", "decode_step_bytes"]
