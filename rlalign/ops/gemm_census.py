"""The GEMM census: every strict GEMM launch of a piece of work, as the dispatcher ran it (benchmarks/gemm_census.py).

Off by default: ``ACTIVE`` is None and a launch site pays one module-level None check, nothing else. Inside
``with collecting(names) as census:`` each launch of the Triton backend's GEMMs appends one :class:`GemmCall` to
``census.calls``: :func:`rlalign.ops.triton_backend.gemm.gemm` (whichever kernel it picked: the Triton
``gemm_kernel`` / ``segment_stream_kernel``, the decode-size split, the Gluon warp-specialized ``gemm_ws``) and the
fused log-prob's GEMM kernels (``lp_stats_kernel``, ``lp_grad_logits_kernel``). Recording reads the shapes, strides
and the launch configuration already chosen; it never changes a launch (so never a bit).

Roles: the caller names what a call computes (``role``: fwd, dX, dW, db for a linear; lm_stats, lm_grad_logits,
lm_dX, lm_dW, lm_logits for the LM head) and the weight it belongs to; ``names`` maps a weight's bytes to its
parameter name (:func:`weight_names`; by byte range, so a vocab chunk of the LM head is the LM head), so a call
reads e.g. ``model.layers.3.mlp.down_proj.weight dW``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """One launch. M, N, K are the logical C[M, N] = A[M, K] @ B[K, N]; ``a_trans`` / ``b_trans`` say A / B are
    stored transposed ([K, M] / [N, K]); strides are those of the stored tensors (elements)."""
    entry: str            # the launcher the trainer called: gemm | lp_stats | lp_grad_logits
    kernel: str           # the kernel(s) the launcher ran
    config: str           # the launch configuration the dispatcher chose (repr)
    role: str             # what the call computes ("" when the caller did not say)
    weight: str           # the parameter it belongs to ("" unknown)
    m: int
    n: int
    k: int
    a_trans: bool
    b_trans: bool
    a_strides: tuple[int, int]
    b_strides: tuple[int, int]
    out_strides: tuple[int, int]
    dtype: str
    out_dtype: str
    segments: int = 1
    acc_in: bool = False
    bias: bool = False
    tma: bool = True
    options: tuple[tuple[str, object], ...] = ()   # launcher-specific (lp kernels: with_entropy, temperature)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def shape_key(self) -> tuple:
        """What makes two calls the same launch (the role's layer index aside): dedupe key of the census."""
        return (self.entry, self.kernel, self.config, self.m, self.n, self.k, self.a_trans, self.b_trans,
                self.a_strides, self.b_strides, self.out_strides, self.dtype, self.out_dtype, self.segments,
                self.acc_in, self.bias, self.tma, self.options)


class Census:
    def __init__(self, names: dict[tuple[int, int, int], str] | None = None):
        self.names = dict(names or {})
        self.calls: list[GemmCall] = []

    def add(self, role: str, role_of: torch.Tensor | None, **fields) -> None:
        weight = "" if role_of is None else self.name_of(role_of)
        self.calls.append(GemmCall(role=role, weight=weight, **fields))

    def name_of(self, t: torch.Tensor) -> str:
        """The parameter whose bytes hold ``t``'s first element ("" unknown)."""
        ptr, at = storage_ptr(t), t.storage_offset() * t.element_size()
        return next((name for (p, start, end), name in self.names.items() if p == ptr and start <= at < end), "")


# The collecting census, or None (the default: the launch sites' one check).
ACTIVE: Census | None = None


@contextlib.contextmanager
def collecting(names: dict[tuple[int, int, int], str] | None = None) -> Iterator[Census]:
    """Record every strict GEMM launch made inside the block (not nested: one census at a time)."""
    global ACTIVE
    if ACTIVE is not None:
        raise RuntimeError("gemm_census.collecting: a census is already collecting (they do not nest)")
    census = Census(names)
    ACTIVE = census
    try:
        yield census
    finally:
        ACTIVE = None


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def weight_names(named_parameters) -> dict[tuple[int, int, int], str]:
    """``names`` for :func:`collecting`: each parameter's bytes (storage, first byte, end byte) -> its name. By bytes,
    not storage alone: the decoder's q/k/v (and gate/up) weights are views of one storage (models.modules.stack_rows),
    and a vocab chunk of the LM head is the LM head."""
    out = {}
    for name, p in named_parameters:
        start = p.storage_offset() * p.element_size()
        out[(storage_ptr(p), start, start + p.numel() * p.element_size())] = name
    return out


def strides(t: torch.Tensor) -> tuple[int, int]:
    return int(t.stride(0)), int(t.stride(1))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["GemmCall", "Census", "ACTIVE", "collecting", "weight_names", "storage_ptr", "strides", "dtype_name"]
