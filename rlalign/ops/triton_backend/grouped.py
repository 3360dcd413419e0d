"""Grouped strict GEMMs for mixture-of-experts: every expert's rows in one launch, no host sync.

The (token, slot) rows of an MoE layer arrive sorted by expert: expert e owns rows
``offsets[e] .. offsets[e+1]`` of ``x`` (``offsets`` a device tensor). Three products, each the
per-expert loop of the strict linear fused into one kernel launch:

    forward   C[rows_e] = X[rows_e] @ W_e^T          (W_e [N, K], the nn.Linear layout)
    dX        G_X[rows_e] = G[rows_e] @ W_e
    dW        G_W[e]    = G[rows_e]^T @ X[rows_e]      (reduction over the expert's rows)

Numerics: each output element takes the sequence of operations of :mod:`.gemm`'s kernel, built from
its jit pieces (tile loaders, ``mma``, ``merge_segment``; ``reduce_segment`` for dW): the reduction in
64-wide steps from zero in increasing order (canonical K segments merged by the fixed tree when asked),
fp32 accumulator, one rounding.
So a row's forward and dX results are bit-identical to ``ops.linear`` on that row alone, whatever
the expert's load (1 row or thousands) or where the row sits in its group; dW_e is bit-identical to
the strict linear's dW of the expert's rows in that order (a sum over tokens: deterministic, not
invariant to how tokens are split into micro-batches, exactly like the dense dW).

Scheduling without the host: the row tiles are laid out on the device. Expert e needs
``ceil(n_e / BM)`` row tiles; slot t of a fixed-size table (``ceil(R / BM) + E`` slots, enough for
any routing) names its expert and first row, or -1 (idle). The launch grid depends on R, E and the
tile shape only, so a decode step can be captured in a CUDA graph and replayed with any routing.
Weights are addressed through a table of per-expert offsets from the first expert's weight: a stacked
[E, N, K] tensor (the model's layout, or a strided view such as Hugging Face's ``gate_up_proj[:, :I]``)
gives ``e * stride(0)``, a list of per-expert tensors their pointer differences; nothing is copied. All
experts share one shape and one row stride, and every expert's weight is 16-byte aligned.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from rlalign.contract.errors import fail
from rlalign.ops.triton_backend._common import BLOCK_K, aligned, descriptor, is_interpreter, mma, split_for, tma_ok
from rlalign.ops.triton_backend.gemm import load_a_tile, load_b_tile, merge_segment, reduce_segment, tile_coords


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    nested: bool = False   # segmented: a loop per segment (gemm.segment_tree_nested's structure)


# BLOCK_M >= 64 always (the same wgmma family as the dense kernel: docs/design/tile-shapes.md). Tiles never change
# bits; these were the fastest of sweeps on the H200 at Qwen3-30B-A3B shapes (benchmarks/gpu_moe.py --sweep,
# 2026-12-01; docs/performance.md "Launch tables"): 128x128 once experts hold >= 256 rows on average (forward and dX), 64x64 below
# that and for the segmented down_proj (its merge tree keeps up to log2(P)+1 accumulators live); dW on
# 128x256 tiles of [N, K] (each program re-reads its expert's G and X columns: the widest tile reads least).
_ROWS_SMALL = GroupedConfig(64, 64, 4, 5)
_ROWS_LARGE = GroupedConfig(128, 128, 8, 3)
_ROWS_SEG = GroupedConfig(64, 64, 4, 4)
_REDUCE = GroupedConfig(128, 256, 8, 3)          # dW: tiles of [N, K] (fewest re-reads of G_e and X_e)
_FP32 = GroupedConfig(64, 64, 4, 3)              # fp32 operands (bf16x3 split in registers)


def _rows_config(rows: int, experts: int, segments: int, fp32: bool) -> GroupedConfig:
    if fp32:
        return _FP32
    if segments > 1:
        return _ROWS_SEG
    return _ROWS_LARGE if rows >= 256 * experts else _ROWS_SMALL


def row_tile_heights(rows: int, experts: int, segments: int, fp32: bool) -> tuple[int, ...]:
    """The row-tile heights (BLOCK_M) of one MoE layer's :func:`grouped_rows` calls: gate, up and every dX
    (one segment), down (``segments``). The dispatch builds one row-tile table per height."""
    return tuple(sorted({_rows_config(rows, experts, 1, fp32).block_m,
                         _rows_config(rows, experts, segments, fp32).block_m}))


# ---- kernels ---------------------------------------------------------------------------------------

@triton.jit
def _expert_step(acc, a_desc, a_src, b_src, row0, rows, off_n, k, k_end, N, stride_am, stride_ak, stride_bk,
                 stride_bn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, B_TRANS: tl.constexpr,
                 SPLIT: tl.constexpr, TMA_A: tl.constexpr):
    """acc + the 64-column step at k of an expert's row tile (A through TMA from row0, or masked pointer loads)."""
    if TMA_A:
        a = a_desc.load([row0.to(tl.int32), k])
    else:
        a = load_a_tile(a_src, 0, k, k_end, rows, stride_am, stride_ak, BM, BK, False, False)
    b = load_b_tile(b_src, off_n, k, k_end, N, stride_bk, stride_bn, BN, BK, B_TRANS, False)
    return mma(a, b, acc, SPLIT)


@triton.jit(do_not_specialize=["steps"])   # a one-step loop must not fold away: see gemm.KSTEP_UNSPECIALIZED
def grouped_rows_kernel(a_ptr, a_desc, w_base, w_offsets, c_ptr, slot_expert, slot_row, slot_end, scratch,
                        N, K, SEG_K, steps, num_slots,
                        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P: tl.constexpr,
                        LOG2P: tl.constexpr, B_TRANS: tl.constexpr, SPLIT: tl.constexpr,
                        OUT_BF16: tl.constexpr, GROUP_M: tl.constexpr, W_ALIGN: tl.constexpr,
                        TMA_A: tl.constexpr, NESTED: tl.constexpr):
    """One program per (row slot, column tile): C[rows of the slot] = A[rows] @ B_e (B_e logical [K, N])."""
    pid = tl.program_id(0)
    slot, pid_n = tile_coords(pid, num_slots, tl.cdiv(N, BN), GROUP_M)
    e = tl.load(slot_expert + slot)
    if e >= 0:
        row0 = tl.load(slot_row + slot).to(tl.int64)
        rows = tl.load(slot_end + slot).to(tl.int64) - row0      # rows of this expert from row0 on
        a_src = a_ptr + row0 * stride_am
        # expert e's weight: an element offset from expert 0's (every weight 16-byte aligned, so the
        # offset is a multiple of W_ALIGN elements: the hint lets the loads vectorize)
        b_src = w_base + tl.multiple_of(tl.load(w_offsets + e), W_ALIGN)
        off_n = pid_n * BN
        # the sequence of gemm.segment_tree (P segments of SEG_K columns, each reduced from zero in
        # 64-column steps, partials merged by the fixed tree; P == 1: one plain chain), with A's tile
        # through TMA from row0 when TMA_A (no mask inside the tensor is then needed: segment ends
        # fall on steps; rows past the expert's end are loaded and their outputs never stored)
        zero = tl.zeros((BM, BN), dtype=tl.float32)
        acc = zero
        st0 = zero
        st1 = zero
        st2 = zero
        if NESTED:
            for s in range(P):
                part = zero
                k_end = (s + 1) * SEG_K
                for j in range(steps):
                    k = s * SEG_K + j * BK
                    part = _expert_step(part, a_desc, a_src, b_src, row0, rows, off_n, k, k_end, N, stride_am,
                                        stride_ak, stride_bk, stride_bn, BM, BN, BK, B_TRANS, SPLIT, TMA_A)
                acc, st0, st1, st2 = merge_segment(part, st0, st1, st2, s, scratch, pid, LOG2P, 4, BM, BN)
        else:
            for i in range(P * steps):
                s = i // steps
                j = i - s * steps
                k_end = (s + 1) * SEG_K
                k = s * SEG_K + j * BK
                acc = _expert_step(acc, a_desc, a_src, b_src, row0, rows, off_n, k, k_end, N, stride_am,
                                   stride_ak, stride_bk, stride_bn, BM, BN, BK, B_TRANS, SPLIT, TMA_A)
                if P > 1:
                    if j == steps - 1:
                        v, st0, st1, st2 = merge_segment(acc, st0, st1, st2, s, scratch, pid, LOG2P, 4, BM, BN)
                        if s == P - 1:
                            acc = v
                        else:
                            acc = zero
        rm = tl.arange(0, BM)
        rn = off_n + tl.arange(0, BN)
        c_ptrs = c_ptr + (row0 + rm[:, None]) * stride_cm + rn[None, :].to(tl.int64) * stride_cn
        out = acc.to(tl.bfloat16) if OUT_BF16 else acc
        tl.store(c_ptrs, out, mask=(rm[:, None] < rows) & (rn[None, :] < N))


@triton.jit
def grouped_reduce_kernel(g_ptr, x_ptr, c_ptr, offsets, N, K, tiles_n, tiles_k,
                          stride_gm, stride_gn, stride_xm, stride_xk, stride_ce,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                          OUT_BF16: tl.constexpr):
    """One program per (expert, N tile, K tile): C_e = G[rows_e]^T @ X[rows_e], rows in 64-steps in order."""
    pid = tl.program_id(0)
    per_expert = tiles_n * tiles_k
    e = pid // per_expert
    t = pid - e * per_expert
    pid_n = t // tiles_k
    pid_k = t - pid_n * tiles_k
    row0 = tl.load(offsets + e).to(tl.int64)
    rows = tl.load(offsets + e + 1).to(tl.int64) - row0
    g_src = g_ptr + row0 * stride_gm
    x_src = x_ptr + row0 * stride_xm
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # logical A = G_e^T [N, rows] (stored G_e [rows, N]), logical B = X_e [rows, K]
    acc = reduce_segment(acc, g_src, x_src, pid_n * BM, pid_k * BN, 0, rows, tl.cdiv(rows, BK), N, K,
                         stride_gn, stride_gm, stride_xm, stride_xk, BM, BN, BK, True, False, False, SPLIT)
    rn = pid_n * BM + tl.arange(0, BM)
    rk = pid_k * BN + tl.arange(0, BN)
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rn[:, None].to(tl.int64) * K + rk[None, :]
    out = acc.to(tl.bfloat16) if OUT_BF16 else acc
    tl.store(c_ptrs, out, mask=(rn[:, None] < N) & (rk[None, :] < K))


# ---- launchers -------------------------------------------------------------------------------------

def expert_offsets(expert_of_row: torch.Tensor, n_experts: int) -> torch.Tensor:
    """offsets [E + 1] int64 on the device (rows of expert e: offsets[e] .. offsets[e+1]) from the
    non-decreasing expert ids of the sorted rows: a binary search per expert boundary (no host sync;
    bincount would read the largest id on the host)."""
    bounds = torch.arange(n_experts + 1, device=expert_of_row.device, dtype=expert_of_row.dtype)
    return torch.searchsorted(expert_of_row, bounds)


def _slots(offsets: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """The row-tile table (see the module docstring): per slot its expert (-1 idle), first row, end row.
    From offsets alone (about 18 small launches); ``ops.moe_experts`` gets the tables from the dispatch
    kernel instead (:mod:`.dispatch`, the same values), this builds them for direct callers."""
    n_experts = offsets.numel() - 1
    n_slots = triton.cdiv(rows, block_m) + n_experts
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)                                        # inclusive tile ends per expert
    slot = torch.arange(n_slots, device=offsets.device)
    expert = torch.searchsorted(ends, slot, right=True)                  # first expert whose tiles end past slot
    valid = expert < n_experts
    e = torch.where(valid, expert, 0)
    first = ends[e] - tiles[e]
    row = offsets[e] + (slot - first) * block_m
    return (torch.where(valid, e, -1).to(torch.int32), row.to(torch.int64), offsets[1:][e].to(torch.int64),
            n_slots)


def _weight_table(weights, k: int) -> torch.Tensor:
    """The device table of each expert weight's element offset from expert 0's. A stacked [E, N, K] tensor
    (or a strided view of one, e.g. a slice of a fused gate_up): ``e * stride(0)``, one table per (device,
    E, stride) kept for the process (a CUDA graph that captured it stays valid). A list of per-expert
    weights: validated and built once per set of weights and kept ON expert 0's weight tensor (it lives
    exactly as long as the weights; a weight updated in place keeps its pointer and its table, reallocated
    weights get a new one)."""
    if isinstance(weights, torch.Tensor):
        return _stacked_table(weights)
    w0 = weights[0]
    key = (tuple(map(id, weights)), tuple(w.data_ptr() for w in weights))
    cached = getattr(w0, "_rlalign_expert_offsets", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    _refuse_capture(w0)
    _check_weights(weights, k)
    size = w0.element_size()
    table = torch.tensor([(p - key[1][0]) // size for p in key[1]], dtype=torch.int64, device=w0.device)
    w0._rlalign_expert_offsets = (key, table)
    return table


_STACKED_TABLES: dict[tuple, torch.Tensor] = {}


def _stacked_table(w: torch.Tensor) -> torch.Tensor:
    _check_stacked(w)
    key = (w.device, w.shape[0], w.stride(0))
    table = _STACKED_TABLES.get(key)
    if table is None:
        _refuse_capture(w)
        table = _STACKED_TABLES[key] = torch.arange(w.shape[0], dtype=torch.int64, device=w.device) * w.stride(0)
    return table


def _refuse_capture(w: torch.Tensor) -> None:
    if w.is_cuda and torch.cuda.is_current_stream_capturing():
        raise fail("moe_experts", "the expert weight table would be first built inside a CUDA graph capture "
                                  "(run the forward once before capturing)")


def _check_stacked(w: torch.Tensor) -> None:
    """A stacked [E, N, K] weight: rows of unit column stride, expert 0 and every expert step 16-byte aligned
    (the kernel's W_ALIGN hint); the row stride may exceed K (a slice of a wider tensor)."""
    size = w.element_size()
    if w.dim() != 3 or w.stride(2) != 1 or w.data_ptr() % 16 or (w.stride(0) * size) % 16:
        raise fail("moe_experts", "stacked expert weights must be [E, N, K] with unit column stride, 16-byte "
                                  "aligned, and an expert step of a multiple of 16 bytes (.contiguous() them) "
                                  f"(got {tuple(w.shape)} with strides {w.stride()})")


def _check_weights(weights, k: int) -> None:
    w0 = weights[0]
    for w in weights:
        if w.dim() != 2 or w.shape != w0.shape or w.stride() != w0.stride() or w.dtype != w0.dtype \
                or w.stride(1) != 1 or w.data_ptr() % 16:
            raise fail("moe_experts", "expert weights must share one shape, dtype and row-major strides, "
                                      "16-byte aligned (.contiguous() each expert's weight) "
                                      f"(got {tuple(w.shape)}/{w.stride()} and {tuple(w0.shape)}/{w0.stride()})")


def grouped_rows(x: torch.Tensor, offsets: torch.Tensor, weights, *, transpose_w: bool = True,
                 segments: int = 1, out_dtype: torch.dtype | None = None,
                 config: GroupedConfig | None = None, use_tma: bool | None = None,
                 slot_cache: dict | None = None) -> torch.Tensor:
    """C [R, N]: rows of expert e times W_e^T (``transpose_w``; W_e [N, K]) or W_e (W_e [K, N]).
    ``config`` overrides the tile choice (benchmarks; every tile gives the same bits). ``slot_cache``: a dict
    shared by the calls of one MoE layer (same ``offsets``), so the row-tile table is built once per tile height."""
    x = aligned(x)
    rows, k = x.shape
    table = _weight_table(weights, k)      # validates the weights once per set of weights
    w0 = weights[0]
    n_w, k_w, stride_w = w0.shape[0], w0.shape[1], w0.stride(0)
    n = n_w if transpose_w else k_w
    if (k_w if transpose_w else n_w) != k:
        raise ValueError(f"grouped GEMM: x has {k} columns, the expert weights are {n_w}x{k_w}")
    if segments not in (1, 2, 4, 8) or k % segments:
        raise ValueError(f"grouped GEMM: segments must be 1, 2, 4 or 8 and divide K={k}, got {segments}")
    out = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    fp32 = x.dtype == torch.float32
    cfg = config or _rows_config(rows, len(weights), segments, fp32)
    if slot_cache is None:
        slot_cache = {}
    if cfg.block_m not in slot_cache:
        slot_cache[cfg.block_m] = _slots(offsets, rows, cfg.block_m)
    slot_expert, slot_row, slot_end, n_slots = slot_cache[cfg.block_m]
    seg_k = k // segments
    # B_e logical [K, N]: stored [N, K] (transpose_w) -> strides (1, row stride); stored [K, N] -> (row stride, 1)
    s_bk, s_bn = (1, stride_w) if transpose_w else (stride_w, 1)
    grid = (n_slots * triton.cdiv(n, cfg.block_n),)
    # A through TMA when no mask falls inside the tensor (one segment, or segments of whole 64-steps);
    # the choice depends on shapes only and both paths compute the same dots
    tma_a = (segments == 1 or seg_k % BLOCK_K == 0) and tma_ok(x) and not fp32 and not is_interpreter()
    if use_tma is not None:
        tma_a = tma_a and use_tma
    a_desc = descriptor(x, [cfg.block_m, BLOCK_K]) if tma_a else x
    grouped_rows_kernel[grid](
        x, a_desc, weights[0], table, out, slot_expert, slot_row, slot_end, out,
        n, k, seg_k, triton.cdiv(seg_k, BLOCK_K), n_slots,
        x.stride(0), x.stride(1), s_bk, s_bn, out.stride(0), out.stride(1),
        BM=cfg.block_m, BN=cfg.block_n, BK=BLOCK_K, P=segments, LOG2P=segments.bit_length() - 1,
        B_TRANS=transpose_w, SPLIT=split_for(x.dtype), OUT_BF16=out.dtype == torch.bfloat16, GROUP_M=8,
        W_ALIGN=16 // x.element_size(), TMA_A=tma_a, NESTED=cfg.nested and segments > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def grouped_weight_grad(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, n_experts: int,
                        out_dtype: torch.dtype, config: GroupedConfig | None = None) -> torch.Tensor:
    """G_W [E, N, K] with G_W[e] = G[rows_e]^T @ X[rows_e] (g [R, N], x [R, K]); 0 for an idle expert.
    ``config`` overrides the tile ([N, K] tiles; benchmarks: every tile gives the same bits)."""
    g, x = aligned(g), aligned(x)
    n, k = g.shape[1], x.shape[1]
    out = torch.empty((n_experts, n, k), dtype=out_dtype, device=g.device)
    if out.numel() == 0:
        return out
    cfg = config or (_FP32 if g.dtype == torch.float32 else _REDUCE)
    tiles_n, tiles_k = triton.cdiv(n, cfg.block_m), triton.cdiv(k, cfg.block_n)
    grouped_reduce_kernel[(n_experts * tiles_n * tiles_k,)](
        g, x, out, offsets, n, k, tiles_n, tiles_k,
        g.stride(0), g.stride(1), x.stride(0), x.stride(1), out.stride(0),
        BM=cfg.block_m, BN=cfg.block_n, BK=BLOCK_K, SPLIT=split_for(g.dtype),
        OUT_BF16=out_dtype == torch.bfloat16, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


class _GroupedLinear(torch.autograd.Function):
    """y[rows_e] = x[rows_e] @ W_e^T for every expert, with the strict linear's backward per expert. The
    weights: one stacked [E, N, K] tensor (one input, its gradient the [E, N, K] dW as the kernel writes it)
    or E per-expert tensors (E inputs, the dW unbound)."""

    @staticmethod
    def forward(ctx, x, offsets, segments, slot_cache, *weights):
        ctx.save_for_backward(x, offsets, *weights)
        ctx.segments, ctx.slot_cache = segments, slot_cache
        return grouped_rows(x, offsets, _as_weights(weights), segments=segments, slot_cache=slot_cache)

    @staticmethod
    def backward(ctx, grad):
        x, offsets, *weights = ctx.saved_tensors
        w = _as_weights(weights)
        g = grad.contiguous().to(x.dtype)
        grad_x = (grouped_rows(g, offsets, w, transpose_w=False, slot_cache=ctx.slot_cache)
                  if ctx.needs_input_grad[0] else None)
        grad_w = [None] * len(weights)
        if any(ctx.needs_input_grad[4:]):
            stacked = grouped_weight_grad(g, x, offsets, len(w), w[0].dtype)
            grad_w = [stacked] if isinstance(w, torch.Tensor) else list(stacked.unbind(0))
        return (grad_x, None, None, None, *grad_w)


def _as_weights(inputs):
    """The autograd inputs back as the weights: the stacked tensor, or the list of per-expert tensors."""
    return inputs[0] if len(inputs) == 1 and inputs[0].dim() == 3 else list(inputs)


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, weights, segments: int = 1,
                   slot_cache: dict | None = None) -> torch.Tensor:
    """The strict linear of each expert's rows (see the module docstring); differentiable in x and W.
    ``weights``: a stacked [E, N, K] tensor (one autograd input) or a list of E [N, K] tensors."""
    inputs = (weights,) if isinstance(weights, torch.Tensor) else tuple(weights)
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in inputs)):
        return _GroupedLinear.apply(x, offsets, segments, slot_cache, *inputs)
    return grouped_rows(x, offsets, weights, segments=segments, slot_cache=slot_cache)


def supported() -> bool:
    """The grouped path loads weights through a pointer table: real devices only (the interpreter
    tier runs it too, on CPU tensors)."""
    return torch.cuda.is_available() or is_interpreter()


__all__ = ["grouped_linear", "grouped_rows", "grouped_weight_grad", "expert_offsets", "row_tile_heights", "GroupedConfig"]
