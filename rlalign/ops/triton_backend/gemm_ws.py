"""The canonical K-partition GEMM as a warp-specialized Gluon kernel for Hopper (sm_90a).

Contract: exactly the bits of :func:`.gemm.gemm` with ``segments = P`` (its module docstring): per output
element C[m, n], each of the P segments of SEG_K = K / P columns is reduced from zero by one fp32 accumulator
that takes the segment's k16 chunks one ``wgmma`` at a time in increasing k (the default kernel's 64-column
k-steps are 4 such chunks; :attr:`WsConfig.block_k` = 32 issues them 2 per k-step: the same chunks in the same
order onto the same accumulator, restarting from zero only at a segment's start; a segment's first chunk
accumulates onto a tile of +0.0, as the default kernel's PTX does: its wgmma always has scale-d = 1 and its
accumulator starts as zeros -- not ``use_acc=False``, which could differ in the sign of a zero sum), the P fp32
partials merge by the fixed tree ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)) (left + right, a subtree as soon as both
halves exist), then ``+ bias[n]`` in fp32 and one rounding to the output dtype (or an fp32 store). The tile
shape only decides which warpgroup computes an element (H200 sweeps of 2026-12-01/02 found 64x64 / 64x128 /
128x128 ``wgmma`` tiles bit-equal); the order of the k16 chunks and where an accumulation restarts from zero are
the same as the default kernel's.

Supported (anything else raises :class:`GemmWsUnsupported` naming the shape; the dispatcher in
:mod:`.gemm` selects this kernel only where :func:`supported` holds): bf16 operands, A [M, K] row-major
(the activations), B either the nn.Linear weight W [N, K] (``b_trans``: the forward, y = x W^T) or a row-major
[K, N] matrix (the trainer's dX = dY @ W, with W [N_out, K_in] as B [K = N_out, N = K_in]); P in {1, 2, 4,
8} with K % (P * 64) == 0; every operand TMA-addressable (16-byte aligned base and row stride); bf16 or fp32
output, optional bias [N].

Design (what the kernel does and why):

* Persistent: grid = min(tiles, SMs); program ``pid`` owns output tiles pid, pid + grid, ... in the default
  kernel's grouped order (GROUP_M row tiles sweep the column tiles together).
* Warp-specialized. A one-warp producer partition streams every k-step of the program's tiles, in order,
  through a ring of STAGES shared-memory stages with TMA (``cp.async.bulk.tensor``), an mbarrier ``ready``
  (expect-tx bytes) and ``empty`` (released by the consumer) per stage. Segments do not exist for the
  producer: with SEG_K a multiple of BK (64 or 32), segment s's step j is the global k-step s * steps + j, so its
  loads run straight across segment ends and tile ends and never wait for a tree merge or an epilogue.
* The consumer is the default partition (4 warps: BM = 64, one warpgroup; 8 warps: BM = 128, two warpgroups, 64
  rows each). Per k-step it issues one async ``wgmma`` chain (BM x BN x BK from shared memory), then
  ``wgmma.wait_group 1`` (the previous k-step's chain is done, the newest stays in flight) and releases the
  previous step's stage (:attr:`WsConfig.release`: "cta", the default, one thread arrives on the stage's
  ``empty`` mbarrier and Triton puts a consumer-wide ``bar.sync`` before it; "thread", every consumer thread
  arrives itself, ``cp.async.mbarrier.arrive.noinc`` on a barrier counting them all, no ``bar.sync``. Either way
  one consumer-wide ``bar.sync`` per k-step stays, before the wait for the stage's operands: Triton's
  shared-memory barrier pass puts one between consecutive mbarrier waits on the ring. sm_90a, P = 8: two per
  k-step with "cta", one with "thread"; registers and shared memory the same). At a segment end it does NOT wait
  for the segment: it issues the next segment's first chain into a FRESH accumulator (a +0.0 tile), then waits
  with one group outstanding, which completes the finished segment while the new one runs, and folds the
  finished partial into the tree while that chain (and the producer's loads) proceed. P is a compile-time
  constant and the segment loop is unrolled (``static_range``), so the default kernel's binary-counter tree
  becomes straight-line code: no branch, no global scratch.
* At a tile's end the consumer waits for the last chain (the only drain: once per tile, P * steps k-steps),
  completes the tree, adds the bias, rounds once and stores through shared memory with a TMA store (which
  clips rows >= M and columns >= N; TMA loads fill out-of-range rows/columns with zeros, so tile padding
  never reaches a stored element). The producer is already loading the next tile meanwhile.
* Where the tree waits (registers per consumer thread: a tile is BN / 2 fp32 for 64 rows per warpgroup).
  Level 0 (a single segment) always in registers. Level 2 (s0+..+s3, held while s4..s7 run) in shared memory,
  or (:attr:`WsConfig.level2_global`, the default's since 2026-12-03) in a per-program global fp32 slot: each
  consumer thread stores its own 64 elements at segment 3's end (8-byte ``st.global``, in flight under segment 4's
  chain) and loads exactly those back at the tile's end, before the tile's drain (their latency runs under the
  last chain). A thread's own store is visible to its own later load in program order, and the accumulator's
  layout gives every element to exactly one thread (no replication: BM = 16 x warps), so no fence or barrier is
  needed; the slot lives in L2 (64 KiB x the grid, allocated per call), laid out by fragment and thread so that a
  warp's 8-byte accesses cover 256 contiguous bytes (:func:`_slot_ptrs`). Freeing level 2's 64 KiB gives 128x128
  tiles a 160 KiB ring (5 stages of 64 columns) beside level 1 at P = 8 -- the depth measured at P = 4
  (:data:`DEEP_RING_WS`).
  Level 2 in shared memory (fp32, exact; each thread reads back the elements it stored): with it in registers the
  128x64 launch (8
  consumer warps + the producer's warpgroup: ptxas caps them at 168 registers) had the new accumulator, the
  finished partial and three levels live and ptxas serialized the wgmma (C7512). Level 1 in registers for
  64-wide tiles; in shared memory too for 64x128 tiles (64 registers a tile; one consumer warpgroup, 255
  registers). sm_90a, P = 8: 128x64/6 stages 168 registers, 64x128/5 stages 255, no spill and no wgmma
  serialization in either; shared memory: :func:`shared_bytes` (+ the mbarriers).
* Registers at 8 consumer warps: ptxas's "168 registers" is the launch's count (12 warps share the register
  file); ``gl.warp_specialize`` emits ``setmaxnreg`` (the default partition raises itself to 240, the producer
  warpgroup drops to 24-40), and the consumer's SASS does use more (128x128: up to R229).
* 128x128 tiles (the default since an H200 sweep of 2026-12-02): two consumer warpgroups of 64x128; level 0 in
  registers (the running accumulator, the finished partial and level 0: 192 of the 240, no spill, no wgmma
  serialization), levels 1 and 2 in shared memory, and ``out_alias``: the output staging tile is level 1's fp32
  buffer reinterpreted (``_reinterpret``, bf16 or fp32 tile), which is free from a tile's last merge until the
  next tile's first level-1 write; that write waits for the previous TMA store's read (``tma.store_wait`` + the
  consumer-wide ``bar.sync`` Triton puts after it). 3 x 32 KiB stages of 64 columns, or 6 x 16 KiB of 32
  (``block_k``), + 2 x 64 KiB levels = 224 KiB. ``out_alias`` also gives the 64x128 tile a sixth stage (208 KiB).
* Not done: two interleaved accumulators (segments 2i and 2i+1 in one loop of two chains per k-step): their
  chains complete together, so each pair end drains the wgmma pipeline anyway, with both partials and the
  stack live at once. Level 2 in a global slot at first spilled (32-64 bytes; its addresses int32 offsets);
  with int64 offsets ptxas folds them and nothing spills. One tree buffer (s0+s1
  waiting in it, overwritten in place by s0+..+s3, s4+s5 in registers: 5 stages of 128x128): built and compiled,
  it spilled (44 bytes forward, 520 and C7512 on the dX layout): s7's k-step loop then carries 3
  tiles (the accumulator, s6, s4+s5), where ptxas fits 3 only in straight-line code (segment ends); with 8
  segments 4 values are live during s7, so 2 of them wait in shared memory whatever the order. Ping-pong
  consumers (two warpgroups on different tiles) not tried.

Status: every candidate in :data:`WS_CANDIDATES` ran on an H200, bit-equal to the Triton kernel at every case of
benchmarks/gpu_linear.py --sweep-ws (2026-12-02 and 2026-12-03); the default is 128x128 with 5 stages of 64 columns,
out_alias and level 2 in a global slot since 2026-12-03 (0.822 of cuBLAS, geometric mean of 6 cases, against 0.777 for
the previous 128x128 launch with 6 stages of 32 columns in the same run: docs/design/kpart-level2-global-slot.md).
tests/cuda/test_cuda_gemm_ws.py compares every candidate's raw bits with the Triton kernel's (the whole CUDA tier, 446
tests, passed on the H200 with this default, 2026-12-03), and benchmarks/gpu_linear.py --sweep-ws refuses any configuration
that is not bit-equal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch
import triton

from rlalign.contract.errors import ContractError
from rlalign.ops.triton_backend._common import BLOCK_K, bind_cuda_context, device_sms, is_interpreter, tma_ok

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    GLUON_IMPORT_ERROR = None
except ImportError as exc:  # pragma: no cover - a Triton without Gluon: the kernel is never selected
    gluon = None
    GLUON_IMPORT_ERROR = exc


class GemmWsUnsupported(ContractError, ValueError):
    """The Gluon K-partition GEMM was asked for a shape / dtype / layout it does not implement."""


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """Launch of the Gluon kernel (speed only: no field changes an element's operations).

    block_m: 64 (4 consumer warps, one warpgroup) or 128 (8 consumer warps, two warpgroups);
    block_n: 64, or 128 with the tree's level 1 in shared memory too (see the module docstring);
    stages: depth of the TMA ring (shared memory: stages * (BM + BN) * 64 * 2 bytes + the output tile);
    producer_regs: registers of the one-warp producer partition (setmaxnreg);
    release: how the consumer frees a ring stage once its wgmma is done. "cta": one thread arrives on the stage's
    ``empty`` mbarrier (count 1) after a consumer-wide ``bar.sync`` that Triton inserts before the arrive;
    "thread": the mbarrier counts every consumer thread (count = 32 * num_warps) and each thread arrives on its own
    right after its ``wgmma.wait_group`` (``cp.async.mbarrier.arrive.noinc``: with no cp.async in flight it
    arrives at once), so no warp waits for the others to free a stage;
    block_k: columns of a ring stage, 64 or 32 (32: one k-step is 2 k16 wgmma instead of 4 and a stage half the
    bytes, so twice the stages fit; the k16 chunks and where a segment restarts from +0.0 are the same);
    out_alias: the output staging tile lives in level 1's fp32 buffer (free at a tile's end) instead of its own;
    level2_global: at P = 8 the tree's level 2 waits in a per-program global fp32 slot, not in shared memory (the
    module docstring); other P have no level 2."""
    block_m: int = 128
    block_n: int = 64
    stages: int = 6
    group_m: int = 8
    producer_regs: int = 40
    release: str = "cta"
    block_k: int = 64
    out_alias: bool = False
    level2_global: bool = False

    @property
    def level1_in_shared(self) -> bool:
        """128-wide tiles keep the tree's level 1 in shared memory too (64 registers a tile: registers hold only
        the running accumulator, the finished partial and level 0)."""
        return self.block_n == 128

    @property
    def problem(self) -> str | None:
        """Why gemm_ws refuses this launch (None: it takes it)."""
        if (self.block_m, self.block_n) not in ((64, 64), (128, 64), (64, 128), (128, 128)):
            return "tiles are 64x64, 128x64, 64x128 or 128x128"
        if self.release not in ("cta", "thread"):
            return "release is 'cta' or 'thread'"
        if self.block_k not in (32, 64):
            return "block_k is 64 or 32"
        if self.out_alias and not self.level1_in_shared:
            return "out_alias needs level 1 in shared memory (block_n 128)"
        return None

    @property
    def num_warps(self) -> int:
        return self.block_m // 16


# DEFAULT_WS: the fastest bit-equal launch of an H200 `--sweep-ws` (2026-12-03; 8B o_proj / down_proj, M 1,024-16,384:
# 0.822 of cuBLAS against 0.777 for SHARED_LEVEL2_WS, the previous default, in the same run); docs/performance.md
# "Launch tables".
SHARED_LEVEL2_WS = WsConfig(block_m=128, block_n=128, stages=6, release="thread", out_alias=True, block_k=32)
DEFAULT_WS = WsConfig(block_m=128, block_n=128, stages=5, release="thread", out_alias=True, block_k=64,
                      level2_global=True)
# benchmarks/gpu_linear.py --sweep-ws times these (the default first; the sweep skips its last cases past its time bound).
# SHARED_LEVEL2_WS (the previous default: level 2 in shared memory, 6 stages of 32 columns); the runners-up of its
# sweep, and a 64-wide tile so that the tree's level 1 in registers stays compiled and tested:
# 64x128 (one consumer warpgroup, levels 1-2 in shared memory; 255 registers, no spill) with out_alias and 6 stages,
# the same with 5 stages and its own output tile (an earlier default), 128x64 x6 (8 consumer warps, level 1 in
# registers). Dropped from the list after the H200 sweeps (the kernel still takes them as a config): 128x128 x3 of
# 64 columns, 128x64 x4 and with release="cta", 64x128 x5 with release="cta" (64x64 x8: back as NARROW_WS).
# Where 128x128 tiles leave SMs idle (fewer tiles than SMs: the rollout's decode batches on narrow layers, e.g. the
# 0.6B shape's N = 1,024 at M = 462: 32 tiles), the 64x128 tile of the same ring depth: twice the programs. Speed
# only (the tile decides which warpgroup computes an element, not its operations). H200, 2026-12-02: the 0.6B decode
# step 12.23 -> 12.66 ms of GPU time with 128x128 everywhere; at the 8B M = 462 (128 tiles) the two within 1.5%.
SMALL_GRID_WS = WsConfig(block_m=64, block_n=128, stages=6, release="thread", out_alias=True)


# For the narrow plain (P = 1) layers at decode rows: 64x64 tiles, 8 stages (H200, 2026-12-02: the 8B k/v_proj, N =
# 1,024, are 32 tiles of 64x128 at 244 rows, 0.59 of cuBLAS; 64 tiles of 64x64: 0.73).
NARROW_WS = WsConfig(block_m=64, block_n=64, stages=8, release="thread")


def tile_count(cfg: WsConfig, m: int, n: int) -> int:
    """Output tiles (= programs' work items) of an [M, N] output on ``cfg``'s tiles."""
    return triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)


def launch_for(a: torch.Tensor, n: int, segments: int) -> WsConfig:
    """Which Gluon launch the dispatcher takes for an [M, K] x [K, N] call (speed only; whether it takes the Gluon
    kernel at all is gemm.ws_default's). K partition (P > 1): DEFAULT_WS unless its tiles would not cover the SMs,
    then SMALL_GRID_WS. Plain (P = 1, taken only at decode rows): SMALL_GRID_WS unless its tiles would fill under a
    third of the SMs, then NARROW_WS."""
    m, sms = a.shape[0], device_sms(a)
    if segments == 1:
        return NARROW_WS if 3 * tile_count(SMALL_GRID_WS, m, n) < sms else SMALL_GRID_WS
    return DEFAULT_WS if tile_count(DEFAULT_WS, m, n) >= sms else SMALL_GRID_WS


# An experiment, not a launch the dispatcher takes: the 160 KiB ring (10 stages of 32 columns, or 5 of 64) that fits
# beside ONE fp32 tree level -- P <= 4 at 128x128 (at P = 8 the second level leaves 96 KiB; these do not fit there).
# benchmarks/gpu_linear.py --sweep-ws --ws-shapes 8b-p4 --ws-deep-ring times them at P = 4 beside DEFAULT_WS. H200,
# 2026-12-03 (benchmarks/evidence/gemm-h200/kpart-p4-ring-sweep.json): 5 x 64 columns 0.88-0.95 of cuBLAS on the 8B
# o_proj / down_proj, 10 x 32 columns 0.64-0.83, SHARED_LEVEL2_WS 0.71-0.84 -- the depth in 64-column stages is what
# P = 8's second level cost. DEFAULT_WS now has the 5 x 64 ring at every P (level 2 in global memory), so at P <= 4
# the second entry here is the default's launch; kept as the sweep's measuring stick for ring depth. sm_90a (CPU
# compile, tests/ops/test_gemm_ws_compile.py): 229,652 / 229,580 B of shared
# memory at P = 4, no spill.
DEEP_RING_WS = (WsConfig(block_m=128, block_n=128, stages=10, release="thread", out_alias=True, block_k=32),
                WsConfig(block_m=128, block_n=128, stages=5, release="thread", out_alias=True, block_k=64))
WS_CANDIDATES = (DEFAULT_WS, SHARED_LEVEL2_WS, SMALL_GRID_WS, WsConfig(block_m=64, block_n=128, stages=5, release="thread"),
                 WsConfig(block_m=128, block_n=64, stages=6, release="thread"), NARROW_WS)


def shared_bytes(cfg: WsConfig, out_dtype: torch.dtype, segments: int) -> int:
    """Shared memory the kernel allocates, barriers excluded: the ring, the output staging tile (none of its own
    with out_alias: it lives in level 1's buffer) and the tree's levels 1 (P >= 4, 128-wide tiles; always with
    out_alias) and 2 (P = 8, unless level2_global puts it in global memory) in fp32; an unused level is a 4-byte
    stand-in."""
    ring = cfg.stages * (cfg.block_m + cfg.block_n) * cfg.block_k * 2
    tile = cfg.block_m * cfg.block_n
    level2 = tile * 4 if segments == 8 and not cfg.level2_global else 4
    level1 = tile * 4 if cfg.out_alias or (cfg.level1_in_shared and segments >= 4) else 4
    out = 0 if cfg.out_alias else tile * (4 if out_dtype == torch.float32 else 2)
    return ring + out + level1 + level2


WS_ENV = "RLALIGN_TRITON_GEMM_WS"


@contextlib.contextmanager
def triton_kernel_only():
    """Inside the block the dispatcher runs the Triton K-partition kernel, not this one (RLALIGN_TRITON_GEMM_WS=0):
    the reference of the bit-equality tests and sweeps."""
    before = os.environ.pop(WS_ENV, None)   # saved to be put back (rlalign.envvars reads it)
    os.environ[WS_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(WS_ENV, None)
        else:
            os.environ[WS_ENV] = before


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def unsupported_reason(a: torch.Tensor, b: torch.Tensor, b_trans: bool, segments: int, a_trans: bool,
                       out_dtype: torch.dtype, bias: torch.Tensor | None, acc_in: bool) -> str | None:
    """Why the Gluon kernel cannot take this call (None: it can)."""
    if GLUON_IMPORT_ERROR is not None:
        return f"this Triton has no Gluon ({GLUON_IMPORT_ERROR})"
    if is_interpreter():
        return "Gluon kernels have no CPU interpreter (TRITON_INTERPRET=1)"
    if _capability(a.device) != (9, 0):
        return f"device {a.device} is not an sm_90 (Hopper) GPU: the kernel is built on Hopper's wgmma and TMA"
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return f"operands {a.dtype} x {b.dtype}: bf16 only (fp32 operands take the Triton kernel)"
    if a_trans:
        return "A stored transposed (the dW GEMM): only A [M, K] row-major"
    if acc_in:
        return "acc_in is not implemented"
    if out_dtype not in (torch.bfloat16, torch.float32):
        return f"output dtype {out_dtype}: bf16 or fp32 only"
    k = a.shape[1]
    if segments not in (1, 2, 4, 8) or k % (segments * BLOCK_K):
        return f"K={k}, P={segments}: needs P in (1, 2, 4, 8) and K % (P * {BLOCK_K}) == 0"
    if not (tma_ok(a) and tma_ok(b)):
        return (f"A {tuple(a.shape)} stride {a.stride()} / B {tuple(b.shape)} stride {b.stride()}: TMA needs "
                "16-byte aligned bases and row strides")
    n = b.shape[0] if b_trans else b.shape[1]
    if (n * (4 if out_dtype == torch.float32 else 2)) % 16:
        return f"N={n}: the output's rows must be 16-byte multiples for its TMA store"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.is_contiguous()):
        return f"bias {tuple(bias.shape)}: needs a contiguous [{n}] vector"
    return None


def supported(a, b, b_trans, segments, a_trans=False, out_dtype=torch.bfloat16, bias=None, acc_in=False) -> bool:
    return unsupported_reason(a, b, b_trans, segments, a_trans, out_dtype, bias, acc_in) is None


if gluon is not None:

    @gluon.jit
    def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
        """gemm.tile_coords' grouped order (which program computes a tile: speed only)."""
        width = GROUP_M * num_pid_n
        first_m = (tile // width) * GROUP_M
        size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % width) % size_m
        pid_n = (tile % width) // size_m
        return pid_m, pid_n

    @gluon.jit
    def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, k_steps,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                  B_TRANS: gl.constexpr, GROUP_M: gl.constexpr):
        """Every k-step of every tile of this program, in the consumer's order, into the ring of stages."""
        pid = gl.program_id(0)
        num_progs = gl.num_programs(0)
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        it = 0
        for tile in range(pid, num_pid_m * num_pid_n, num_progs):
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            for kk in range(k_steps):
                idx = it % STAGES
                # the stage's previous use (it - STAGES) must have been released; a fresh barrier passes
                # the wait for phase 1, so the first lap does not block
                mbarrier.wait(empty.index(idx), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(idx), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [off_m, kk * BK], ready.index(idx), a_bufs.index(idx))
                if B_TRANS:
                    tma.async_copy_global_to_shared(b_desc, [off_n, kk * BK], ready.index(idx), b_bufs.index(idx))
                else:
                    tma.async_copy_global_to_shared(b_desc, [kk * BK, off_n], ready.index(idx), b_bufs.index(idx))
                it += 1

    @gluon.jit
    def _b_operand(b_bufs, idx, B_TRANS: gl.constexpr):
        if B_TRANS:
            return b_bufs.index(idx).permute((1, 0))   # [BN, BK] stored, [BK, BN] read (K-major B)
        else:
            return b_bufs.index(idx)

    @gluon.jit
    def _slot_ptrs(slot, v):
        """Addresses of v's [BM, BN] fp32 elements in a program's level-2 slot, in v's layout (the wgmma accumulator's
        fragment: warp w holds rows 16w..16w+15, lane l rows 16w + l // 4 and + 8, columns 2 (l % 4) + {0, 1} + 8 j).
        Laid out by fragment, then thread, so that a warp's 8-byte access (2 adjacent columns a thread) covers 256
        contiguous bytes; row-major would touch 8 lines. slot + fragment * (2 x threads) + 2 x thread + c % 2, where
        2 x thread + c % 2 = 64 (r // 16) + 8 (r % 8) + c % 8: runs of 8 columns, which Triton sees and vectorizes.
        A bijection onto the slot, so exact whatever the fragment really is (each thread reads back its own stores);
        int64 offsets: with int32 ones ptxas kept the 32 addresses live and spilled."""
        BM: gl.constexpr = v.shape[0]
        BN: gl.constexpr = v.shape[1]
        r = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(1, v.type.layout)).to(gl.int64), 1)
        c = gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(0, v.type.layout)).to(gl.int64), 0)
        fragment = (c // 8) * 2 + (r % 16) // 8
        return slot + (fragment * (BM * 4) + (r // 16) * 64 + (r % 8) * 8 + c % 8)

    @gluon.jit
    def _merge(v, st0, st1, st1_smem, st2, s: gl.constexpr, LOG2P: gl.constexpr, L1_SMEM: gl.constexpr,
               OUT_ALIAS: gl.constexpr, L2_GLOBAL: gl.constexpr, level2=None):
        """gemm.merge_segment's binary-counter tree with a compile-time segment index: segment s's partial v
        is a left child (kept) or a right child (left + right, carried up). After the last segment v is
        ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)) (the first P). Where levels 1 and 2 wait only moves exact fp32
        values; every add is the same."""
        if s % 2 == 0:
            st0 = v
        else:
            v = st0 + v
            if LOG2P > 1:
                # level 1 (a pair's sum) in registers, or with L1_SMEM (128-wide tiles) in shared memory
                if (s // 2) % 2 == 0:
                    if L1_SMEM:
                        if OUT_ALIAS:
                            # the buffer is also the output staging tile: the previous tile's TMA store must have
                            # read it (long done by now: a segment ago)
                            tma.store_wait(0)
                        st1_smem.store(v)
                    else:
                        st1 = v
                else:
                    if L1_SMEM:
                        v = st1_smem.load(v.type.layout) + v
                    else:
                        v = st1 + v
                    if LOG2P > 2:
                        # level 2 (s0+..+s3, held while s4..s7 run) waits in shared memory: in registers it
                        # makes a fifth live tile and ptxas serializes the wgmma at 8 consumer warps (168 regs).
                        # Each thread reads back exactly the elements it stored (one layout): no barrier, exact.
                        if L2_GLOBAL:
                            # level 2 in this program's global fp32 slot (WsConfig.level2_global): each thread
                            # stores its elements and reads back exactly those (its own writes, in program order:
                            # no fence, no barrier), so the 64 KiB go to the ring
                            if (s // 4) % 2 == 0:
                                gl.store(_slot_ptrs(st2, v), v)
                            else:
                                v = level2 + v      # loaded by the consumer before the tile's drain
                        else:
                            if (s // 4) % 2 == 0:
                                st2.store(v)
                            else:
                                v = st2.load(v.type.layout) + v
        return v, st0, st1

    @gluon.jit
    def _issue(a_bufs, b_bufs, ready, it, acc, STAGES: gl.constexpr, B_TRANS: gl.constexpr):
        """Wait for k-step ``it``'s operands and issue its async wgmma chain: acc + A_k B_k (always accumulating,
        scale-d = 1, like the default kernel's; a segment starts from a +0.0 tile)."""
        idx = it % STAGES
        mbarrier.wait(ready.index(idx), (it // STAGES) & 1)
        return warpgroup_mma(a_bufs.index(idx), _b_operand(b_bufs, idx, B_TRANS), acc, use_acc=True,
                             is_async=True)

    @gluon.jit
    def _release(empty_bar, PER_THREAD_RELEASE: gl.constexpr):
        """Free a ring stage whose wgmma this thread has waited for (WsConfig.release). Per thread: every consumer
        thread arrives once (the barrier's count is the consumer's thread count), with no consumer-wide bar.sync
        first; the producer's next TMA into the stage waits for all of them."""
        if PER_THREAD_RELEASE:
            async_copy.mbarrier_arrive(empty_bar, increment_count=False)
        else:
            mbarrier.arrive(empty_bar)

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready, empty, c_desc, c_desc1, c_desc2, c_smem, st1_smem, st2, bias_ptr, M, N,
                  cut1, cut2, steps, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, P: gl.constexpr,
                  LOG2P: gl.constexpr, B_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                  NUM_WARPS: gl.constexpr, L1_SMEM: gl.constexpr, PER_THREAD_RELEASE: gl.constexpr,
                  OUT_ALIAS: gl.constexpr, BLOCKS: gl.constexpr, L2_GLOBAL: gl.constexpr, slot_ptr):
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, BN, 16])
        pid = gl.program_id(0)
        num_progs = gl.num_programs(0)
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        # +0.0 that the compiler cannot fold (M >= 0): with a constant-zero accumulator the wgmma lowering issues
        # the segment's first k16 with scale-d = 0 (D = A B); the default kernel's accumulator is a loop-carried
        # zero tile, so its PTX has scale-d = 1 onto +0.0 registers (D = A B + 0). The two could differ in the
        # sign of a zero sum; with this the instruction stream is the default's.
        opaque_zero = (M < 0).to(gl.float32)
        if L2_GLOBAL:
            st2 = slot_ptr + pid.to(gl.int64) * (BM * BN)   # this program's level-2 slot (only it reads or writes it)
        it = 0
        for tile in range(pid, num_pid_m * num_pid_n, num_progs):
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            # stack levels (written before read by _merge; these stand-ins are never read, so never live)
            st0 = gl.zeros([BM, BN], gl.float32, acc_layout)
            st1 = st0
            prev = st0    # the finished segment's partial (assigned at each segment's end)
            for s in gl.static_range(P):
                # the segment's first k-step accumulates onto a fresh +0.0 tile (the default kernel's zero start)
                acc = _issue(a_bufs, b_bufs, ready, it, gl.zeros([BM, BN], gl.float32, acc_layout) + opaque_zero,
                             STAGES, B_TRANS)
                if s > 0:
                    # one group outstanding: the previous segment's MMAs are complete, the new one runs on
                    prev, acc = warpgroup_mma_wait(1, deps=(prev, acc))
                    _release(empty.index((it - 1) % STAGES), PER_THREAD_RELEASE)
                    v, st0, st1 = _merge(prev, st0, st1, st1_smem, st2, s - 1, LOG2P, L1_SMEM, OUT_ALIAS, L2_GLOBAL)
                else:
                    # nothing else is in flight (the previous tile drained): returns at once; makes acc the
                    # tensor the k-step loop carries
                    acc = warpgroup_mma_wait(1, deps=(acc, ))
                it += 1
                for j in range(1, steps):
                    acc = _issue(a_bufs, b_bufs, ready, it, acc, STAGES, B_TRANS)
                    acc = warpgroup_mma_wait(1, deps=(acc, ))
                    _release(empty.index((it - 1) % STAGES), PER_THREAD_RELEASE)   # k-step it - 1's MMA is done
                    it += 1
                prev = acc
            # L2_GLOBAL: level 2 comes back from the slot before the drain (its latency under the last chain)
            if L2_GLOBAL:
                level2 = gl.load(_slot_ptrs(st2, st0))
            else:
                level2 = st0       # a stand-in, never read
            # the tile's only drain: its last MMA
            prev = warpgroup_mma_wait(0, deps=(prev, ))
            _release(empty.index((it - 1) % STAGES), PER_THREAD_RELEASE)
            v, st0, st1 = _merge(prev, st0, st1, st1_smem, st2, P - 1, LOG2P, L1_SMEM, OUT_ALIAS, L2_GLOBAL, level2)
            _store_tile(v, c_desc, c_desc1, c_desc2, c_smem, bias_ptr, pid_m * BM, pid_n * BN, N, cut1, cut2, BN,
                        HAS_BIAS, BLOCKS, acc_layout)
        tma.store_wait(0)

    @gluon.jit
    def _store_tile(v, c_desc, c_desc1, c_desc2, c_smem, bias_ptr, off_m, off_n, N, cut1, cut2, BN: gl.constexpr,
                    HAS_BIAS: gl.constexpr, BLOCKS: gl.constexpr, acc_layout: gl.constexpr):
        """C tile = v (+ bias[n] in fp32), one rounding to C's dtype, through shared memory and a TMA store. With
        BLOCKS > 1, C's columns [0, cut1), [cut1, cut2), [cut2, N) are three (or, cut2 = N, two) tensors of their
        own (c_desc, c_desc1, c_desc2): the tile goes to the one its columns are in (the cuts are multiples of BN,
        so no tile straddles two)."""
        if HAS_BIAS:
            rn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            bias = gl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(gl.float32)
            v = v + gl.expand_dims(bias, 0)
        tma.store_wait(0)            # the previous tile's store has read c_smem
        c_smem.store(v.to(c_desc.dtype))
        fence_async_shared()
        if BLOCKS == 1:
            tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        else:
            if off_n < cut1:
                tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
            elif off_n < cut2:
                tma.async_copy_shared_to_global(c_desc1, [off_m, off_n - cut1], c_smem)
            else:
                tma.async_copy_shared_to_global(c_desc2, [off_m, off_n - cut2], c_smem)

    @gluon.jit(do_not_specialize=["M", "N", "cut1", "cut2", "steps"])
    def kpart_ws_kernel(a_desc, b_desc, c_desc, c_desc1, c_desc2, bias_ptr, M, N, cut1, cut2, steps,
                        P: gl.constexpr, LOG2P: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr,
                        HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                        L1_SMEM: gl.constexpr, PER_THREAD_RELEASE: gl.constexpr, OUT_ALIAS: gl.constexpr,
                        BLOCKS: gl.constexpr = 1, L2_GLOBAL: gl.constexpr = False, slot_ptr=None):
        """C = A @ B (+ bias) with the canonical K partition (module docstring). steps = SEG_K / BK. BLOCKS > 1: C's
        column blocks are separate tensors (c_desc, c_desc1, c_desc2, split at cut1 and cut2: _store_tile)."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        NUM_WARPS: gl.constexpr = gl.num_warps()
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        # the tree's level-2 subtree (P = 8 only; a 1x1 stand-in otherwise). The swizzled NVMMA layout:
        # gl.bank_conflicts of the accumulator's layout against it 1 (an unswizzled row-major tile: 3)
        ST2_SHAPE: gl.constexpr = [BM, BN] if P == 8 and not L2_GLOBAL else [1, 1]
        st2 = gl.allocate_shared_memory(gl.float32, ST2_SHAPE,
                                        gl.NVMMASharedLayout.get_default_for(ST2_SHAPE, gl.float32))
        ST1_SHAPE: gl.constexpr = [BM, BN] if OUT_ALIAS or (L1_SMEM and P >= 4) else [1, 1]
        st1_smem = gl.allocate_shared_memory(gl.float32, ST1_SHAPE,
                                             gl.NVMMASharedLayout.get_default_for(ST1_SHAPE, gl.float32))
        if OUT_ALIAS:
            # the output staging tile in level 1's buffer (fp32 [BM, BN]: room for a bf16 or fp32 tile). Level 1 is
            # read for the last time before the tile's store; the store's TMA read ends before the next tile's
            # first level-1 write (_merge waits for it)
            c_smem = st1_smem._reinterpret(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        else:
            c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            # per-thread release: every consumer thread arrives (32 per warp); otherwise one thread
            mbarrier.init(empty.index(i), count=32 * NUM_WARPS if PER_THREAD_RELEASE else 1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, c_desc, c_desc1, c_desc2, c_smem, st1_smem, st2, bias_ptr, M,
                         N, cut1, cut2, steps, BM, BN, STAGES, P, LOG2P, B_TRANS, HAS_BIAS, GROUP_M, NUM_WARPS,
                         L1_SMEM, PER_THREAD_RELEASE, OUT_ALIAS, BLOCKS, L2_GLOBAL, slot_ptr)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, steps * P, BM, BN, BK, STAGES, B_TRANS,
                         GROUP_M)),
        ], [1], [PRODUCER_REGS])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float32


def _descriptor(t: torch.Tensor, block: list[int]):
    bind_cuda_context(t)
    layout = gl.NVMMASharedLayout.get_default_for(block, _gl_dtype(t.dtype))
    return GluonDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def gemm_ws(a: torch.Tensor, b: torch.Tensor, *, b_trans: bool, segments: int,
            out: "torch.Tensor | tuple[torch.Tensor, ...]", bias: torch.Tensor | None = None,
            config: WsConfig = DEFAULT_WS, a_trans: bool = False, acc_in: bool = False):
    """out[M, N] = A @ B (+ bias) with :func:`.gemm.gemm`'s bits at ``segments`` = P (module docstring).

    a: A [M, K] bf16 row-major; b: W [N, K] (``b_trans``) or B [K, N]; out: row-major [M, N] bf16/fp32, or a tuple
    of up to 3 row-major [M, N_i] tensors (sum N_i = N, one dtype) that receive C's consecutive column blocks --
    e.g. q, k and v from one launch over their weights stacked as the rows of ``b`` -- where every block but the
    last is a whole number of ``config``'s tile columns (an element's operations do not depend on where it is
    stored). Raises GemmWsUnsupported (naming the shape) for anything the kernel does not implement (``a_trans`` /
    ``acc_in``: gemm's flags, passed on so that such a call is refused, never misread)."""
    blocks = tuple(out) if isinstance(out, (tuple, list)) else (out, )
    why = unsupported_reason(a, b, b_trans, segments, a_trans, blocks[0].dtype, bias, acc_in)
    n = b.shape[0] if b_trans else b.shape[1]
    if why is None:
        why = _blocks_problem(blocks, a.shape[0], n, config)
    if why is None and config.problem is not None:
        why = f"{config}: {config.problem}"
    if why is not None:
        raise GemmWsUnsupported(f"gemm_ws: A {tuple(a.shape)}, B {tuple(b.shape)} (b_trans={b_trans}), "
                                f"P={segments}: {why}")
    m, k = a.shape
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    a_desc = _descriptor(a, [bm, bk])
    b_desc = _descriptor(b, [bn, bk] if b_trans else [bk, bn])
    c_descs = [_descriptor(c, [bm, bn]) for c in blocks]
    cuts = [sum(c.shape[1] for c in blocks[:i + 1]) for i in range(len(blocks) - 1)]
    cut1, cut2 = (cuts + [n, n])[:2]
    c_descs += c_descs[-1:] * (3 - len(c_descs))   # stand-ins for absent blocks (never stored to)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = max(1, min(tiles, device_sms(a)))
    level2_global = config.level2_global and segments == 8
    # one [BM, BN] fp32 level-2 slot per program (level2_global: 64 KiB x SMs at 128x128, L2-resident); otherwise
    # the kernel never touches slot_ptr and an existing tensor stands in (no allocation on the call's path)
    slots = torch.empty(grid * bm * bn, dtype=torch.float32, device=a.device) if level2_global else blocks[0]
    kpart_ws_kernel[(grid,)](
        a_desc, b_desc, *c_descs, bias if bias is not None else blocks[0], m, n, cut1, cut2, k // (segments * bk),
        P=segments, LOG2P=segments.bit_length() - 1, STAGES=config.stages, B_TRANS=b_trans,
        HAS_BIAS=bias is not None, GROUP_M=config.group_m, PRODUCER_REGS=config.producer_regs,
        L1_SMEM=config.level1_in_shared, PER_THREAD_RELEASE=config.release == "thread",
        OUT_ALIAS=config.out_alias, BLOCKS=len(blocks), L2_GLOBAL=level2_global, slot_ptr=slots,
        num_warps=config.num_warps)
    return out


def _blocks_problem(blocks: tuple, m: int, n: int, config: WsConfig) -> str | None:
    """Why the output ``blocks`` cannot receive an [M, N] result on ``config``'s tiles (None: they can)."""
    if not 1 <= len(blocks) <= 3:
        return f"{len(blocks)} output blocks: 1 to 3"
    widths = [c.shape[1] if c.dim() == 2 else -1 for c in blocks]
    if any(c.dim() != 2 or c.shape[0] != m or not tma_ok(c) for c in blocks) or sum(widths) != n:
        shapes = ", ".join(f"{tuple(c.shape)} stride {c.stride()}" for c in blocks)
        return f"out {shapes}: needs TMA-addressable row-major [M, N_i] blocks with sum N_i = N = {n}"
    if len({c.dtype for c in blocks}) > 1:
        return "output blocks of different dtypes"
    if any(w % config.block_n for w in widths[:-1]):
        return (f"output block widths {widths}: each but the last must be a multiple of the tile's {config.block_n} "
                "columns")
    return None


__all__ = ["WsConfig", "DEFAULT_WS", "SMALL_GRID_WS", "NARROW_WS", "DEEP_RING_WS", "tile_count", "launch_for",
           "WS_CANDIDATES", "GemmWsUnsupported", "gemm_ws", "supported", "unsupported_reason", "shared_bytes"]
