"""The few primitives every strict torch-backend op is built from.

Invariance by construction: a library call only ever sees shapes fixed by the contract
(:mod:`rlalign.contract.spec`), never a batch-dependent one, and every sum that matters is a
balanced tree of elementwise adds whose order is written here, not chosen by a library.
What is left to the libraries (fixed-shape GEMMs are row/column/item invariant; exp/log are
position invariant) is listed in ``spec.cpu_backend_assumptions`` and checked by ``rlalign doctor``.
"""

from __future__ import annotations

import functools

import torch

from rlalign import mklmode
from rlalign.contract import spec
from rlalign.contract.bits import bits_equal
from rlalign.contract.errors import fail
from rlalign.ops.torch_backend import clib


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad dim 0 of ``x`` up to a multiple of ``multiple``. Returns ``x`` itself when it needs no
    padding: a read-only operand (callers write into a separate output, never into the result)."""
    rows = x.shape[0]
    padded = -(-rows // multiple) * multiple
    if padded == rows:
        return x
    return torch.cat([x, x.new_zeros((padded - rows,) + tuple(x.shape[1:]))], dim=0)


def tile_mm(a: torch.Tensor, w: torch.Tensor, row_block: int = spec.ROW_BLOCK) -> torch.Tensor:
    """``a @ w.T`` in fp32, issued as GEMMs of exactly ``row_block`` rows.

    a: [M, K] fp32, w: [N, K] fp32 -> [M, N] fp32. Each output row is computed by a GEMM of shape
    (row_block x K) x (K x N) whatever M is, so its bits cannot depend on M or on the other rows --
    on the CPU only for a (K, N) whose library tile passed :func:`tiles_hold` on this machine. For
    any other shape (narrow N, odd K: MKL's tile then depends on the row's position and the batch)
    every row runs the compiled kernel, invariant by construction (:func:`kernel_rows`); in the
    cross-machine mode every shape does (:func:`kernel_defines`).
    """
    m = a.shape[0]
    if m == 0:
        return a.new_zeros((0, w.shape[0]))
    if a.device.type == "cpu":
        if kernel_defines():
            return kernel_rows(a, w, 1)
        if not tiles_hold(a.shape[1], w.shape[0], torch.get_num_threads()):
            return kernel_rows(a, w, 1)
        if a.dtype == w.dtype == torch.float32 and kernel_preferred(a.shape[1], w.shape[0], 1):
            return compiled_gemm(a, w, 1)
    return _tile_mm(a, w, row_block)


def _tile_mm(a: torch.Tensor, w: torch.Tensor, row_block: int = spec.ROW_BLOCK) -> torch.Tensor:
    """:func:`tile_mm` on the library's tiles, unconditionally (M > 0)."""
    m = a.shape[0]
    a = pad_rows(a, row_block)
    out = torch.empty((a.shape[0], w.shape[0]), dtype=a.dtype, device=a.device)
    _tiles_into(a, w.t(), out, row_block)
    return out[:m]


def _tiles_into(a: torch.Tensor, wt: torch.Tensor, out: torch.Tensor, row_block: int) -> None:
    """out[i:i+B] = a[i:i+B] @ wt for every block of B rows (M a multiple of B; ``out`` contiguous).

    On the CPU, for a contiguous ``a`` and a ``wt`` that is a matrix or a transposed one, the blocks
    are the items of ONE batched GEMM (the weight broadcast, stride 0): an item has the bits of the
    single GEMM of its block (spec.cpu_backend_assumptions, checked by ``rlalign doctor``), without
    one library call (and thread hand-off) per block. Elsewhere (GPUs: cuBLAS items change with the
    batch count) one GEMM per block."""
    t = a.shape[0] // row_block
    if t == 1:
        torch.mm(a, wt, out=out)
        return
    if a.device.type == "cpu" and a.is_contiguous() and (wt.is_contiguous() or wt.t().is_contiguous()):
        torch.bmm(a.view(t, row_block, a.shape[1]), wt.expand(t, *wt.shape), out=out.view(t, row_block, out.shape[1]))
        return
    mm = torch.mm
    for a_t, o_t in zip(a.split(row_block), out.split(row_block)):
        mm(a_t, wt, out=o_t)


def tile_mm_segments(a: torch.Tensor, w: torch.Tensor, parts: int, row_block: int = spec.ROW_BLOCK) -> torch.Tensor:
    """[parts, M, N]: part s = tile_mm(a[:, s].contiguous(), w[:, s].contiguous()) for the ``parts``
    equal K segments s, with the same GEMM operands (each segment of ``a`` contiguous and zero-padded
    to whole row blocks, each of ``w`` a contiguous [N, K / parts] matrix used transposed), built
    with one copy of ``a`` (and on the CPU, while small, one of ``w`` per row block: all segments'
    blocks then form one batched GEMM, see :func:`_tiles_into`)."""
    m, k = a.shape
    n, seg = w.shape[0], k // parts
    if m == 0:
        return a.new_zeros((parts, 0, n))
    mp = -(-m // row_block) * row_block
    t = mp // row_block
    segs = torch.empty((parts, mp, seg), dtype=a.dtype, device=a.device)
    segs[:, :m] = a.reshape(m, parts, seg).transpose(0, 1)
    if mp > m:
        segs[:, m:] = 0.0
    out = torch.empty((parts, mp, n), dtype=a.dtype, device=a.device)
    if a.device.type == "cpu" and t * n * k <= _ONE_BATCH_ELEMS and (n * seg) % 16 == 0:
        # item (s, block) = segs[s, block] @ w_s^T; w_s repeated per block (a copy: a batch dim has
        # one stride), each copy a contiguous [N, K / parts] matrix starting 64-byte aligned like the
        # per-segment copies
        w_items = _segment_items(w, parts, t)
        torch.bmm(segs.view(-1, row_block, seg), w_items.transpose(1, 2), out=out.view(-1, row_block, n))
    else:
        for i in range(parts):
            _tiles_into(segs[i], w[:, i * seg:(i + 1) * seg].contiguous().t(), out[i], row_block)
    return out[:, :m]


# Above this many elements (the weight copied once per row block) tile_mm_segments issues one
# batched GEMM per segment instead of one for all (memory only).
_ONE_BATCH_ELEMS = 1 << 20

# Copies derived from a weight (the per-block segment copies, the transpose the kernel reads) are built
# by every call, never cached across calls: a cache keyed on the tensor (id, data_ptr, version counter)
# returns stale copies after an update that does not bump the counter -- fused AdamW (transformers'
# Trainer default), any ``p.data.<op>_()``, ``p.data = ...`` onto a reused address -- and no key short
# of the contents (a pass over the weight, the price of the copy) is safe against those. Measured: the
# copy is within the noise of the CPU rollout benchmark and of the default run (docs/cpu.md).


def _segment_items(w: torch.Tensor, parts: int, t: int) -> torch.Tensor:
    """[parts * t, N, K / parts]: item (s, block) = segment s of w, a contiguous copy per row block."""
    n, seg = w.shape[0], w.shape[1] // parts
    return w.reshape(n, parts, seg).transpose(0, 1).unsqueeze(1).expand(parts, t, n, seg).reshape(-1, n, seg)


# ---- the linear's GEMM compiled (CPU): a few rows without their padding, and the K partition ----------

# Rows past the last whole 64-row block, up to this many, go through csrc/gemm.c instead of a padded
# block: the kernel's cost grows with the rows, the padded tile's does not (measured break-even ~8-16).
SMALL_ROWS = 8


def kernel_defines() -> bool:
    """Whether csrc/gemm.c is the definition of every strict CPU linear GEMM -- forward, dX, weight gradient, the LM
    head's vocab blocks -- whatever the shape: the cross-machine mode (``RLALIGN_CPU_CROSS_MACHINE=1``). No strict GEMM then runs the library's tiles, whose remainder columns (the last N % 16 of a call,
    N < 16) MKL's COMPATIBLE branch orders otherwise, so a column's bits would depend on the call's N and the
    column's offset (tensor parallelism computes N / tp columns). The kernel's columns depend on their own
    inputs only (no column reads another; the 16-column blocks and the tail run the same chain per element).
    Without the kernels the strict linear raises in the mode (:func:`kernel_rows`)."""
    return mklmode.cross_machine()


def kernel_rows(a: torch.Tensor, w: torch.Tensor, parts: int) -> torch.Tensor:
    """The unrounded fp32 linear of every row of a [M, K] with w [N, K] (``parts`` K segments, tree-merged)
    by csrc/gemm.c, whatever its bits are next to the library's tile: the route for the shapes whose
    tile is not row invariant here (:func:`tiles_hold` False). Invariant by construction: each output
    element is, per segment, one fp32 chain over k in increasing order from 0 (FMA steps; under MKL
    COMPATIBLE multiply-then-add, cut every 112 k: csrc/common.h), then the canonical tree; no operation
    of a row reads another row. Raises (fail closed) when the kernel cannot run."""
    k, n = a.shape[1], w.shape[0]
    if a.dtype != torch.float32 or w.dtype != torch.float32 or parts > 64 or clib.library() is None:
        reason = ("the compiled CPU kernels are not available (no C compiler, or RLALIGN_CPU_KERNELS=0)"
                  if clib.library() is None else f"unsupported operands ({a.dtype}, {parts} segments)")
        if kernel_defines():
            raise fail("linear", f"the cross-machine mode (RLALIGN_CPU_CROSS_MACHINE=1) computes every "
                                 f"strict CPU linear with the compiled kernels and {reason}: install a C compiler "
                                 "(cc/gcc) and unset RLALIGN_CPU_KERNELS, or unset RLALIGN_CPU_CROSS_MACHINE (bits "
                                 "reproduce on this machine only), or use profile='native'")
        raise fail("linear", f"the BLAS tile for K={k}, N={n} ({parts} K segments) is not row invariant on this "
                             f"machine and {reason}: install a C compiler (cc/gcc) and unset RLALIGN_CPU_KERNELS, "
                             "or use profile='native'")
    return compiled_gemm(a, w, parts)


def linear_route(k: int, n: int, parts: int) -> str:
    """How the strict CPU linear computes a (K, N, parts) shape at the current thread count:

    ``"kernel"``  every row by csrc/gemm.c: its bits are the tiles' and it is the faster path
                  (:func:`kernel_preferred`), or the tiles are not row invariant here (:func:`tiles_hold`)
    ``"tiles"``   64-row library tiles (row invariance checked for this shape), a few trailing rows by the
                  kernel when its bits are the tiles'
    Raises when neither is possible (tiles not invariant and no kernel)."""
    threads = torch.get_num_threads()
    kernel = clib.library() is not None and parts <= 64
    if kernel_defines():
        if not kernel:
            kernel_rows(torch.empty(0, k), torch.empty(n, k), parts)   # raises the fail-closed error
        return "kernel"
    if kernel_preferred(k, n, parts):
        return "kernel"
    if tiles_hold(k // parts, n, threads):
        return "tiles"
    if kernel:
        return "kernel"
    kernel_rows(torch.empty(0, k), torch.empty(n, k), parts)   # raises the fail-closed error
    raise AssertionError("unreachable")


def kernel_preferred(k: int, n: int, parts: int) -> bool:
    """Whether csrc/gemm.c computes every row of a (K, N, parts) fp32 linear here, its bits being the 64-row
    tiles' (:func:`gemm_matches`, at this thread count): for the canonical K partition (8 narrow segment GEMMs
    and a merge pass on MKL), and for every shape under MKL's COMPATIBLE branch (the cross-machine mode), whose
    GEMM runs at about half the speed of its native branches and of this kernel (docs/cpu.md, "Across
    machines")."""
    return (parts <= 64 and (parts > 1 or clib.compatible()) and clib.library() is not None
            and gemm_matches(k, n, parts, torch.get_num_threads()))


@functools.lru_cache(maxsize=None)
def tiles_hold(seg_k: int, n: int, threads: int) -> bool:
    """Whether the library's fixed 64-row tile (64 x ``seg_k``) x (``seg_k`` x N) gives each row bits that
    depend on that row only, at this thread count -- checked, not assumed: MKL picks its micro-kernel
    by shape, and for narrow N (1..9) with odd K, or N = 1, a row's bits change with its position in the
    tile and with the batch (measured). Checked for the plain tiles (K = seg_k) and for two K segments
    of seg_k (the canonical partition's batched GEMM and merge), so the verdict, and with it the route,
    is the same for every segment count: tensor-parallel ranks and TP = 1 take the same arithmetic.
    Random rows, every bit compared: rows permuted within the block, a row among other rows, a block
    alone vs as one item of a batched call, and a few rows zero-padded to a block."""
    return all(_tiles_hold(seg_k, n, parts) for parts in (1, 2))


def _tiles_hold(seg_k: int, n: int, parts: int) -> bool:
    gen = torch.Generator().manual_seed(seg_k * 7919 + n * 31 + parts)
    rb, k = spec.ROW_BLOCK, seg_k * parts
    a, b, w = torch.randn(rb, k, generator=gen), torch.randn(rb, k, generator=gen), torch.randn(n, k, generator=gen)

    def tiles(x):
        return _tile_mm(x, w) if parts == 1 else tree_merge(tile_mm_segments(x, w, parts))

    same = bits_equal
    ref, ref_b = tiles(a), tiles(b)
    perm = torch.randperm(rb, generator=gen)
    mixed = b.clone()
    mixed[rb - 1] = a[0]
    batch = tiles(torch.cat([b, a, a[perm]]))
    return (same(tiles(a[perm]), ref[perm]) and same(tiles(mixed)[rb - 1], ref[0])
            and same(batch, torch.cat([ref_b, ref, ref[perm]])) and same(tiles(a[:5]), ref[:5]))


def compiled_rows(a: torch.Tensor, w: torch.Tensor, parts: int, max_rows: int | None = None) -> torch.Tensor | None:
    """The unrounded fp32 linear (``parts`` K segments, tree-merged) of the rows a [m, K] with w [N, K], by
    csrc/gemm.c: each row's bits are those of the 64-row tile (checked per (K, N, parts) and thread count
    before first use, :func:`gemm_matches`); None when the kernel does not apply (not the CPU, not fp32,
    more than ``max_rows`` rows, no compiler, or the check failed). The forward of a linear that
    autograd records runs here too: this is the forward arithmetic of the op, whoever calls it."""
    m, k = a.shape
    if (a.device.type != "cpu" or a.dtype != torch.float32 or w.dtype != torch.float32 or m == 0
            or (max_rows is not None and m > max_rows) or parts > 64 or clib.library() is None
            or not gemm_matches(k, w.shape[0], parts, torch.get_num_threads())):
        return None
    return compiled_gemm(a, w, parts)


def compiled_gemm(a: torch.Tensor, w: torch.Tensor, parts: int) -> torch.Tensor:
    a = a.contiguous()
    wt = w.t().contiguous()   # [K, N]: the kernel's layout (a copy per call: see the note above _segment_items)
    out = torch.empty((a.shape[0], w.shape[0]), dtype=torch.float32)
    clib.library().rl_gemm(a.data_ptr(), a.shape[0], a.shape[1], wt.data_ptr(), w.shape[0], parts, out.data_ptr(),
                           torch.get_num_threads())
    return out


@functools.lru_cache(maxsize=None)
def gemm_matches(k: int, n: int, parts: int, threads: int) -> bool:
    """Whether the kernel's chains are the library's 64-row tile for this shape at this thread count
    (they are for the shapes measured, MKL on AVX2 and AVX-512, but the library may order some shapes
    otherwise, and with many threads may split K): random rows through both, every bit compared. Rows
    of one batch may take either path (a tail of few rows, the rest in blocks), so this equality is
    what keeps a row's bits independent of its batch."""
    gen = torch.Generator().manual_seed(k * 7919 + n * 31 + parts)
    a, w = torch.randn(SMALL_ROWS, k, generator=gen), torch.randn(n, k, generator=gen)
    tile = _tile_mm(a, w) if parts == 1 else tree_merge(tile_mm_segments(a, w, parts))
    return bits_equal(compiled_gemm(a, w, parts), tile)


# The token counts at which :func:`weight_grad_matches` compares the kernel with the library: no cut, one, several
# (MKL COMPATIBLE cuts its chains every 112 k), and the largest count the kernel route takes (a micro-batch of the
# default 4,096 tokens fits). One token is the library's alone: torch's mm of K = 1 keeps a product's -0, a chain
# from +0 does not.
WEIGHT_GRAD_TOKENS = (2, 113, 500, 4099)


def weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The linear's weight gradient ``g^T @ x`` (g [T, N], x [T, K] fp32 -> [N, K]): one fp32 GEMM over the T
    tokens, deterministic run to run (not invariant to how tokens are split into micro-batches). In the
    cross-machine mode csrc/gemm.c for every shape (:func:`kernel_defines`). Under MKL's COMPATIBLE branch otherwise, whose GEMM runs at about half the speed of this kernel, csrc/gemm.c computes it where it
    gives the library's bits for (N, K) at this thread count (:func:`weight_grad_matches`) and T is at most the
    largest count checked (and at least 2); everywhere else the library."""
    t, n, k = g.shape[0], g.shape[1], x.shape[1]
    if g.device.type == "cpu" and kernel_defines():   # the definition in the cross-machine mode, every T
        return kernel_rows(g.t(), x.t(), 1)
    if (g.device.type == "cpu" and g.dtype == x.dtype == torch.float32
            and WEIGHT_GRAD_TOKENS[0] <= t <= WEIGHT_GRAD_TOKENS[-1]
            and clib.compatible() and clib.library() is not None
            and weight_grad_matches(n, k, torch.get_num_threads())):
        return compiled_gemm(g.t().contiguous(), x.t(), 1)
    return g.t() @ x


@functools.lru_cache(maxsize=None)
def weight_grad_matches(n: int, k: int, threads: int) -> bool:
    """Whether the kernel gives the library's ``g^T @ x`` bits for an [N, K] weight at this thread count: random
    operands of each of :data:`WEIGHT_GRAD_TOKENS` tokens, every bit compared. The library picks its kernel by
    shape: measured (MKL COMPATIBLE, 1 and 2 threads), N = 15 matches up to 113 tokens and not from 500 on,
    N in 64, 128, 256, 384 at every count from 1 to 6,000 tried."""
    gen = torch.Generator().manual_seed(n * 7919 + k)
    for t in WEIGHT_GRAD_TOKENS:
        g, x = torch.randn(t, n, generator=gen), torch.randn(t, k, generator=gen)
        if not bits_equal(compiled_gemm(g.t().contiguous(), x.t(), 1), g.t() @ x):
            return False
    return True


def tree_merge(parts) -> torch.Tensor:
    """Merge partials by the fixed balanced binary tree ((p0+p1)+(p2+p3))+...

    ``parts``: a list of tensors, or one tensor stacked along dim 0 (then each level is one add of
    its even and odd halves: the same elementwise adds). The count must be a power of two (the
    canonical partition guarantees it). Always a new tensor, never one of (a view of) the inputs,
    also for a single part (see :func:`tree_sum`).
    """
    if isinstance(parts, torch.Tensor):
        if parts.shape[0] == 1:
            return parts[0].clone()
        merged = tree_merge_compiled(parts)
        if merged is not None:
            return merged
        while parts.shape[0] > 1:
            pairs = parts.unflatten(0, (parts.shape[0] // 2, 2))
            parts = pairs[:, 0] + pairs[:, 1]
        return parts[0]
    if len(parts) == 1:
        return parts[0].clone()
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def tree_merge_compiled(parts: torch.Tensor) -> torch.Tensor | None:
    """csrc/elementwise.c's rl_tree_merge (the same adds in the same tree) for stacked fp32 CPU partials
    without autograd whose parts are each one contiguous block; else None."""
    p = parts.shape[0]
    if parts.dtype != torch.float32 or p < 2 or p > 64 or p & (p - 1) or not parts[0].is_contiguous():
        return None
    lib = clib.for_tensors(parts)
    if lib is None:
        return None
    out = torch.empty(parts.shape[1:], dtype=torch.float32)
    lib.rl_tree_merge(parts.data_ptr(), p, parts.stride(0), out.numel(), out.data_ptr(), torch.get_num_threads())
    return out
