"""The rollout engine's record of MoE routing: which experts each computed row was sent to.

The record is kept per KV slot, next to the K/V it belongs to: ``ids[slot]`` holds the expert ids
[sparse layers, k] of the row whose K/V sit in that slot. A sequence's routing is then read through its
block table exactly as its K/V are, so every way the engine shares or moves K/V (prefix-cache hits,
forked samples sharing a prompt's pages, copy-on-write page copies, recompute after a preemption)
carries the routing with it, and a sequence's rows 0..num_computed-1 are always the ones its tokens
attended through. Host memory, int16 (int32 for 2**15 experts or more): num_slots x sparse layers x k
elements, under 1% of the KV cache for Qwen3-MoE shapes. Slots never written hold -1.

Per step the engine writes the step's [rows, sparse layers, k] once (one device-to-host copy after the
sampler's sync, one numpy scatter); a finished sequence's rows are gathered once, before its pages are
freed.
"""

from __future__ import annotations

import numpy as np
import torch


class RoutingStore:
    """Expert ids [num_pages * page_size, sparse layers, k] indexed by KV slot (page * page_size + offset)."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, top_k: int, num_experts: int):
        self.page_size = page_size
        dtype = np.int16 if num_experts < 2**15 else np.int32
        self.ids = np.full((num_pages * page_size, num_layers, top_k), -1, dtype)

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes

    def write(self, slots: np.ndarray, ids: torch.Tensor) -> None:
        """Rows ``ids`` [n, sparse layers, k] (any device) were computed into ``slots`` int64 [n]."""
        if ids.shape[0] != slots.shape[0] or tuple(ids.shape[1:]) != self.ids.shape[1:]:
            raise ValueError(f"RoutingStore.write: {tuple(ids.shape)} expert ids for {slots.shape[0]} slots; "
                             f"expected [rows, {self.ids.shape[1]}, {self.ids.shape[2]}]")
        self.ids[slots] = ids.cpu().numpy()

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """The (src, dst) page copies the engine does on the K/V, done on the record too."""
        ps = self.page_size
        for src, dst in copies:
            self.ids[dst * ps:(dst + 1) * ps] = self.ids[src * ps:(src + 1) * ps]

    def gather(self, block_table: list[int], num_rows: int) -> torch.Tensor:
        """The routing of positions 0..num_rows-1 of the sequence holding ``block_table`` (a copy)."""
        positions = np.arange(num_rows, dtype=np.int64)
        table = np.asarray(block_table, dtype=np.int64)
        slots = table[positions // self.page_size] * self.page_size + positions % self.page_size
        return torch.from_numpy(self.ids[slots])


__all__ = ["RoutingStore"]
