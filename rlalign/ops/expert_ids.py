"""The check that every expert id of a MoE dispatch lies in [0, E): the one place of its message.

Both dispatches of ``ops.moe_experts`` use it: the reference one (:func:`rlalign.ops.moe.sorted_experts`,
:func:`validate_expert_ids`) and the Triton backend's dispatch kernel, whose id verdict is queued by
:func:`queue_expert_id_verdict`. A module of its own, below the public op modules and the backends, so that the
backends use it without importing the public op modules (as :mod:`rlalign.ops.stacking`).
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import fail
from rlalign.ops import _checks as chk


def validate_expert_ids(flat: torch.Tensor, n_experts: int) -> None:
    """Expert ids in [0, E). On the CPU at once. On a GPU the verdict stays on the device and the next
    sync point raises (as the deferred finiteness checks: a host read per MoE layer would stall the
    launch queue); meanwhile an out-of-range id is harmless -- its rows fall outside every expert's row
    range and are never computed. Skipped inside a CUDA graph capture (the caller validated the batch)."""
    if flat.device.type == "cpu":
        chk.memo("moe_expert_ids", lambda: _check_expert_ids(flat, n_experts), flat, extra=(n_experts,))
    else:
        queue_expert_id_verdict(((flat >= 0) & (flat < n_experts)).all(), n_experts)


def queue_expert_id_verdict(ok: torch.Tensor, n_experts: int) -> None:
    """Hand the device verdict ``ok`` (0-dim bool: every expert id in [0, E)) to the deferred check queue
    (raised at the next sync point; at once for a CPU tensor, e.g. the Triton interpreter's). Skipped inside
    a CUDA graph capture (the caller validated the batch). The one place of this check's message."""
    if not chk.is_capturing():
        chk.deferred("moe_experts", f"an expert id is outside [0, {n_experts})", ok)


def _check_expert_ids(flat: torch.Tensor, n_experts: int) -> bool:
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= n_experts:
        raise fail("moe_experts", f"expert id {lo if lo < 0 else hi} is outside [0, {n_experts})")
    return True
