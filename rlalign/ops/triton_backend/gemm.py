"""The strict GEMM of the Triton backend: C = A @ B (+ bias), one fixed K order for every M.

Numerics of one output element C[m, n] (whatever the tile shape, the number of rows M, the
row's position, the number of warps or pipeline stages):

* K is cut into P canonical segments of SEG_K = K / P columns (P = 1 when not asked for).
  Segment s is reduced from zero in steps of exactly ``BLOCK_K`` = 64 columns starting at
  ``s * SEG_K``, in increasing order: ``acc = mma(A[m, k:k+64], B[k:k+64, n], acc)``; columns
  past the segment (or past K) are exact zeros. ``mma`` is ``tl.dot`` with an fp32 accumulator
  (bf16 operands; fp32 operands split bf16x3, see :mod:`._common`). The hardware takes each step
  as k16 chunks, in order, onto the one accumulator; so a P = 1 bf16 launch may step 128 or 256
  columns at a time where K is a multiple of that (``GemmConfig.block_k``): the same chunks in the
  same order, no padding chunk added.
* The P segment partials merge in the balanced binary tree ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7))
  in fp32 (a stack of completed subtrees, merged as soon as both halves exist). The kernel walks
  all P segments in one loop of P * steps k-steps; the accumulator restarts from zero at each
  segment start (an exact zero, so a segment's partial is that of a separate call on its columns).
* Then ``+ bias[n]`` in fp32 and one rounding to the output dtype (or an fp32 store). With
  ``acc_in`` the accumulator starts from the fp32 values already in C (P = 1 only): a reduction
  split across calls at multiples of 64 columns gives the bits of one call.

Tile shape (BLOCK_M in {16, 32, 64, 128}, BLOCK_N in {32..256}), warps (4/8, along M where BLOCK_M >=
16 * warps, across N in the 16/32-row decode tiles: an element is one warp's chain either way),
pipeline depth, persistent scheduling (programs per SM) and the loop structure of the
K partition (one loop per segment, one flat loop per tile, or one flat stream of a program's
(tile, segment) items: ``GemmConfig.nested`` / ``stream``) only change which program computes an
element and when, not its sequence of operations; docs/design/tile-shapes.md says what was verified on the H200.
Hopper issues ``wgmma`` (m64nNk16) for tiles of 64 or 128 rows; the decode tiles of 16 and 32 rows
(:data:`SMALL_M_TILES`) get ``mma.sync`` (m16n8k16), whose per-element bits the H200 showed equal to
wgmma's on the same k16 chunks in the same order (2026-12-03: benchmarks/mma_bits_probe.py on random
tiles, every case of the decode sweep, tests/cuda/test_cuda_linear.py;
benchmarks/evidence/gemm-h200/mma-bits-probe.txt).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from rlalign import envvars
from rlalign.ops import gemm_census
from rlalign.ops.triton_backend._common import (BLOCK_K, aligned, descriptor, device_sms, forced_tile, is_interpreter,
                                                mma, split_for, tma_ok)
from rlalign.ops.triton_backend.gemm_ws import WS_ENV, WsConfig, gemm_ws, tile_count
from rlalign.ops.triton_backend.gemm_ws import launch_for as ws_launch_for, supported as ws_supported


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    flatten: bool = False
    reg_levels: int = 4   # tree-stack levels kept in registers; deeper ones go to a per-program scratch
    nested: bool = False  # segmented only: a loop per segment (segment_tree_nested) instead of one flat loop
    # segmented only: segment_stream_kernel, one flat loop over the k-steps of all of a program's (tile, segment)
    # items (loads stream across segment and tile ends; the tree stack must fit in registers: reg_levels >= 3)
    stream: bool = False
    ctas_per_sm: int = 1  # persistent programs per SM (2: one program's MMAs fill another's pipeline bubbles)
    # columns per k-step of the P = 1 bf16 kernel (64, 128 or 256): a wider step issues the same k16 chunks in the
    # same order onto the same accumulator, in fewer loop iterations (decode-sized M streams W with little work per
    # step). Used only where K % block_k == 0, so no chunk of padding is added; elsewhere (and for the K partition,
    # fp32 operands' bf16x3 split -- whose three dots interleave per step -- and acc_in) the step is BLOCK_K.
    block_k: int = BLOCK_K


# Candidate tiles, most efficient first (see pick_config). Shared memory, from sm_90a compiles: the pipeline
# holds stages x (BM + BN) x 64 operands, and a TMA epilogue stages the output tile (and, with acc_in, the loaded
# accumulator); everything must fit in 227 KiB.
_LARGE = (GemmConfig(128, 256, 8, 3, flatten=True), GemmConfig(128, 128, 8, 4, flatten=True))
_MEDIUM = (GemmConfig(64, 128, 4, 4), GemmConfig(64, 64, 4, 5))
# The fill rule's last resorts above 64 rows (few tiles: narrow N), deep pipelines that keep W streaming; flatten keeps
# the pipeline going across a program's successive tiles. (M <= 64 takes SMALL_M_TILES, before the fill rule; until
# 2026-12-03 these 64-row tiles, with 64x128 x6 first, were its decode tiles.)
_NARROW = (GemmConfig(64, 64, 4, 10, flatten=True), GemmConfig(64, 32, 4, 12, flatten=True))
# fp32 output tiles (lm_logits, fp32 partials): 128x256 would need 272 KiB.
_LARGE_F32OUT = (GemmConfig(128, 128, 8, 4, flatten=True),)
# acc_in (the fp32 accumulator is loaded and stored): one more fp32 tile of staging. Not flattened: with the
# accumulator's load inside the flattened tile loop Triton 3.6 does not software-pipeline the k loop (sm_90a TTGIR:
# only wgmma wait 0), and the LM head's dX (dh += dz W, 19 calls a step) ran at 0.34x cuBLAS on the H200 (2026-12-02,
# benchmarks/gemm_census.py); the unflattened loop keeps wait 1 and 4 stages fit (192 KiB).
_LARGE_ACCIN = (GemmConfig(128, 128, 8, 4),)
_SMALL_ACCIN = (GemmConfig(64, 128, 4, 5), GemmConfig(64, 64, 4, 8), GemmConfig(64, 32, 4, 10))
# Segmented (k_segments > 1) tiles. Large M: a loop per segment (segment_tree_nested) on 128x128 tiles
# with one tree level in registers and the deeper ones in the program's scratch: 0.70x cuBLAS at
# 4096x4096x12288 and 0.46x at K = 4096 on the H200, against 0.43x / 0.38x for the one-loop kernel on
# 128x64 tiles (benchmarks/gpu_linear.py --set segsweep, 2026-12-01; docs/performance.md). The one-loop kernel
# (segment_tree: one pipeline across segments, shared memory independent of P and K) stays for the
# narrower tiles. sm_90a, P=8 (ptxas -v): 128x64/8 warps 228 registers, 112 KiB, no spills; 128x128
# spills with two or more levels in registers.
_SEG_LARGE = (GemmConfig(128, 128, 8, 4, reg_levels=1, nested=True), GemmConfig(128, 64, 8, 4))
# Large-M schedules of the K partition for benchmarks/gpu_linear.py --sweep-kpart (speed only, the default first; no
# GPU numbers yet, so none is picked by pick_config). sm_90a compiles (TTGIR, ptxas -v; 2026-12-02):
# the default drains its pipeline (wgmma wait 0) and issues the next segment's first loads only after each
# segment's tree merge; segment_stream_kernel keeps the TMA loads streaming across segment and tile ends but, with
# its tree stack in registers (the only form Triton 3.6 pipelines: a stack in the scratch leaves the loop
# unpipelined), waits for every MMA; two programs per SM let one program's MMAs fill the other's refills/waits.
KPART_CANDIDATES = (
    _SEG_LARGE[0],
    GemmConfig(128, 64, 8, 4, stream=True),                                   # 255 regs, 76 B spill, 112 KiB
    GemmConfig(64, 64, 4, 4, stream=True, ctas_per_sm=2),
    GemmConfig(128, 64, 4, 3, reg_levels=1, nested=True, ctas_per_sm=2),
    GemmConfig(64, 128, 4, 3, reg_levels=1, nested=True, ctas_per_sm=2),
)
_SEG_SMALL = (GemmConfig(64, 64, 4, 5), GemmConfig(64, 32, 4, 10))
# fp32 operands (bf16x3 split in registers): modest tiles (128x128 uses 224 KiB of shared memory).
_FP32 = (GemmConfig(128, 128, 8, 3), GemmConfig(64, 64, 4, 3))
_FP32_SMALL = (GemmConfig(64, 64, 4, 3), GemmConfig(64, 32, 4, 3))


def candidate_configs(m: int, n: int, segments: int, fp32: bool, out_mode: str = "bf16") -> tuple[GemmConfig, ...]:
    """out_mode: "bf16" (rounded output), "fp32" (fp32 output), "acc_in" (fp32 in and out)."""
    if fp32:
        return _FP32_SMALL if segments > 1 or out_mode == "acc_in" else _FP32
    if segments > 1:
        return _SEG_SMALL if m <= 64 else _SEG_LARGE + _SEG_SMALL
    if out_mode == "acc_in":
        return _SMALL_ACCIN if m <= 64 else _LARGE_ACCIN + _MEDIUM + _SMALL_ACCIN[1:]
    large = _LARGE_F32OUT if out_mode == "fp32" else _LARGE
    return large + _MEDIUM + _NARROW   # (P = 1 at M <= 64: small_m_tile, see pick_config)


# P = 1 decode batches (bf16 out): one tile per row range, taken where its tiles keep at least
# DECODE_TILE_MIN_FILL of the SMs busy (pick_config's fill rule would refuse them there). Two 128-row tiles cover
# 129..256 rows, so each weight column block is read twice (64-row tiles read it four times); 257..384 rows were not
# measured and keep the fill rule. Chosen by H200 sweeps of the stacked decode projections (2026-12-03, `--sweep-ws
# --ws-triton --ws-shapes 8b-stacked,0.6b-stacked`, every launch bit-equal; faster than the fill rule's tiles and the
# Gluon kernel at 244 and 462 rows); docs/performance.md "Launch tables".
DECODE_TILES = ((129, 256, GemmConfig(128, 128, 8, 5, flatten=True)),
                (385, 512, GemmConfig(128, 256, 8, 3, flatten=True)))
DECODE_TILE = DECODE_TILES[0][2]
DECODE_TILE_MIN_FILL = 0.7


# P = 1 decode batches of at most 64 rows (bf16 operands; bf16 or fp32 output): the GEMM streams W, and only N / BN
# programs share the stream, so the tile is the narrowest row count that covers the rows, with k-steps of 128-256
# columns (GemmConfig.block_k: the same k16 chunks in fewer loop iterations). Rows <= 32 take 16- and 32-row tiles,
# on which Triton issues mma.sync (m16n8k16) instead of wgmma: benchmarks/mma_bits_probe.py and every case of the sweep
# below found their bits equal to the 64-row wgmma tiles' (docs/design/tile-shapes.md).
# Per row band, the widest tile first; a band takes the first whose tiles keep DECODE_TILE_MIN_FILL of the SMs busy,
# else its last (narrowest). Chosen by an H200 sweep (2026-12-03, `--sweep-ws --ws-small`, graph replays, every launch
# bit-equal): 0.80-1.07 of cuBLAS at M = 1-64 on 9 decode shapes, against 0.45-1.05 for the 64-row tiles with
# 64-column steps; docs/performance.md "Launch tables".
SMALL_M_TILES = (
    (16, (GemmConfig(16, 128, 4, 3, flatten=True, block_k=256), GemmConfig(16, 64, 4, 5, flatten=True, block_k=256),
          GemmConfig(16, 32, 4, 4, flatten=True, block_k=256, ctas_per_sm=2))),
    (32, (GemmConfig(32, 64, 4, 4, flatten=True, block_k=256),
          GemmConfig(16, 32, 4, 4, flatten=True, block_k=256, ctas_per_sm=2))),
    (64, (GemmConfig(64, 128, 4, 4, flatten=True, block_k=128), GemmConfig(64, 64, 4, 5, flatten=True, block_k=128),
          GemmConfig(64, 32, 4, 4, flatten=True, block_k=256))))


def small_m_tile(m: int, n: int, segments: int, fp32: bool, sms: int, out_mode: str = "bf16") -> GemmConfig | None:
    """The :data:`SMALL_M_TILES` tile for ``m`` <= 64 rows (P = 1, bf16 operands, bf16 or fp32 output), else None."""
    if segments != 1 or fp32 or out_mode == "acc_in":
        return None
    for max_rows, tiles in SMALL_M_TILES:
        if m <= max_rows:
            return next((t for t in tiles if triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
                         >= DECODE_TILE_MIN_FILL * sms), tiles[-1])
    return None


def decode_tile(m: int, n: int, segments: int, fp32: bool, sms: int, out_mode: str = "bf16") -> GemmConfig | None:
    """The :data:`DECODE_TILES` tile of ``m`` rows where one applies (P = 1, bf16 operands and output, enough
    tiles), else None. One owner: pick_config takes it, and the dispatcher's choice of the Gluon kernel defers to
    it."""
    if segments != 1 or fp32 or out_mode != "bf16":
        return None
    for low, high, tile in DECODE_TILES:
        if low <= m <= high:
            tiles = triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n)
            return tile if tiles >= DECODE_TILE_MIN_FILL * sms else None
    return None


def pick_config(m: int, n: int, segments: int, fp32: bool, sms: int, out_mode: str = "bf16") -> GemmConfig:
    """:func:`small_m_tile` or :func:`decode_tile` where one applies; else the first candidate whose tiles fill at
    least 85% of the persistent programs' slots over all waves (else the best-filling one).

    ``RLALIGN_TRITON_GEMM_TILE="BM,BN,warps,stages"`` forces one tile for every M (a safety switch
    should a GPU ever show two tile shapes to differ)."""
    forced = forced_tile("RLALIGN_TRITON_GEMM_TILE")
    if forced:
        bm, bn, warps, stages = forced
        return GemmConfig(bm, bn, warps, stages, reg_levels=0 if segments > 1 and bm * bn >= 128 * 128 else 4)
    decode = small_m_tile(m, n, segments, fp32, sms, out_mode) or decode_tile(m, n, segments, fp32, sms, out_mode)
    if decode is not None:
        return decode
    cands = candidate_configs(m, n, segments, fp32, out_mode)
    best, best_eff = cands[-1], -1.0
    for cfg in cands:
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        slots = sms * cfg.ctas_per_sm
        eff = tiles / (triton.cdiv(tiles, slots) * slots)   # busy fraction of the persistent programs' slots
        if eff >= 0.85:
            return cfg
        if eff > best_eff:
            best, best_eff = cfg, eff
    return best


def all_configs(segments: int, fp32: bool, out_mode: str = "bf16") -> tuple[GemmConfig, ...]:
    """Every tile shape the launcher may pick (the CUDA tests check they agree bit for bit)."""
    if fp32:
        return _FP32_SMALL if segments > 1 or out_mode == "acc_in" else _FP32 + _FP32_SMALL[1:]
    if segments > 1:
        return _SEG_LARGE + _SEG_SMALL
    if out_mode == "acc_in":
        return _LARGE_ACCIN + _MEDIUM + _SMALL_ACCIN
    large = _LARGE_F32OUT if out_mode == "fp32" else _LARGE + (GemmConfig(128, 256, 8, 3, flatten=False),)
    large += tuple(tile for _, _, tile in DECODE_TILES if out_mode == "bf16" and tile not in large)
    return large + _MEDIUM + _NARROW + tuple(dict.fromkeys(tile for _, tiles in SMALL_M_TILES for tile in tiles))


# ---- kernel --------------------------------------------------------------------------------------

@triton.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row tiles sweep the column tiles together (L2 reuse of B)."""
    width = GROUP_M * num_pid_n
    group = tile // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % size_m
    pid_n = (tile % width) // size_m
    return pid_m, pid_n


@triton.jit
def load_a_tile(a_src, off_m, k, k_end, M, stride_am, stride_ak,
            BM: tl.constexpr, BK: tl.constexpr, A_TRANS: tl.constexpr, USE_TMA: tl.constexpr):
    """Logical A[off_m:off_m+BM, k:k+BK] (A is [M, K]; stored [K, M] when A_TRANS); 0 past k_end / M."""
    if USE_TMA:
        if A_TRANS:
            return a_src.load([k, off_m]).T
        else:
            return a_src.load([off_m, k])
    else:
        rm = off_m + tl.arange(0, BM)
        rk = k + tl.arange(0, BK)
        ptrs = a_src + rm[:, None].to(tl.int64) * stride_am + rk[None, :].to(tl.int64) * stride_ak
        return tl.load(ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_end), other=0.0)


@triton.jit
def load_b_tile(b_src, off_n, k, k_end, N, stride_bk, stride_bn,
            BN: tl.constexpr, BK: tl.constexpr, B_TRANS: tl.constexpr, USE_TMA: tl.constexpr):
    """Logical B[k:k+BK, off_n:off_n+BN] (B is [K, N]; stored [N, K] when B_TRANS); 0 past k_end / N."""
    if USE_TMA:
        if B_TRANS:
            return b_src.load([off_n, k]).T
        else:
            return b_src.load([k, off_n])
    else:
        rk = k + tl.arange(0, BK)
        rn = off_n + tl.arange(0, BN)
        ptrs = b_src + rk[:, None].to(tl.int64) * stride_bk + rn[None, :].to(tl.int64) * stride_bn
        return tl.load(ptrs, mask=(rk[:, None] < k_end) & (rn[None, :] < N), other=0.0)


@triton.jit
def reduce_segment(acc, a_src, b_src, off_m, off_n, k0, k_end, steps, M, N,
                    stride_am, stride_ak, stride_bk, stride_bn,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, A_TRANS: tl.constexpr,
                    B_TRANS: tl.constexpr, USE_TMA: tl.constexpr, SPLIT: tl.constexpr):
    """acc + sum over k-steps k0, k0+BK, ... (``steps`` of them, masked to k_end) in order."""
    for j in range(steps):
        k = k0 + j * BK
        a = load_a_tile(a_src, off_m, k, k_end, M, stride_am, stride_ak, BM, BK, A_TRANS, USE_TMA)
        b = load_b_tile(b_src, off_n, k, k_end, N, stride_bk, stride_bn, BN, BK, B_TRANS, USE_TMA)
        acc = mma(a, b, acc, SPLIT)
    return acc


@triton.jit
def _scratch_ptrs(scratch, slot, level: tl.constexpr, REG_LEVELS: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr):
    base = scratch + (slot.to(tl.int64) * 4 + (level - REG_LEVELS)) * (BM * BN)
    return base + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]


@triton.jit
def _push(v, held, scratch, slot, level: tl.constexpr, REG_LEVELS: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr):
    """Keep a completed subtree of 2**level segments until its right sibling exists (fp32 exact):
    in registers (level < REG_LEVELS: returned) or in the program's scratch slot (``held``, the
    untouched register stand-in, is returned so that no register tile stays live for it)."""
    if level < REG_LEVELS:
        return v
    else:
        tl.debug_barrier()
        tl.store(_scratch_ptrs(scratch, slot, level, REG_LEVELS, BM, BN), v)
        tl.debug_barrier()
        return held


@triton.jit
def _pop(v, scratch, slot, level: tl.constexpr, REG_LEVELS: tl.constexpr, BM: tl.constexpr,
         BN: tl.constexpr):
    if level < REG_LEVELS:
        return v
    else:
        tl.debug_barrier()
        return tl.load(_scratch_ptrs(scratch, slot, level, REG_LEVELS, BM, BN))


@triton.jit
def merge_segment(v, st0, st1, st2, s, scratch, slot, LOG2P: tl.constexpr, REG_LEVELS: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr):
    """Segment ``s``'s partial ``v`` joins the binary-counter stack of completed subtrees.

    Bit ``l`` of s says whether v's subtree (2**l segments) is a left child (pushed to level l)
    or a right child (added to the left sibling's sum, ``left + right``, and carried up). Returns
    (v, st0, st1, st2): after the last segment v is the whole tree ((s0+s1)+(s2+s3))+(...)."""
    if s % 2 == 0:
        st0 = _push(v, st0, scratch, slot, 0, REG_LEVELS, BM, BN)
    else:
        v = _pop(st0, scratch, slot, 0, REG_LEVELS, BM, BN) + v
        if LOG2P > 1:
            if (s // 2) % 2 == 0:
                st1 = _push(v, st1, scratch, slot, 1, REG_LEVELS, BM, BN)
            else:
                v = _pop(st1, scratch, slot, 1, REG_LEVELS, BM, BN) + v
                if LOG2P > 2:
                    if (s // 4) % 2 == 0:
                        st2 = _push(v, st2, scratch, slot, 2, REG_LEVELS, BM, BN)
                    else:
                        v = _pop(st2, scratch, slot, 2, REG_LEVELS, BM, BN) + v
    return v, st0, st1, st2


@triton.jit
def segment_tree(a_src, b_src, scratch, slot, off_m, off_n, M, N, SEG_K, steps,
                  stride_am, stride_ak, stride_bk, stride_bn,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P: tl.constexpr,
                  LOG2P: tl.constexpr, REG_LEVELS: tl.constexpr, A_TRANS: tl.constexpr,
                  B_TRANS: tl.constexpr, USE_TMA: tl.constexpr, SPLIT: tl.constexpr):
    """P (2, 4 or 8) segment partials merged ((s0+s1)+(s2+s3))+... via a binary-counter stack.

    ONE loop over all P * steps k-steps (one software pipeline, one set of shared-memory stage
    buffers, no pipeline drain between segments); at a segment's last step its partial is merged
    into the stack and the accumulator restarts from zero. Per element this is exactly: each
    segment reduced from zero in 64-column steps in order, then the fixed tree."""
    zero = tl.zeros((BM, BN), dtype=tl.float32)
    acc = zero
    st0 = zero
    st1 = zero
    st2 = zero
    for i in range(P * steps):
        s = i // steps
        j = i - s * steps
        k_end = (s + 1) * SEG_K
        k = s * SEG_K + j * BK
        a = load_a_tile(a_src, off_m, k, k_end, M, stride_am, stride_ak, BM, BK, A_TRANS, USE_TMA)
        b = load_b_tile(b_src, off_n, k, k_end, N, stride_bk, stride_bn, BN, BK, B_TRANS, USE_TMA)
        acc = mma(a, b, acc, SPLIT)
        if j == steps - 1:
            v, st0, st1, st2 = merge_segment(acc, st0, st1, st2, s, scratch, slot, LOG2P, REG_LEVELS, BM, BN)
            if s == P - 1:
                acc = v       # the whole tree: the loop ends here
            else:
                acc = zero    # the next segment starts from zero
    return acc


@triton.jit
def segment_tree_nested(a_src, b_src, scratch, slot, off_m, off_n, M, N, SEG_K, steps,
                        stride_am, stride_ak, stride_bk, stride_bn,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P: tl.constexpr,
                        LOG2P: tl.constexpr, REG_LEVELS: tl.constexpr, A_TRANS: tl.constexpr,
                        B_TRANS: tl.constexpr, USE_TMA: tl.constexpr, SPLIT: tl.constexpr):
    """:func:`segment_tree`'s arithmetic with a loop per segment: the accumulator is read only after a
    segment's last step (the flat loop reads it at every step to test for a segment end, which can make
    each step wait for its MMA); the pipeline refills at each segment start instead."""
    zero = tl.zeros((BM, BN), dtype=tl.float32)
    v = zero
    st0 = zero
    st1 = zero
    st2 = zero
    for s in range(P):
        k_end = (s + 1) * SEG_K
        acc = reduce_segment(zero, a_src, b_src, off_m, off_n, s * SEG_K, k_end, steps, M, N,
                             stride_am, stride_ak, stride_bk, stride_bn, BM, BN, BK, A_TRANS, B_TRANS,
                             USE_TMA, SPLIT)
        v, st0, st1, st2 = merge_segment(acc, st0, st1, st2, s, scratch, slot, LOG2P, REG_LEVELS, BM, BN)
    return v


@triton.jit
def store_tile(acc, c_src, bias_ptr, off_m, off_n, M, N, stride_cm, stride_cn, BM: tl.constexpr, BN: tl.constexpr,
               HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, USE_TMA: tl.constexpr):
    """C[off_m:, off_n:] = acc (+ bias[n] in fp32), one rounding to the output dtype (or fp32)."""
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if OUT_BF16:
        out = acc.to(tl.bfloat16)
    else:
        out = acc
    if USE_TMA:
        c_src.store([off_m, off_n], out)
    else:
        c_ptrs = c_src + rm[:, None].to(tl.int64) * stride_cm + rn[None, :].to(tl.int64) * stride_cn
        tl.store(c_ptrs, out, mask=(rm[:, None] < M) & (rn[None, :] < N))


# ``steps`` (k-steps per segment) is never specialized: Triton specializes an integer argument equal to 1, a
# loop of one iteration is then folded away, and its combine pass rewrites ``dot(a, b, 0) + d`` into
# ``dot(a, b, d)`` -- for P = 1, K <= 64 with a bias that put the bias in the accumulator before the products
# (found on the H200, 2026-12-02: the Gluon kernel, which follows the documented order, differed by an ulp).
# Kept a runtime loop, the accumulator is a loop value and the sum is rounded as documented.
KSTEP_UNSPECIALIZED = ["M", "num_progs", "steps"]


@triton.jit(do_not_specialize=KSTEP_UNSPECIALIZED)
def gemm_kernel(a_src, b_src, c_src, bias_ptr, scratch,
                M, N, K, SEG_K, steps, num_progs,
                stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P: tl.constexpr, LOG2P: tl.constexpr,
                REG_LEVELS: tl.constexpr, A_TRANS: tl.constexpr, B_TRANS: tl.constexpr,
                USE_TMA: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ACC_IN: tl.constexpr,
                OUT_BF16: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, NESTED: tl.constexpr):
    """Persistent: program ``pid`` computes tiles pid, pid + num_progs, ... (see module docstring)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    for tile in tl.range(pid, num_tiles, num_progs, flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        if P == 1:
            if ACC_IN:
                if USE_TMA:
                    acc = c_src.load([off_m, off_n])
                else:
                    rm = off_m + tl.arange(0, BM)
                    rn = off_n + tl.arange(0, BN)
                    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
                    c_ptrs = c_src + rm[:, None].to(tl.int64) * stride_cm + rn[None, :].to(tl.int64) * stride_cn
                    acc = tl.load(c_ptrs, mask=c_mask, other=0.0)
            else:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc = reduce_segment(acc, a_src, b_src, off_m, off_n, 0, K, steps, M, N,
                                  stride_am, stride_ak, stride_bk, stride_bn, BM, BN, BK, A_TRANS, B_TRANS,
                                  USE_TMA, SPLIT)
        else:
            if NESTED:
                acc = segment_tree_nested(a_src, b_src, scratch, pid, off_m, off_n, M, N, SEG_K, steps,
                                          stride_am, stride_ak, stride_bk, stride_bn, BM, BN, BK, P, LOG2P,
                                          REG_LEVELS, A_TRANS, B_TRANS, USE_TMA, SPLIT)
            else:
                acc = segment_tree(a_src, b_src, scratch, pid, off_m, off_n, M, N, SEG_K, steps,
                                   stride_am, stride_ak, stride_bk, stride_bn, BM, BN, BK, P, LOG2P, REG_LEVELS,
                                   A_TRANS, B_TRANS, USE_TMA, SPLIT)
        store_tile(acc, c_src, bias_ptr, off_m, off_n, M, N, stride_cm, stride_cn, BM, BN, HAS_BIAS, OUT_BF16,
                   USE_TMA)


@triton.jit(do_not_specialize=KSTEP_UNSPECIALIZED)
def segment_stream_kernel(a_src, b_src, c_src, bias_ptr, scratch,
                          M, N, SEG_K, steps, num_progs,
                          stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P: tl.constexpr,
                          LOG2P: tl.constexpr, REG_LEVELS: tl.constexpr, A_TRANS: tl.constexpr,
                          B_TRANS: tl.constexpr, USE_TMA: tl.constexpr, SPLIT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, GROUP_M: tl.constexpr):
    """The canonical K partition (P > 1) as one stream of k-steps per persistent program.

    Program ``pid`` owns tiles pid, pid + num_progs, ... and walks their segments in order: item
    ``it`` is segment ``it % P`` of the program's tile ``it // P``, and ONE loop runs over the k-steps
    of all its items. Each item reduces its segment from zero in 64-column steps, in order; at its last
    step the partial joins merge_segment's stack, and the tile's last segment completes the tree
    ((s0+s1)+(s2+s3))+(...), then bias and one rounding. Per element these are gemm_kernel's operations
    in gemm_kernel's order. Being one loop, Triton's software pipeline keeps the next segment's (and
    the next tile's) TMA loads in flight while a segment ends and its tree merges; segment_tree_nested
    drains and refills its pipeline at every segment. What it costs (Triton 3.6, sm_90a): the stack is
    carried from the segment-end branch, so every MMA is waited for (wgmma wait 0 per k-step); a stack
    level in the scratch (global loads and barriers in the loop) leaves the loop unpipelined, so the
    launcher requires every level in registers."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    my_tiles = tl.cdiv(num_pid_m * num_pid_n - pid, num_progs)
    zero = tl.zeros((BM, BN), dtype=tl.float32)
    acc = zero
    st0 = zero
    st1 = zero
    st2 = zero
    for i in range(my_tiles * P * steps):
        item = i // steps
        j = i - item * steps
        s = item % P
        pid_m, pid_n = tile_coords(pid + (item // P) * num_progs, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        k = s * SEG_K + j * BK
        a = load_a_tile(a_src, off_m, k, (s + 1) * SEG_K, M, stride_am, stride_ak, BM, BK, A_TRANS, USE_TMA)
        b = load_b_tile(b_src, off_n, k, (s + 1) * SEG_K, N, stride_bk, stride_bn, BN, BK, B_TRANS, USE_TMA)
        acc = mma(a, b, acc, SPLIT)
        segment_end = j == steps - 1
        if segment_end:
            # the accumulator is read only here (the segment's partial joins the stack)
            v, st0, st1, st2 = merge_segment(acc, st0, st1, st2, s, scratch, pid, LOG2P, REG_LEVELS, BM, BN)
            if s == P - 1:
                store_tile(v, c_src, bias_ptr, off_m, off_n, M, N, stride_cm, stride_cn, BM, BN, HAS_BIAS, OUT_BF16,
                           USE_TMA)
        # the next segment starts from an exact zero: a select after the MMA, not a branch result
        acc = tl.where(segment_end, zero, acc)


@triton.jit(do_not_specialize=["steps"])
def segment_partials_kernel(a_src, b_src, ws_ptr, M, N, SEG_K, steps,
                            stride_am, stride_ak, stride_bk, stride_bn,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, A_TRANS: tl.constexpr,
                            B_TRANS: tl.constexpr, USE_TMA: tl.constexpr, SPLIT: tl.constexpr, GROUP_M: tl.constexpr):
    """Program (tile, s): segment s's partial of one output tile, reduced from zero in 64-column steps in
    order (what segment_tree computes for it), stored in fp32 to ws[s] [M, N]."""
    s = tl.program_id(1)
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    off_m = pid_m * BM
    off_n = pid_n * BN
    acc = reduce_segment(tl.zeros((BM, BN), dtype=tl.float32), a_src, b_src, off_m, off_n, s * SEG_K,
                         (s + 1) * SEG_K, steps, M, N, stride_am, stride_ak, stride_bk, stride_bn, BM, BN, BK,
                         A_TRANS, B_TRANS, USE_TMA, SPLIT)
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    ptrs = ws_ptr + s.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(ptrs, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def merge_partials_kernel(ws_ptr, c_ptr, bias_ptr, MN, N, stride_cm, P: tl.constexpr, HAS_BIAS: tl.constexpr,
                          OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """out = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)) (the first P), + bias, one rounding:
    merge_segment's tree, element by element."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < MN
    v = tl.load(ws_ptr + idx, mask=mask, other=0.0) + tl.load(ws_ptr + MN + idx, mask=mask, other=0.0)
    if P >= 4:
        v = v + (tl.load(ws_ptr + 2 * MN + idx, mask=mask, other=0.0) +
                 tl.load(ws_ptr + 3 * MN + idx, mask=mask, other=0.0))
    if P == 8:
        hi = (tl.load(ws_ptr + 4 * MN + idx, mask=mask, other=0.0) + tl.load(ws_ptr + 5 * MN + idx, mask=mask, other=0.0)) + \
             (tl.load(ws_ptr + 6 * MN + idx, mask=mask, other=0.0) + tl.load(ws_ptr + 7 * MN + idx, mask=mask, other=0.0))
        v = v + hi
    row = idx // N
    col = idx - row * N
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    out = v.to(tl.bfloat16) if OUT_BF16 else v
    tl.store(c_ptr + row * stride_cm + col, out, mask=mask)


# ---- launcher ------------------------------------------------------------------------------------

# Decode-sized M on a canonical K partition: one program per (output tile, segment) writes the segment's
# fp32 partial, a second kernel merges the P partials by the tree. Per element the same operations as the
# one-kernel tree (each segment from zero in 64-column steps, the same fp32 adds in the same tree, bias,
# one rounding), so the bits do not change; the P-fold more programs fill the SMs when M <= 64 leaves a
# handful of output tiles (a 4096-wide layer at M = 1: 128 programs of 64x32 tiles, each walking all of K).
# Up to 256 rows: H200 `--sweep-mid` (2026-12-02) found the split faster than the one-kernel tree at
# M = 80-256 (geometric mean over the 8B / 0.6B o_proj / down_proj shapes 0.65-0.82 vs 0.47-0.49) and not at 462+.
SPLIT_SEGMENTS_MAX_M = 256


@dataclasses.dataclass(frozen=True)
class SegmentSplitConfig:
    """The launch of the decode-size split (speed only): the partials kernel's tile (BLOCK_M is always 64,
    the wgmma family of every strict GEMM), warps and pipeline depth; the tree kernel's elements per program
    and warps (elementwise: its layout cannot change a bit). A candidate is taken into SEGMENT_SPLIT_TABLE
    only after benchmarks/gpu_linear.py --sweep-small found its output bit-equal to the default's on the H200."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8
    merge_block: int = 1024
    merge_warps: int = 4

    def tile(self) -> GemmConfig:
        return GemmConfig(64, self.block_n, self.num_warps, self.num_stages, group_m=self.group_m)


# (largest M, config), by increasing M: the first entry whose M bound holds. Paste the lines that
# benchmarks/gpu_linear.py --sweep-small prints (only bit-equal candidates are ever printed).
# Chosen by H200 sweeps (2026-12-02, `--sweep-small` and `--sweep-mid`, graph replays, every candidate bit-equal): the
# fastest launch per M band over the 8B and 0.6B o_proj / down_proj shapes; docs/performance.md "Launch tables".
SEGMENT_SPLIT_TABLE: tuple[tuple[int, SegmentSplitConfig], ...] = (
    (32, SegmentSplitConfig(block_n=128, num_warps=4, num_stages=4)),
    (64, SegmentSplitConfig(block_n=64, num_warps=4, num_stages=3)),
    (SPLIT_SEGMENTS_MAX_M, SegmentSplitConfig(block_n=128, num_warps=4, num_stages=4)),
)


def segment_split_config(m: int, fp32: bool = False) -> SegmentSplitConfig:
    """The decode-size split's launch for M rows (M <= SPLIT_SEGMENTS_MAX_M). The table was swept on bf16
    operands; fp32 ones (bf16x3 in registers, twice the shared memory per stage) keep the default launch
    their tests ran with."""
    if fp32:
        return SegmentSplitConfig()
    for max_m, cfg in SEGMENT_SPLIT_TABLE:
        if m <= max_m:
            return cfg
    return SEGMENT_SPLIT_TABLE[-1][1]


def _gemm_split_segments(a, b, out, bias, m, n, k, segments, a_trans, b_trans, s_am, s_ak, s_bk, s_bn, tma,
                         split: SegmentSplitConfig):
    cfg = split.tile()
    seg_k = k // segments
    ws = torch.empty((segments, m, n), dtype=torch.float32, device=a.device)
    if tma:
        a_src = descriptor(a, [BLOCK_K, cfg.block_m] if a_trans else [cfg.block_m, BLOCK_K])
        b_src = descriptor(b, [cfg.block_n, BLOCK_K] if b_trans else [BLOCK_K, cfg.block_n])
    else:
        a_src, b_src = a, b
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    segment_partials_kernel[(tiles, segments)](
        a_src, b_src, ws, m, n, seg_k, triton.cdiv(seg_k, BLOCK_K), s_am, s_ak, s_bk, s_bn,
        BM=cfg.block_m, BN=cfg.block_n, BK=BLOCK_K, A_TRANS=a_trans, B_TRANS=b_trans, USE_TMA=tma,
        SPLIT=split_for(a.dtype), GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    merge_partials_kernel[(triton.cdiv(m * n, split.merge_block),)](
        ws, out, bias if bias is not None else ws, m * n, n, out.stride(0), P=segments, HAS_BIAS=bias is not None,
        OUT_BF16=out.dtype == torch.bfloat16, BLOCK=split.merge_block, num_warps=split.merge_warps)
    return out


# The warp-specialized Gluon kernel (gemm_ws.py) is the default since an H200 `--sweep-ws` (2026-12-02) found it
# bit-equal at every case and 1.0-1.6x faster than the Triton kernel (RLALIGN_TRITON_GEMM_WS=0 turns it off). The
# dispatcher takes it only for the K partition (P > 1) where gemm_ws.supported holds: above SPLIT_SEGMENTS_MAX_M rows
# always, at or below it only where its tiles fill at least WS_DECODE_MIN_FILL of the SMs (the per-segment split
# multiplies the programs by P, the Gluon kernel does not). P = 1 (plain) calls take it only in the forward layout
# (W [N, K]) at WS_PLAIN_ROWS, decode batches, where its tiles fill the SMs in at most WS_PLAIN_MAX_WAVES waves
# (narrow layers on gemm_ws.NARROW_WS, chosen by gemm_ws.launch_for); other P = 1 calls (the dX layout, other M, the
# rows where one of the Triton kernel's DECODE_TILES applies) reach it only through gemm(..., ws=...). The three
# thresholds: H200 `--sweep-ws` on the 8B and 0.6B layers at 128-462 rows (2026-12-02/03); docs/performance.md
# "Launch tables".
WS_DECODE_MIN_FILL = 0.7
WS_PLAIN_ROWS = (65, SPLIT_SEGMENTS_MAX_M)
WS_PLAIN_MAX_WAVES = 4


def ws_default(a, b, b_trans, segments, a_trans, out_dtype, bias, acc_in) -> WsConfig | None:
    """The Gluon kernel's launch when the dispatcher should take it for this call, else None."""
    enabled = envvars.read(WS_ENV)   # default on (rlalign.envvars)
    if not enabled or is_interpreter():
        return None
    m, n = a.shape[0], (b.shape[0] if b_trans else b.shape[1])   # A [M, K]: ws_supported refuses a_trans
    if segments == 1 and not (b_trans and WS_PLAIN_ROWS[0] <= m <= WS_PLAIN_ROWS[1]):
        return None   # (before the support checks: most plain calls, all of training's, end here)
    if decode_tile(m, n, segments, a.dtype == torch.float32, device_sms(a), "bf16" if out_dtype == torch.bfloat16
                   else "fp32") is not None:
        return None   # the Triton kernel's decode tile is the faster
    if not ws_supported(a, b, b_trans, segments, a_trans, out_dtype, bias, acc_in):
        return None
    launch = ws_launch_for(a, n, segments)
    if segments > 1 and m <= SPLIT_SEGMENTS_MAX_M and tile_count(launch, m, n) < WS_DECODE_MIN_FILL * device_sms(a):
        return None   # the per-segment split fills the SMs better
    if segments == 1 and tile_count(launch, m, n) > WS_PLAIN_MAX_WAVES * device_sms(a):
        return None   # many waves of small tiles: the Triton kernel's larger tiles are the faster
    return launch


def _logical(t: torch.Tensor, trans: bool) -> tuple[int, int, int, int]:
    """(rows, cols, row stride, col stride) of the logical matrix stored in t (transposed if trans)."""
    if trans:
        return t.shape[1], t.shape[0], t.stride(1), t.stride(0)
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def _note(role, role_of, kernel, cfg, a, b, out, m, n, k, a_trans, b_trans, segments, acc_in, bias, tma) -> None:
    """One launch into the collecting GEMM census (called only while one collects)."""
    gemm_census.ACTIVE.add(role, role_of, entry="gemm", kernel=kernel, config=repr(cfg), m=m, n=n, k=k,
                           a_trans=a_trans, b_trans=b_trans, a_strides=gemm_census.strides(a),
                           b_strides=gemm_census.strides(b), out_strides=gemm_census.strides(out),
                           dtype=gemm_census.dtype_name(a.dtype), out_dtype=gemm_census.dtype_name(out.dtype),
                           segments=segments, acc_in=acc_in, bias=bias is not None, tma=tma)


def gemm(a: torch.Tensor, b: torch.Tensor, *, a_trans: bool = False, b_trans: bool = False,
         out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
         bias: torch.Tensor | None = None, segments: int = 1, acc_in: bool = False,
         config: GemmConfig | None = None, use_tma: bool | None = None,
         split: SegmentSplitConfig | None = None, ws: WsConfig | None = None,
         role: str = "", role_of: torch.Tensor | None = None) -> torch.Tensor:
    """C[M, N] = A @ B (+ bias) with the numerics of the module docstring.

    a: A [M, K] (or A^T stored [K, M] with ``a_trans``); b: B [K, N] (or B^T stored [N, K] with
    ``b_trans``, the nn.Linear weight layout). a and b share one dtype (bf16, or fp32 -> bf16x3).
    ``out``: an existing [M, N] output (required with ``acc_in``; fp32 then). ``segments`` = P,
    a power of two <= 8 dividing K. ``config`` / ``use_tma`` override the automatic choice (tests and
    benchmarks: every choice gives the same bits; a ``config`` runs the one-kernel tree, never the
    decode-size split into per-segment partials of _gemm_split_segments, whose launch ``split`` replaces
    the table's :func:`segment_split_config` -- and, given, takes the split at any M: benchmarks/gpu_linear.py
    --sweep-mid times it against the one-kernel tree above SPLIT_SEGMENTS_MAX_M). ``ws`` runs the warp-specialized
    Gluon kernel of :mod:`.gemm_ws` (the same bits; raises GemmWsUnsupported where it does not apply); without it
    the dispatcher takes that kernel only where :func:`ws_default` says so. ``role`` / ``role_of`` (what the call
    computes, the weight it belongs to) only label the launch for a collecting :mod:`rlalign.ops.gemm_census`.
    """
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"gemm: operands must share bf16 or fp32, got {a.dtype} and {b.dtype}")
    a, b = aligned(a), aligned(b)
    m, k, s_am, s_ak = _logical(a, a_trans)
    k2, n, s_bk, s_bn = _logical(b, b_trans)
    if k != k2:
        raise ValueError(f"gemm: inner dims differ ({k} vs {k2})")
    if segments not in (1, 2, 4, 8) or k % segments:
        raise ValueError(f"gemm: segments must be 1, 2, 4 or 8 and divide K={k}, got {segments}")
    if acc_in and (segments != 1 or out is None or out.dtype != torch.float32):
        raise ValueError("gemm: acc_in needs segments == 1 and an fp32 out")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or a.dtype, device=a.device)
    if out.shape != (m, n) or out.dtype not in (torch.float32, torch.bfloat16) or out.stride(1) != 1:
        raise ValueError(f"gemm: out must be a row-major [{m}, {n}] fp32/bf16 tensor")
    if m == 0 or n == 0:
        return out
    if k == 0:
        if not acc_in:
            out.zero_()
            if bias is not None:
                out.add_(bias.to(out.dtype))
        return out
    fp32 = a.dtype == torch.float32
    if ws is None and config is None and split is None:
        ws = ws_default(a, b, b_trans, segments, a_trans, out.dtype, bias, acc_in)
    if ws is not None:
        if gemm_census.ACTIVE is not None:
            _note(role, role_of, "kpart_ws_kernel", ws, a, b, out, m, n, k, a_trans, b_trans, segments, acc_in, bias,
                  True)
        return gemm_ws(a, b, b_trans=b_trans, segments=segments, out=out, bias=bias, config=ws, a_trans=a_trans,
                       acc_in=acc_in)
    if segments > 1 and config is None and (m <= SPLIT_SEGMENTS_MAX_M or split is not None):
        seg_k = k // segments
        tma = seg_k % BLOCK_K == 0 and tma_ok(a) and tma_ok(b) and (use_tma is None or use_tma)
        split = split or segment_split_config(m, fp32)
        if gemm_census.ACTIVE is not None:
            _note(role, role_of, "segment_partials_kernel+merge_partials_kernel", split, a, b, out, m, n, k, a_trans,
                  b_trans, segments, acc_in, bias, tma)
        return _gemm_split_segments(a, b, out, bias, m, n, k, segments, a_trans, b_trans, s_am, s_ak, s_bk, s_bn, tma,
                                    split)
    out_mode = "acc_in" if acc_in else ("fp32" if out.dtype == torch.float32 else "bf16")
    cfg = config or pick_config(m, n, segments, fp32, device_sms(a), out_mode)
    seg_k = k // segments
    bk = step_columns(cfg, k, segments, fp32, acc_in)
    steps = triton.cdiv(seg_k, bk)
    # TMA needs segment boundaries on k-steps (it cannot mask inside the tensor); the choice
    # depends on shapes only, and both paths compute the same sequence of dots.
    tma = (segments == 1 or seg_k % BLOCK_K == 0) and tma_ok(a) and tma_ok(b) and tma_ok(out)
    if use_tma is not None:
        tma = tma and use_tma
    bm, bn = cfg.block_m, cfg.block_n
    if tma:
        a_src = descriptor(a, [bk, bm] if a_trans else [bm, bk])
        b_src = descriptor(b, [bn, bk] if b_trans else [bk, bn])
        c_src = descriptor(out, [bm, bn])
    else:
        a_src, b_src, c_src = a, b, out
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    progs = max(1, min(tiles, cfg.ctas_per_sm * device_sms(a)))
    log2p = segments.bit_length() - 1
    scratch_levels = max(0, log2p - cfg.reg_levels)
    scratch = (torch.empty(progs * 4 * bm * bn, dtype=torch.float32, device=a.device)
               if scratch_levels else out)
    bias_arg = bias if bias is not None else out
    if gemm_census.ACTIVE is not None:
        _note(role, role_of, "segment_stream_kernel" if cfg.stream and segments > 1 else "gemm_kernel", cfg, a, b, out,
              m, n, k, a_trans, b_trans, segments, acc_in, bias, tma)
    if cfg.stream and segments > 1:
        if scratch_levels:
            raise ValueError(f"gemm: {cfg} streams segments with its tree stack in registers only (reg_levels >= {log2p})")
        segment_stream_kernel[(progs,)](
            a_src, b_src, c_src, bias_arg, scratch, m, n, seg_k, steps, progs,
            s_am, s_ak, s_bk, s_bn, out.stride(0), out.stride(1),
            BM=bm, BN=bn, BK=BLOCK_K, P=segments, LOG2P=log2p, REG_LEVELS=cfg.reg_levels,
            A_TRANS=a_trans, B_TRANS=b_trans, USE_TMA=tma, SPLIT=split_for(a.dtype), HAS_BIAS=bias is not None,
            OUT_BF16=out.dtype == torch.bfloat16, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out
    gemm_kernel[(progs,)](
        a_src, b_src, c_src, bias_arg, scratch,
        m, n, k, seg_k, steps, progs,
        s_am, s_ak, s_bk, s_bn, out.stride(0), out.stride(1),
        BM=bm, BN=bn, BK=bk, P=segments, LOG2P=log2p, REG_LEVELS=cfg.reg_levels,
        A_TRANS=a_trans, B_TRANS=b_trans, USE_TMA=tma, SPLIT=split_for(a.dtype), HAS_BIAS=bias is not None,
        ACC_IN=acc_in, OUT_BF16=out.dtype == torch.bfloat16, GROUP_M=cfg.group_m,
        FLATTEN=cfg.flatten and segments == 1, NESTED=cfg.nested and segments > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def step_columns(cfg: GemmConfig, k: int, segments: int, fp32: bool, acc_in: bool) -> int:
    """Columns per k-step of a launch: ``cfg.block_k`` where the wider step issues exactly BLOCK_K's k16 chunks
    (P = 1, bf16 operands, K a multiple of it: no padding chunk is added), else BLOCK_K (see GemmConfig.block_k)."""
    if cfg.block_k == BLOCK_K or segments != 1 or fp32 or acc_in or k % cfg.block_k:
        return BLOCK_K
    return cfg.block_k


def gemm_blocks(a: torch.Tensor, w: torch.Tensor, widths: tuple[int, ...], *, bias: torch.Tensor | None = None,
                role: str = "fwd", role_of: torch.Tensor | None = None,
                ws: WsConfig | None = None) -> tuple[torch.Tensor, ...] | None:
    """C = A @ W^T (+ bias) for W [sum(widths), K] (the forward layout), returned as its column blocks of
    ``widths`` -- separate row-major tensors -- from ONE launch of the Gluon kernel (q, k and v of a layer whose
    projection weights are stacked rows of one tensor). Each element has :func:`gemm`'s bits (P = 1): the block
    it is stored in does not enter its operations. Taken where the dispatcher would take the Gluon kernel for the
    whole [M, sum(widths)] call (:func:`ws_default`; or the launch ``ws``) and every block but the last ends on one
    of its tile columns; otherwise None and nothing is launched (the caller runs the GEMMs one by one)."""
    a = aligned(a)
    m, k = a.shape
    if k == 0 or m == 0 or w.shape != (sum(widths), k):
        return None
    if ws is None:
        ws = ws_default(a, w, True, 1, False, a.dtype, bias, False)
    # every block but the last a whole number of tile columns; the last's bf16 rows 16-byte multiples (TMA)
    if ws is None or not 1 <= len(widths) <= 3 or any(x % ws.block_n for x in widths[:-1]) or widths[-1] % 8:
        return None
    outs = tuple(torch.empty((m, x), dtype=a.dtype, device=a.device) for x in widths)
    if gemm_census.ACTIVE is not None:
        _note(role, role_of, "kpart_ws_kernel", ws, a, w, outs[0], m, sum(widths), k, False, True, 1, False, bias,
              True)
    gemm_ws(a, w, b_trans=True, segments=1, out=outs, bias=bias, config=ws)
    return outs


__all__ = ["GemmConfig", "gemm", "gemm_blocks", "gemm_kernel", "segment_stream_kernel", "pick_config", "all_configs",
           "DECODE_TILE", "DECODE_TILES", "decode_tile",
           "candidate_configs", "KPART_CANDIDATES",
           "SegmentSplitConfig", "SEGMENT_SPLIT_TABLE", "segment_split_config", "WS_PLAIN_MAX_WAVES",
           "ws_default"]
