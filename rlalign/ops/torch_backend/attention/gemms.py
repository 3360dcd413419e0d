"""The attention formulation's batched GEMMs on the CPU: the library's bmm where its items are row invariant on
this machine, else the compiled row kernel item by item.

Per key block the formulation computes, per item, q.k ([Q_TILE, D] x [D, KV_BLOCK]) and p.v
([Q_TILE, KV_BLOCK] x [KV_BLOCK, D]). A query's bits are the same in a packed forward, a chunked prefill and
decode only if a row of an item gets bits that depend on that row alone: not on its position in the tile,
the other rows (zero padding included), the batch count or the item's index. The library does not give that
for every D -- MKL (torch 2.13, 2-core AMD EPYC) rounds p.v of odd rows of a tile otherwise than even rows
for D in 5..7 and 9..11 (the op takes even D: 6 and 10), and a single item's p.v at D = 1 otherwise than an
item of a batch (measured) -- so it is checked per (shape, layout, thread count) at first use
(:func:`items_hold`); the shapes that fail run :func:`rlalign.ops.torch_backend.primitives.compiled_gemm`
per item (each output element one fp32 chain over k in increasing order from 0, csrc/common.h: row invariant by
construction). Where that kernel is not built the op raises (fail closed). The shapes that pass keep the
library's bmm, so their bits do not change.

The backward (:mod:`.backward`) promises determinism run to run only, not packing invariance, and issues
its GEMMs directly: at D = 6 and 10 a sequence's dq differs alone and packed next to a longer sequence of
its length bucket (the same narrow-N rounding; measured), at 16 to 64 it did not.
"""

from __future__ import annotations

import functools

import torch

from rlalign.contract.bits import bits_equal
from rlalign.contract.errors import fail
from rlalign.ops.torch_backend import clib, primitives


def item_gemm(a: torch.Tensor, b: torch.Tensor, transpose_b: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 a[i] @ b[i] (or a[i] @ b[i]^T) for every item i of CPU tensors a [c, M, K], b [c, K, N] (or
    [c, N, K]): the library's bmm where :func:`items_hold` holds for the shape, else the compiled kernel."""
    bt = b.transpose(1, 2) if transpose_b else b
    m, k, n = a.shape[1], a.shape[2], bt.shape[2]
    if items_hold(m, k, n, transpose_b, torch.get_num_threads()):
        return torch.bmm(a, bt) if out is None else torch.bmm(a, bt, out=out)
    return compiled_items(a, bt, out)


def compiled_items(a: torch.Tensor, bt: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a[i] @ bt[i] by csrc/gemm.c, item by item (row invariant by construction); raises when not built."""
    c, m, k = a.shape
    n = bt.shape[2]
    if clib.library() is None:
        raise fail("attention", f"the BLAS's batched GEMM ({m} x {k}) x ({k} x {n}) is not row invariant on this "
                                "machine and the compiled CPU kernels are not available (no C compiler, or "
                                "RLALIGN_CPU_KERNELS=0): install a C compiler (cc/gcc) and unset "
                                "RLALIGN_CPU_KERNELS, or use profile='native'")
    if out is None:
        out = torch.empty((c, m, n), dtype=torch.float32)
    for i in range(c):   # compiled_gemm(x, w) = x @ w^T with w [N, K]
        out[i] = primitives.compiled_gemm(a[i], bt[i].transpose(0, 1), 1)
    return out


@functools.lru_cache(maxsize=None)
def items_hold(m: int, k: int, n: int, transpose_b: bool, threads: int) -> bool:
    """Whether the library's bmm of items (M x K) x (K x N) -- b given as [c, K, N], or transposed from a
    contiguous [c, N, K] -- gives each row bits that depend on that row only, at this thread count (random
    rows, fixed seed per shape; see :func:`items_hold_on`)."""
    return items_hold_on(m, k, n, transpose_b, torch.Generator().manual_seed(m * 7919 + k * 131 + n * 7 + transpose_b))


def items_hold_on(m: int, k: int, n: int, transpose_b: bool, gen: torch.Generator) -> bool:
    """Random items, every bit compared: rows permuted within the tile, a row among other rows, an item alone
    vs as one item of batches of 3 and 9 items (at another index), and the rows past the fifth zero-padded."""
    a, other = torch.randn(3, m, k, generator=gen), torch.randn(3, m, k, generator=gen)
    b = torch.randn(9, n, k, generator=gen) if transpose_b else torch.randn(9, k, n, generator=gen)

    def bmm(x, y):
        return torch.bmm(x, y.transpose(1, 2) if transpose_b else y)

    ref = bmm(a, b[:3])
    perm = torch.randperm(m, generator=gen)
    mixed = other.clone()
    mixed[:, m - 1] = a[:, 0]
    padded = a.clone()
    padded[:, 5:] = 0.0
    batch = bmm(torch.cat([other, other, a]), torch.cat([b[3:], b[:3]]))   # a's items at indices 6..8 of 9
    return (bits_equal(bmm(a[:, perm], b[:3]), ref[:, perm]) and bits_equal(bmm(mixed, b[:3])[:, m - 1], ref[:, 0])
            and bits_equal(bmm(a[1:2], b[1:2]), ref[1:2]) and bits_equal(batch[6:], ref)
            and bits_equal(bmm(padded, b[:3])[:, :5], ref[:, :5]))
