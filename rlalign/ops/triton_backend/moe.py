"""The experts' SwiGLU FFNs on the Triton backend: three grouped GEMMs, no host sync.

Rows arrive sorted by expert. Per expert e and row r: ``down_e(silu(gate_e(r)) * up_e(r))``, each
projection the strict linear's arithmetic (:mod:`.grouped`: the dense GEMM's reduction order, row results
independent of the expert's load), silu_mul the strict elementwise kernel. The same bits as the torch
backend's per-expert loop on the same device, in one launch per projection and with a launch grid that
depends on the shapes only, so a decode step with MoE layers can be captured in a CUDA graph.

:func:`experts` is the whole ``ops.moe_experts`` on this backend: the dispatch kernel (:mod:`.dispatch`,
three launches: order, inverse, offsets, row-tile tables, id verdict), one gather of x's rows, the grouped
FFN, one gather back to slot order -- the rows, GEMMs and reductions of the reference path
(``rlalign.ops.moe.sorted_experts``: torch.sort, then :func:`expert_ffn`), in about 10 launches instead of ~50.
"""

from __future__ import annotations

import torch

from rlalign.ops.expert_ids import queue_expert_id_verdict
from rlalign.ops.torch_backend.linear import segment_count
from rlalign.ops.triton_backend.dispatch import dispatch, gather_rows, ungroup_rows
from rlalign.ops.triton_backend.elementwise import silu_mul
from rlalign.ops.triton_backend.grouped import expert_offsets, grouped_linear, row_tile_heights


def _down_segments(gate_w, down_segments) -> int:
    inter = gate_w[0].shape[0]
    return segment_count(inter, down_segments) if down_segments and down_segments > 1 else 1


def expert_ffn(rows: torch.Tensor, expert_of_row: torch.Tensor, gate_w, up_w, down_w, down_segments) -> torch.Tensor:
    """The FFN of rows already sorted by expert (``expert_of_row`` non-decreasing); the tables from offsets."""
    offsets = expert_offsets(expert_of_row, len(gate_w))
    return grouped_ffn(rows, offsets, {}, gate_w, up_w, down_w, _down_segments(gate_w, down_segments))


def grouped_ffn(rows, offsets, slots: dict, gate_w, up_w, down_w, segments: int) -> torch.Tensor:
    """down(silu(gate(rows)) * up(rows)) per expert; ``slots``: the row-tile tables by tile height, shared by
    the three projections and their backward (filled here when missing)."""
    gate = grouped_linear(rows, offsets, gate_w, slot_cache=slots)
    act = silu_mul(gate, grouped_linear(rows, offsets, up_w, slot_cache=slots))
    return grouped_linear(act, offsets, down_w, segments, slot_cache=slots)


def experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_w, up_w, down_w, down_segments) -> torch.Tensor:
    """``ops.moe_experts`` (strict) on this backend: y [T, k, H], y[t, j] = FFN_{expert_ids[t, j]}(x[t]).
    The id verdict goes to the deferred check queue (raised at the next sync point); an out-of-range id's
    rows are never computed."""
    tokens, k = expert_ids.shape
    n_experts, hidden = len(gate_w), x.shape[1]
    segments = _down_segments(gate_w, down_segments)
    plan = dispatch(expert_ids, n_experts, row_tile_heights(tokens * k, n_experts, segments,
                                                            x.dtype == torch.float32))
    if tokens * k:
        queue_expert_id_verdict(plan.ok, n_experts)
    rows = gather_rows(x, plan, k)
    grouped = grouped_ffn(rows, plan.offsets, dict(plan.slots), gate_w, up_w, down_w, segments)
    return ungroup_rows(grouped, plan).view(tokens, k, hidden)


__all__ = ["expert_ffn", "experts", "grouped_ffn"]
