"""Weights laid back to back: the one test of whether several tensors are consecutive row blocks of one tensor.

The decoder stacks each layer's q/k/v and gate/up weights so (``rlalign.models.modules.stack_rows``), and
``ops.linear_group`` runs a stacked set as one GEMM (the Triton backend). A module of its own, below the ops and
the backends, so that both use it without the backends importing the public op modules.
"""

from __future__ import annotations

import torch


def stacked_rows(tensors) -> torch.Tensor | None:
    """The one tensor whose consecutive row blocks are exactly ``tensors`` (contiguous views laid back to back in
    one storage, e.g. a layer's q/k/v weights after :func:`rlalign.models.modules.stack_rows`), or None when they
    are not so laid out (any tensor reallocated since, a different dtype / device / row shape)."""
    tensors = tuple(tensors)
    if not tensors or any(t is None for t in tensors):
        return None
    first = tensors[0]
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in tensors:
        if (t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]
                or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset):
            return None
        offset += t.numel()
    if len(tensors) == 1:
        return first
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


__all__ = ["stacked_rows"]
