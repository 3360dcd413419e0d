"""The experts' SwiGLU FFNs on the Triton backend: three grouped GEMMs, no host sync.

Rows arrive sorted by expert (``rlalign.ops.moe.moe_experts`` groups them). Per expert e and row r:
``down_e(silu(gate_e(r)) * up_e(r))``, each projection the strict linear's arithmetic
(:mod:`.grouped`: the dense GEMM's reduction order, row results independent of the expert's load),
silu_mul the strict elementwise kernel. The same bits as the torch backend's per-expert loop on the
same device, in one launch per projection and with a launch grid that depends on the shapes only,
so a decode step with MoE layers can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from rlalign.ops.torch_backend.linear import segment_count
from rlalign.ops.triton_backend.elementwise import silu_mul
from rlalign.ops.triton_backend.grouped import expert_offsets, grouped_linear


def expert_ffn(rows: torch.Tensor, expert_of_row: torch.Tensor, gate_w, up_w, down_w, down_segments) -> torch.Tensor:
    offsets = expert_offsets(expert_of_row, len(gate_w))
    inter = gate_w[0].shape[0]
    segments = segment_count(inter, down_segments) if down_segments and down_segments > 1 else 1
    slots: dict = {}     # the row-tile tables, shared by the three projections (and their backward)
    gate = grouped_linear(rows, offsets, gate_w, slot_cache=slots)
    act = silu_mul(gate, grouped_linear(rows, offsets, up_w, slot_cache=slots))
    return grouped_linear(act, offsets, down_w, segments, slot_cache=slots)


__all__ = ["expert_ffn"]
