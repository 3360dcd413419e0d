"""The rollout cache of a linear-attention (Gated-DeltaNet) layer, paged like the K/V of the attention layers.

Everything a Gated-DeltaNet layer needs to continue a sequence lives in the sequence's own KV pages, so the engine's
page bookkeeping (copy-on-write of forked samples, preemption, freeing, the prefix cache) covers it unchanged:

* ``conv[page, offset]``  -- the token's conv1d input (the projection's q|k|v columns, model dtype): the conv of a
  new token reads the K-1 inputs before it back from here (exact per token);
* ``rows[page, offset]``  -- the token's delta-rule inputs after the conv (q_hat | k_hat | v | g | beta, fp32), then
  its chunk-local cumulative gate and UT row (both independent of the state): the open chunk's rows, from which a
  decode step recomputes the intra-chunk part (solving only its own UT row);
* ``states[page, s]``     -- the recurrent state [Hv, Dk, Dv] fp32 after the chunk whose LAST token sits in this
  page (``s = (position % page_size) // C``): the state exists only at chunk boundaries (spec.GDN_CHUNK).

A page's content is a function of the token prefix up to its end (the strict ops' bits do not depend on the
batch or the chunking), so a page reused by the prefix cache holds what a recomputation would write.
"""

from __future__ import annotations

import dataclasses

import torch

from rlalign.contract import spec

LINEAR_ATTENTION = "linear_attention"


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """The Gated-DeltaNet shape of a config (``ModelConfig.linear_attention``)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @classmethod
    def of(cls, config) -> "LinearShape":
        o = config.linear_attention
        return cls(o["num_k_heads"], o["num_v_heads"], o["k_head_dim"], o["v_head_dim"], o["conv_kernel"])

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    @property
    def input_width(self) -> int:
        """fp32 values of a token's delta-rule inputs: q_hat, k_hat ([Hk, Dk] each), v [Hv, Dv], g, beta [Hv]."""
        return self.conv_dim + 2 * self.num_v_heads

    @property
    def row_width(self) -> int:
        """fp32 values per token in ``rows``: its inputs, then per value head its chunk-local Gamma and UT row U
        [Dv + Dk] (state-independent: a decode step reuses them, ops.gated_delta.delta_chunks' ``known``)."""
        return self.input_width + self.num_v_heads * (1 + self.v_head_dim + self.k_head_dim)


def linear_layers(config) -> tuple[int, ...]:
    """Indices of the config's linear-attention layers."""
    return tuple(i for i, t in enumerate(config.layer_types or ()) if t == LINEAR_ATTENTION)


def states_per_page(page_size: int) -> int:
    """How many chunk ends a page can hold (ceil(page_size / C))."""
    return -(-page_size // spec.GDN_CHUNK)


class LinearLayerCache:
    """One linear-attention layer's paged stores (module docstring); zero-initialised."""

    def __init__(self, shape: LinearShape, num_pages: int, page_size: int, dtype: torch.dtype, device):
        self.shape = shape
        self.conv = torch.zeros((num_pages, page_size, shape.conv_dim), dtype=dtype, device=device)
        self.rows = torch.zeros((num_pages, page_size, shape.row_width), dtype=torch.float32, device=device)
        self.states = torch.zeros((num_pages, states_per_page(page_size), shape.num_v_heads, shape.k_head_dim,
                                   shape.v_head_dim), dtype=torch.float32, device=device)

    def paged_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.conv, self.rows, self.states


def linear_caches(config, num_pages: int, page_size: int, dtype: torch.dtype, device) -> dict[int, LinearLayerCache]:
    """{layer index: its cache} for every linear-attention layer of ``config``."""
    layers = linear_layers(config)
    if not layers:
        return {}
    shape = LinearShape.of(config)
    return {i: LinearLayerCache(shape, num_pages, page_size, dtype, device) for i in layers}


def linear_page_bytes(config, page_size: int, element_size: int) -> int:
    """Bytes one page of the linear-attention stores takes over all linear layers."""
    layers = linear_layers(config)
    if not layers:
        return 0
    s = LinearShape.of(config)
    per_token = s.conv_dim * element_size + s.row_width * 4
    state = states_per_page(page_size) * s.num_v_heads * s.k_head_dim * s.v_head_dim * 4
    return len(layers) * (page_size * per_token + state)


__all__ = ["LINEAR_ATTENTION", "LinearShape", "LinearLayerCache", "linear_layers", "linear_caches",
           "linear_page_bytes", "states_per_page"]
