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

The bandwidth roofline treats the step as one memory stream. At hundreds of rows a decode step's GEMMs
are compute bound instead (Qwen3-8B at 462 rows: 7.0 TFLOP of matmuls, 9.0 ms at 780 TFLOP/s, against
15.1 GB of weights, 3.5 ms at 4.3 TB/s), and the kernels of a step run one after another, so the step is
also bounded by the PER-OP ROOFLINE (:func:`decode_step_floor`): the sum over its ops of each op's
slower ceiling,

    matmul [N, K] on m rows   max(N K elem / BW, 2 m N K / FLOPS)     every weight matrix, LM head included;
                                                                      a stacked expert [E, N, K]: E matrices of
                                                                      m = rows x top_k / E rows (balanced routing)
    attention                 max(kv bytes / BW, 4 context_tokens heads head_dim layers / FLOPS)
    the rest                  bytes / BW (norm weights, the gathered embedding rows)

It is the shortest step sequential kernels can take (activations, sampling and launch gaps still
uncounted); where it exceeds bytes / BW the bandwidth fraction cannot reach 1.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rlalign.models.config import ModelConfig
from rlalign.models.sizes import INPUT_TABLE, embedding_size, parameter_shapes, parameter_sizes
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


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """What the per-op roofline needs of a model, counted once: its weight matrices (n, k, experts) -- an
    expert stack is one entry with ``experts`` = E, a dense matrix has 0 --, the bytes of its other
    parameters read once per step, and the attention's shape."""
    matrices: tuple[tuple[int, int, int], ...]
    other_elements: int
    top_k: int
    hidden: int
    heads_dim_layers: int          # num_heads x head_dim x layers: attention FLOPs per context token / 4


def step_shapes(config: ModelConfig) -> StepShapes:
    """The :class:`StepShapes` of ``config`` (rlalign.models.sizes.parameter_shapes)."""
    matrices, other = [], 0
    for name, shape in parameter_shapes(config):
        if name == INPUT_TABLE and not config.tie_word_embeddings:
            continue                    # an untied input table: only the gathered rows are read (below)
        if len(shape) == 2:
            matrices.append((shape[0], shape[1], 0))
        elif len(shape) == 3:
            matrices.append((shape[1], shape[2], shape[0]))
        else:
            other += math.prod(shape)
    top_k = int(config.ffn_options.get("num_experts_per_tok", 0)) if config.ffn_kind == "moe" else 0
    return StepShapes(tuple(matrices), other, top_k, config.hidden_size,
                      config.num_heads * config.head_dim * config.num_layers)


def decode_step_floor(shapes: StepShapes, step: StepBytes, rows: int, context_tokens: int, elem: int,
                      peak_gbps: float, peak_tflops: float) -> float:
    """The per-op roofline of one decode step in seconds (module docstring): each op at the slower of its
    bandwidth and compute ceilings, summed. ``step``: the step's :func:`decode_step_bytes`."""
    bw, flops = peak_gbps * 1e9, peak_tflops * 1e12
    seconds = (shapes.other_elements + rows * shapes.hidden) * elem / bw
    for n, k, experts in shapes.matrices:
        if experts:
            m = rows * shapes.top_k / experts
            seconds += experts * max(n * k * elem / bw, 2 * m * n * k / flops)
        else:
            seconds += max(n * k * elem / bw, 2 * rows * n * k / flops)
    seconds += max((step.kv_read + step.kv_write) / bw, 4 * context_tokens * shapes.heads_dim_layers / flops)
    return seconds


__all__ = ["StepBytes", "StepShapes", "parameter_counts", "kv_bytes_per_token", "decode_step_bytes", "step_shapes",
           "decode_step_floor"]
