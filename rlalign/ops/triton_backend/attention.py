"""Strict attention on the Triton backend: packed varlen (training) and paged KV (rollout).

One forward kernel serves both; a query's arithmetic is the same whichever it is and whatever
else shares its tile, so its output has the same bits in a packed training forward, a one-shot
or chunked prefill and step-by-step decode, for any page size and page layout, and however many
programs a decode step spreads a sequence over:

* Rows. An item is one (sequence, kv head, tile): ``BLOCK_M`` rows, each a (query token, query
  head of the GQA group) pair, token-major, so the ``G = Hq / Hkv`` heads of one kv head share
  every K/V load. Padding rows get position -1 and are never stored.
* Keys are visited in blocks of ``KV_BLOCK`` = 64 ABSOLUTE positions (0..63, 64..127, ...), up to
  the block of the tile's last query, and are cut into SPLITS of ``KV_SPLIT`` =
  ``spec.ATTN_KV_SPLIT`` = 256 absolute positions (4 blocks). Keys past the context (or past a page
  table's end) are loaded as exact zeros.
* Within a split, from a fresh state (m = -inf, l = 0, acc = 0), per block in increasing order
  (fp32, base-2 exponent; c = scale * log2(e)):

      s     = mma(q, k^T) * c                         (the D reduction in the dot's fixed order)
      s     = where(key_pos <= row_pos, s, -inf)
      m'    = max(m, rowmax(s));  m_u = where(sees, m', 0)       sees = row_pos >= block start
      p     = exp2(s - m_u);  alpha = where(sees, exp2(m - m_u), 1)
      l     = l * alpha + rowsum(p)
      acc   = mma(p, v, acc * alpha)                  p rounded to the input dtype (bf16) first
      m     = where(sees, m', m)

  A block a row cannot see leaves its state bit-identical: its scores are all -inf, so p is
  exactly 0 and alpha is selected to exactly 1; x * 1 == x and x + 0 == x in IEEE arithmetic
  (up to the sign of an accumulator entry that is exactly zero, which the final + 0.0 removes).
  Such blocks only come after all the blocks a row sees, so decode (which never visits them)
  and prefill (which does, for the other rows of its tile) give the same bits.
* Split partials (m, l, acc) are merged into the total (M, L, ACC), from (-inf, 0, 0), in split
  order 0, 1, 2, ... (:func:`_merge_split`: M' = max(M, m), L' = fma(l, b, L a), ACC' = fma(acc, b,
  ACC a), a = exp2(M - M'), b = exp2(m - M')); a split a row cannot see leaves its total
  selected. Merging split 0 into the fresh total is exact (a = 0, b = 1), so a row at a position
  below 256 has the bits of the single online softmax (those of this kernel before the splits).
* out = ACC / L + 0.0 (the + 0.0 maps -0.0 to +0.0), rounded once to the input dtype;
  lse2 = M + log2(L) is kept for the backward.

Two launches, the same arithmetic per row: one program per item walks all its splits and merges
them in registers (prefill, training, decode at large batch); or, for decode tiles when the items
are too few to fill the GPU (:func:`use_split_programs`), P programs per item each take splits p,
p + P, ... and write fp32 partials, which :func:`attn_merge_kernel` folds in the same order with
the same function (:func:`_fold_partials`) -- or, with ``DecodeLaunch.fused_merge``, the item's program
that finishes last does (:func:`_merge_if_last`: an arrival counter per item, no second kernel). The
partials round-trip memory exactly, and the merge is elementwise (its layout cannot change a bit).

``mma`` always sees a 64-key block and a tile of >= 64 rows on 4 or 8 warps laid along the rows,
so Hopper issues the same ``wgmma`` shapes per row and ``rowsum`` reduces each row in the same
order (per-thread, then within the 4 lanes that share a row) for prefill and decode tiles alike.

Sliding window and sinks (gpt-oss; the definition is the torch backend's, docs/contract.md): with a window w a row
at pos sees the keys pos - w < kp <= pos and ``sees`` a block or a split when it holds one of them; the blocks stay
on the absolute grid. A tile walks from the first block its first row's window reaches (:func:`_window_walk`: the
blocks before hold no key any row of it sees, so visiting them would change no bit) with the splits' boundaries
and merges where they are. After the last split the head's sink logit joins as one more online-softmax step
(:func:`_fold_sink`), so lse2 is sink-inclusive. Both are constexpr variants (WINDOW, HAS_SINKS) of the
one-program-per-item launch only -- paged calls with either take it whatever the batch -- and compile away
otherwise (the plain kernels' instructions are unchanged). Head widths are padded to a power of two (masked
loads and stores); past 128 padded columns the prefill / training tile and the backward launch are the wide ones
(:func:`prefill_tile`, :func:`backward_launch`: shared memory), a choice of the head widths alone. V's heads may
have a width DV of their own (multi-head latent attention): the accumulator, the split partials, the output, dO
and dV are DV wide (DPV padded columns); with DV == D the kernels address V as K (the instructions of the
one-width kernels). The streamed decode launch takes one width only (paged calls with two take another launch).

Backward (varlen only, deterministic: no atomic adds of values): dQ by a kernel per query tile walking key
blocks in order; dK, dV by a kernel per 64-key block walking the query rows in order. Both
recompute p = exp2(s - lse2) from the merged lse, so the splits do not enter them (with a window, both walk only
the key blocks / query rows the window connects; the sinks' gradient is :func:`sink_grad`). The launch
(:class:`BackwardLaunch`) is a speed choice of ours -- tiles, keys per program, grid order -- but not a
bit-neutral one in general: the training forward's bits are
the contract, the backward's only have to be deterministic (run to run, per sequence) and accurate.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from rlalign.contract import spec
from rlalign.contract.errors import fail
from rlalign.ops import _checks as chk
from rlalign.ops.triton_backend._common import arrival_counters, device_sms, forced_tile, is_interpreter, mma, split_for
from rlalign.reductions import tree_sum

KV_BLOCK = spec.ATTN_KV_BLOCK
KV_SPLIT = spec.ATTN_KV_SPLIT
if KV_SPLIT <= 0 or KV_SPLIT % KV_BLOCK:
    raise ValueError(f"spec.ATTN_KV_SPLIT={KV_SPLIT} must be a positive multiple of ATTN_KV_BLOCK={KV_BLOCK}")
LOG2E = 1.4426950408889634
# (BLOCK_M, num_warps, num_stages): prefill/training and decode tiles. Both lay warps along rows
# only (BLOCK_M >= 16 * warps), which is what makes them interchangeable (docs/design/tile-shapes.md).
PREFILL_TILE = (128, 8, 3)
DECODE_TILE = (64, 4, 3)
BWD_TILE = (64, 4, 2)
DKDV_WARPS = 8


@dataclasses.dataclass(frozen=True)
class BackwardLaunch:
    """How the varlen backward's two kernels are launched. Each dK/dV/dQ element's sum runs
    over the same terms in increasing key (dQ) / query-row (dK, dV) order whatever the launch, but the MMA shapes that
    carry it do not always keep its bits: benchmarks/gpu_attention.py --sweep-train compares every candidate's
    gradients with the default's (bit-equal, or within the float64-reference tolerance, labelled).
    Every launch is deterministic run to run and per sequence (a sequence's gradients do not depend on what
    else is packed with it): no atomic adds, each output element is written by one program.

    ``dq_tile``: (BLOCK_M rows = BLOCK_M / G tokens x the G query heads of a kv head, warps, stages) of
    attn_bwd_dq_kernel; ``dq_keys``: keys per dQ step (a multiple of KV_BLOCK). ``dkdv_keys``: keys per
    attn_bwd_dkdv_kernel program (a multiple of KV_BLOCK), ``dkdv_rows``: query rows per step, ``dkdv_warps``,
    ``dkdv_stages``. ``heavy_first``: both grids run the programs with the most work first over the whole
    batch (otherwise dK/dV runs the light blocks of each sequence and kv head first). A fused one-kernel
    backward (dQ added in key-block order through per-row-block semaphores, 5 products instead of 7) was tried
    (2026-12-02): correct, but 0.39-0.42x SDPA on the H200 (it spilled, and Triton did not pipeline it), so removed
    (docs/performance.md, "What was tried and did not work")."""
    dq_tile: tuple[int, int, int] = BWD_TILE
    dq_keys: int = KV_BLOCK
    dkdv_keys: int = KV_BLOCK
    dkdv_rows: int = BWD_TILE[0]
    dkdv_warps: int = DKDV_WARPS
    dkdv_stages: int = BWD_TILE[2]
    heavy_first: bool = False

    def __post_init__(self):
        bm, warps, stages = self.dq_tile
        pow2 = all(x >= 16 and not x & (x - 1) for x in (bm, self.dkdv_rows, self.dq_keys, self.dkdv_keys))
        if not pow2 or self.dq_keys % KV_BLOCK or self.dkdv_keys % KV_BLOCK or min(warps, stages, self.dkdv_warps,
                                                                                    self.dkdv_stages) < 1:
            raise ValueError(f"BackwardLaunch {self}: tiles must be powers of 2 >= 16, key tiles multiples of "
                             f"{KV_BLOCK}, warps and stages >= 1")


# The backward's launch (benchmarks/gpu_attention.py --sweep-train times candidates; paste a faster one here).
# Chosen by an H200 `--sweep-train` (2026-12-02; benchmarks/evidence/attention-h200/train-sweep.csv): bit-equal to the
# previous default (BackwardLaunch()), forward + backward 0.90-0.99 of SDPA flash against 0.66-0.68; docs/performance.md
# "Launch tables". (sm_90a, benchmarks/attn_bwd_sm90_cpu.py: its dK/dV kernel holds 255 registers and spills 100 B, one
# program per SM; the dQ kernel 181 registers, no spills.)
BWD_LAUNCH = BackwardLaunch(dq_tile=(128, 8, 2), dkdv_keys=128, heavy_first=True)

# Head widths padded past WIDE_HEAD (DP = 256: DeepSeek-V3's 192-wide MLA heads) do not fit an sm_90 block's 227 KiB of
# shared memory on the default prefill tile (3 stages: 256 KiB) or backward launch (256 KiB); these fit (sm_90a
# compiles without a GPU, Triton's ptxas, D = 192 bf16: forward 192 KiB, 960 B spilled; dQ 192 KiB, 8 B; dK/dV 193 KiB,
# 160 B). The forward tile differs from PREFILL_TILE in its pipeline depth only (same rows, warps along rows: the same
# bits per row). Chosen by the head width alone (prefill_tile, backward_launch); not timed on a GPU.
WIDE_HEAD = 128
WIDE_PREFILL_TILE = (128, 8, 2)
WIDE_BWD_LAUNCH = BackwardLaunch(dq_tile=(128, 8, 1), dkdv_keys=64, dkdv_rows=64, dkdv_warps=8, dkdv_stages=2,
                                 heavy_first=True)


def prefill_tile(d: int) -> tuple[int, int, int]:
    """The forward's prefill / training tile for head width d (the wider of K's and V's): PREFILL_TILE, or
    WIDE_PREFILL_TILE past WIDE_HEAD."""
    return WIDE_PREFILL_TILE if _dpad(d) > WIDE_HEAD else PREFILL_TILE


def backward_launch(d: int) -> BackwardLaunch:
    """The backward's launch for head width d (the wider of K's and V's): BWD_LAUNCH, or WIDE_BWD_LAUNCH past
    WIDE_HEAD."""
    return WIDE_BWD_LAUNCH if _dpad(d) > WIDE_HEAD else BWD_LAUNCH


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """How a decode-tile paged call is launched. Speed only: every field keeps the bits (the KV split
    positions, the block order within a split and the merge order are the kernel's, not the launch's).

    ``tile``: (BLOCK_M, warps, stages) of the forward kernel (BLOCK_M >= 16 x warps: warps along rows only,
    docs/design/tile-shapes.md). Split launch only: ``programs_per_sm`` -- each item's splits are spread over enough
    programs for about this many per SM (never more than the splits); ``merge_warps`` / ``merge_unroll`` of
    attn_merge_kernel (elementwise: no layout of it can change a bit); ``fused_merge``: the item's last
    program merges instead of a second kernel, ``fold_rows`` rows at a time, ``merge_unroll`` splits per
    step. ``max_registers``: a per-thread register cap for the forward kernel on ``tile`` (spills move
    values, not arithmetic)."""
    tile: tuple[int, int, int] = DECODE_TILE
    # 4: the decode programs (~250 registers x 128 threads, 80 / 112 KiB of shared memory) fit twice on an SM,
    # and two waves absorb uneven contexts
    programs_per_sm: int = 4
    merge_warps: int = 8
    merge_unroll: int = 4   # splits whose partials the merge (kernel or fused) loads together
    # True: no merge kernel -- the program that finishes an item's last split folds the item's partials
    # (attn_fwd_kernel FUSED_MERGE: the same fold, the same bits; arrival counters: arrival_counters)
    fused_merge: bool = False
    fold_rows: int = 16     # rows the fused merge folds at a time (a power of 2; registers: 4 warps, not 8)
    # a register cap per thread for the forward kernel (ptxas -maxrregcount through Triton's maxnreg; 0: none):
    # 65,536 registers / 128 threads / programs per SM -- 168 fits 3 decode programs on an SM, 128 fits 4
    max_registers: int = 0
    # True: the streamed launch (attn_stream_kernel): programs_per_sm x SMs programs, each walking whole items
    # in one software-pipelined loop; the fields of the split launch are not used
    stream: bool = False

    def __post_init__(self):
        if self.fold_rows < 1 or self.fold_rows & (self.fold_rows - 1) or self.merge_unroll < 1:
            raise ValueError(f"DecodeLaunch: fold_rows={self.fold_rows} must be a power of 2 and merge_unroll="
                             f"{self.merge_unroll} at least 1")
        if self.max_registers and not 24 <= self.max_registers <= 255:
            raise ValueError(f"DecodeLaunch: max_registers={self.max_registers} must be 0 (no cap) or 24..255")


# The two decode launches (benchmarks/gpu_attention.py --sweep-decode times candidates of both as graph replays
# and checks their bits against these; paste a faster candidate it prints here). The split launch folds its
# partials in the item's last program: faster than the merge kernel at batch 8 / 16, 4,096 context (H200
# `--sweep-decode`, 2026-12-02); docs/performance.md "Launch tables".
ITEM_DECODE = DecodeLaunch()
SPLIT_DECODE = DecodeLaunch(merge_unroll=16, fused_merge=True, fold_rows=4)
STREAM_DECODE = DecodeLaunch(programs_per_sm=2, stream=True)
# Decode-tile paged calls with at least STREAM_MIN_ITEMS_PER_SM items per SM (and not the split launch) take the
# streamed launch: 1.037x the per-item launch at ~15 items per SM, raw bits equal (H200 `--sweep-decode`, 2026-12-03;
# docs/performance.md "Launch tables"). From 1 to 4 items per SM the per-item launch stays (not measured there: where
# two programs per SM hold one item each, the streamed launch's range cut at item starts would leave SMs idle).
STREAM_MIN_ITEMS_PER_SM = 4
# the work entries are sized by the block table's width (a capture cannot know the contexts): 544 B per (sequence,
# kv head, 64-key block) at 64-row tiles -- 11 MB for 256 sequences x 8 kv heads x 640 keys, 1.1 GB for 512 at a 32k-key
# table, where the per-item launch (nothing to build) is taken instead
STREAM_WORK_MAX_BYTES = 256 << 20
# Paged calls on the decode tile whose one-program-per-item grid (items = tiles x sequences x kv heads) has at
# most SPLIT_MAX_ITEMS_PER_SM items per SM spread each item's key splits over several programs (the split
# launch), if there are several splits in the block table's width and the fp32 partials stay under
# SPLIT_SCRATCH_MAX_BYTES. Below one item per SM the per-item launch leaves SMs idle while each program walks the
# whole context; from ~4 per SM (two resident per SM, two waves) it is the faster. Set by H200 graph replays of
# benchmarks/gpu_attention.py (2026-12-02, 32/8 heads, 4,096 context; 1: between the measured batches 8 and 64);
# docs/performance.md "Launch tables".
SPLIT_MAX_ITEMS_PER_SM = 1
SPLIT_SCRATCH_MAX_BYTES = 256 << 20


@triton.jit
def _kv_rows(s, kp, k_ok, q_start, bt_ptr, stride_bt, PS: tl.constexpr, PAGED: tl.constexpr):
    """Row index (into the [rows, Hkv, D] view) of key positions kp of sequence s."""
    if PAGED:
        page = tl.load(bt_ptr + s.to(tl.int64) * stride_bt + kp // PS, mask=k_ok, other=0)
        return page.to(tl.int64) * PS + (kp % PS)
    else:
        return (q_start + kp).to(tl.int64)


@triton.jit
def _load_rows(base, rows, head, ok, dcol, stride_row, stride_head, D: tl.constexpr):
    offs = rows[:, None] * stride_row + head * stride_head + dcol[None, :]
    return tl.load(base + offs, mask=ok[:, None] & (dcol[None, :] < D), other=0.0)


@triton.jit
def _tile_rows(cu_q, pos0_ptr, s, h, tile, G: tl.constexpr, BM: tl.constexpr):
    """The rows of one (sequence s, kv head h, tile) item: BM (query token, query head) rows,
    token-major; padding rows get position -1. -> (q_start, n_q, tok, head, row_ok, pos)."""
    q_start = tl.load(cu_q + s)
    n_q = tl.load(cu_q + s + 1) - q_start
    tok, head, row_ok, pos = _row_coords(tl.arange(0, BM), tile, h, n_q, tl.load(pos0_ptr + s), G, BM)
    return q_start, n_q, tok, head, row_ok, pos


@triton.jit
def _row_coords(r, tile, h, n_q, pos0, G: tl.constexpr, BM: tl.constexpr):
    """(tok, head, row_ok, pos) of rows ``r`` (0 <= r < BM) of tile ``tile`` of kv head h."""
    TPT: tl.constexpr = BM // G                       # query tokens per tile
    tok = tile * TPT + r // G
    head = h * G + r % G
    row_ok = (r < TPT * G) & (tok < n_q)
    pos = tl.where(row_ok, pos0 + tok, -1)
    return tok, head, row_ok, pos


@triton.jit
def _dot(a, b, acc, SPLIT: tl.constexpr, ROWWISE: tl.constexpr):
    """acc + a @ b. ROWWISE (the CPU interpreter only): a broadcast product summed over k, whose bits
    for a row depend on that row alone -- the interpreter's tl.dot is a BLAS matmul, which is not
    row invariant, so without this the interpreter could not check the paths' bit equality."""
    if ROWWISE:
        return acc + tl.sum(a[:, :, None] * b[None, :, :], 1)
    else:
        return mma(a, b, acc, SPLIT)


@triton.jit
def _visit_block(j, q, pos, m, l, acc, s, h, q_start, kv_len, K, V, bt_ptr, qk_scale2, dcol, dcolv,
                 stride_kr, stride_kh, stride_vr, stride_vh, stride_bt, D: tl.constexpr, DV: tl.constexpr,
                 BN: tl.constexpr, PS: tl.constexpr, PAGED: tl.constexpr, SPLIT: tl.constexpr, ROWWISE: tl.constexpr,
                 window=0, WINDOW: tl.constexpr = False):
    """One step of the online softmax: key block j (absolute positions j*BN .. j*BN+BN-1)."""
    kp = j * BN + tl.arange(0, BN)
    k_ok = kp < kv_len
    kv_rows = _kv_rows(s, kp, k_ok, q_start, bt_ptr, stride_bt, PS, PAGED)
    return _visit_rows(j, q, pos, m, l, acc, kv_rows, k_ok, h, K, V, qk_scale2, dcol, dcolv, stride_kr, stride_kh,
                       stride_vr, stride_vh, D, DV, BN, SPLIT, ROWWISE, window, WINDOW)


@triton.jit
def _in_window(kp, pos, window):
    """[rows, keys]: key position kp[j] is inside the sliding window of the row at pos[i] from below
    (pos - window < kp; the causal bound kp <= pos is the caller's)."""
    return kp[None, :] > pos[:, None] - window


@triton.jit
def _window_sees(pos, first, last, window):
    """Rows at ``pos`` whose window (pos - window, pos] holds a key of the positions first..last."""
    return (pos >= first) & (pos - window < last)


@triton.jit
def _visit_rows(j, q, pos, m, l, acc, kv_rows, k_ok, h, K, V, qk_scale2, dcol, dcolv, stride_kr, stride_kh,
                stride_vr, stride_vh, D: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                ROWWISE: tl.constexpr, window=0, WINDOW: tl.constexpr = False):
    """_visit_block's step on key block j whose cache rows are ``kv_rows`` (``k_ok``: the keys inside the
    context; the others load as exact zeros and are masked by position). WINDOW: a row at pos sees only the
    keys pos - window < kp <= pos, and ``sees`` the block when it holds one of them (a row that saw no block
    yet, m = -inf, leaves an unseen block as every row does: m_used = 0, p = 0, alpha = 1). K's rows are D
    wide (columns ``dcol``), V's DV (``dcolv``, the accumulator's)."""
    kp = j * BN + tl.arange(0, BN)
    k = _load_rows(K, kv_rows, h, k_ok, dcol, stride_kr, stride_kh, D)
    v = _load_rows(V, kv_rows, h, k_ok, dcolv, stride_vr, stride_vh, DV)
    sc = _dot(q, tl.trans(k), tl.zeros((q.shape[0], BN), tl.float32), SPLIT, ROWWISE) * qk_scale2
    if WINDOW:
        sc = tl.where((kp[None, :] <= pos[:, None]) & _in_window(kp, pos, window), sc, float("-inf"))
        sees = _window_sees(pos, j * BN, j * BN + BN - 1, window)
    else:
        sc = tl.where(kp[None, :] <= pos[:, None], sc, float("-inf"))
        sees = pos >= j * BN
    m_new = tl.maximum(m, tl.max(sc, 1))
    m_used = tl.where(sees, m_new, 0.0)
    p = tl.exp2(sc - m_used[:, None])             # exactly 0 on every column of a row that sees nothing
    alpha = tl.where(sees, tl.exp2(m - m_used), 1.0)
    l = l * alpha + tl.sum(p, 1)                   # l * 1 + 0 == l exactly
    if SPLIT:
        acc = _dot(p, v, acc * alpha[:, None], SPLIT, ROWWISE)
    else:
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], SPLIT, ROWWISE)   # acc * 1 + 0-products == acc
    m = tl.where(sees, m_new, m)
    return m, l, acc


@triton.jit
def _fresh_state(BM: tl.constexpr, DP: tl.constexpr):
    """(m, l, acc) of a split and (M, L, ACC) of the merged total, fresh: (-inf, 0, 0) each."""
    m = tl.full((BM,), float("-inf"), tl.float32)
    acc = tl.zeros((BM, DP), tl.float32)
    return m, tl.zeros((BM,), tl.float32), acc, m, tl.zeros((BM,), tl.float32), acc


@triton.jit
def _merge_split(M, L, ACC, m, l, acc, sees):
    """Fold one key split's partial (m, l, acc), computed from a fresh state, into the running total
    (M, L, ACC) of the rows that see the split (the others keep their total, selected):

        M' = max(M, m);  a = exp2(M - M');  b = exp2(m - M')
        L' = fma(l, b, L * a);  ACC' = fma(acc, b, ACC * a)

    The fma is explicit so that no compiler can contract the two products differently in the
    forward kernel and in the merge kernel. From the fresh total (M = -inf, L = 0, ACC = 0) the first
    split gives a = 0, b = 1 and (M', L', ACC') = (m, l, acc) exactly (up to the sign of an exactly-zero
    accumulator entry), so a row that sees one split has the bits of the single online softmax."""
    m_tot = tl.maximum(M, m)
    m_used = tl.where(sees, m_tot, 0.0)
    a = tl.exp2(M - m_used)
    b = tl.exp2(m - m_used)
    L_new = tl.fma(l, b, L * a)
    ACC_new = tl.fma(acc, b[:, None], ACC * a[:, None])
    return (tl.where(sees, m_tot, M), tl.where(sees, L_new, L), tl.where(sees[:, None], ACC_new, ACC))


@triton.jit
def _partial_offsets(sp, part_rows, row, dcol):
    """Offsets of split sp's entries for rows ``row`` (token * Hq + head) in the [n_splits, T * Hq]
    statistics and the [n_splits, T * Hq, DP] accumulators (int64: the scratch can pass 2**31 elements)."""
    stat = row + sp * part_rows      # row is int64; sp * part_rows < 2**31 (_forward refuses larger partials)
    return stat, stat[:, None] * dcol.shape[0] + dcol[None, :]


@triton.jit
def _store_partial(PM, PL, PACC, sp, part_rows, row, row_ok, m, l, acc, dcol, D: tl.constexpr):
    stat, offs = _partial_offsets(sp, part_rows, row, dcol)
    tl.store(PM + stat, m, mask=row_ok)
    tl.store(PL + stat, l, mask=row_ok)
    tl.store(PACC + offs, acc, mask=row_ok[:, None] & (dcol[None, :] < D))


@triton.jit
def _finish(L, ACC):
    """out = ACC / L + 0.0 (the + 0.0 maps -0.0 to +0.0; padding rows, L = 0, are never stored)."""
    return ACC / tl.where(L > 0, L, 1.0)[:, None] + 0.0


# split_progs and part_rows are not specialised (Triton compiles a variant for an int equal to 1 or divisible
# by 16): a decode graph's warm-up call and its capture must use one compiled kernel.
@triton.jit(do_not_specialize=["split_progs", "part_rows", "window"])
def attn_fwd_kernel(Q, K, V, O, LSE, PM, PL, PACC, ARRIVED, cu_q, pos0_ptr, kvlen_ptr, bt_ptr, qk_scale2,
                    split_progs, part_rows, stride_qt, stride_qh, stride_kr, stride_kh, stride_ot, stride_oh,
                    stride_bt, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, PS: tl.constexpr, PAGED: tl.constexpr, STORE_LSE: tl.constexpr,
                    SPLIT: tl.constexpr, SPLIT_KEYS: tl.constexpr, PARTIAL: tl.constexpr, ROWWISE: tl.constexpr,
                    FUSED_MERGE: tl.constexpr = False, FOLD_ROWS: tl.constexpr = 16, UNROLL: tl.constexpr = 4,
                    SINKS=None, window=0, WINDOW: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
                    stride_vr=0, stride_vh=0, DV: tl.constexpr = 0, DPV: tl.constexpr = 0):
    """PARTIAL=False: one program per (tile, sequence, kv head) walks every key split of its rows and
    merges them in order (output, lse). PARTIAL=True: ``split_progs`` = P programs per (tile, sequence,
    kv head); program p walks splits p, p + P, p + 2P, ... of its rows (each from a fresh state) and
    writes each split's fp32 partial (m, l, acc) to PM/PL/PACC [splits, T * Hq (, DP)];
    attn_merge_kernel folds them with the same _fold_partials, or (FUSED_MERGE) the item's last program to
    finish does, FOLD_ROWS rows at a time (:func:`_merge_if_last`; ARRIVED: the item's arrival counters,
    zero at launch and left zero). The grid does not depend on the contexts (a decode graph's capture bounds
    them only by the table width), the work does.

    WINDOW / HAS_SINKS (the one-program-per-item launch only, PARTIAL=False): :func:`_window_walk` and
    :func:`_fold_sink`; both compile away when False. Q and K rows are D wide (DP padded columns), V rows, the
    accumulator, the partials and O's rows DV wide (DPV): the launcher passes DV = D for equal widths."""
    TPT: tl.constexpr = BM // G
    BPS: tl.constexpr = SPLIT_KEYS // BN               # key blocks per split
    if PARTIAL:
        P = split_progs
        sp_first = tl.program_id(0) % P
        tile = tl.num_programs(0) // P - 1 - tl.program_id(0) // P
    else:
        P = 1
        sp_first = 0
        tile = tl.num_programs(0) - 1 - tl.program_id(0)  # latest (longest) tiles first
    s = tl.program_id(1)
    h = tl.program_id(2)
    q_start, n_q, tok, head, row_ok, pos = _tile_rows(cu_q, pos0_ptr, s, h, tile, G, BM)
    if tile * TPT >= n_q:
        return
    last_pos = tl.load(pos0_ptr + s) + tl.minimum(n_q, (tile + 1) * TPT) - 1
    n_blocks = last_pos // BN + 1
    n_sp = (n_blocks + BPS - 1) // BPS                  # splits the tile's rows reach
    if sp_first >= n_sp:
        return
    # this program's blocks, flattened: its splits sp_first, sp_first + P, ... (the last one may be short)
    my_splits = (n_sp - sp_first + P - 1) // P
    n_iter = (my_splits - 1) * BPS + tl.minimum(BPS, n_blocks - (sp_first + (my_splits - 1) * P) * BPS)
    kv_len = tl.load(kvlen_ptr + s)
    dcol = tl.arange(0, DP)
    q_rows = (q_start + tok).to(tl.int64)
    q_offs = q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dcol[None, :]
    q = tl.load(Q + q_offs, mask=row_ok[:, None] & (dcol[None, :] < D), other=0.0)
    hq_total = stride_qt // stride_qh                  # q is [T, Hq, D] contiguous
    part_row = q_rows * hq_total + head
    if DV == D:   # one head width: V addressed as K (the launchers pass contiguous q/k/v, or caches, of one shape)
        dcolv = dcol
        stride_vr = stride_kr
        stride_vh = stride_kh
    else:
        dcolv = tl.arange(0, DPV)

    m, l, acc, M, L, ACC = _fresh_state(BM, DPV)
    if WINDOW:
        tl.static_assert(not PARTIAL, "a sliding window runs the one-program-per-item launch only")
        M, L, ACC = _window_walk(q, pos, m, l, acc, M, L, ACC, s, h, q_start, kv_len, K, V, bt_ptr, qk_scale2, dcol,
                                 dcolv, stride_kr, stride_kh, stride_vr, stride_vh, stride_bt,
                                 tl.load(pos0_ptr + s) + tile * TPT, n_blocks, window, D, DV, BN, PS, PAGED, SPLIT,
                                 ROWWISE, SPLIT_KEYS)
    else:
        for i in range(n_iter):
            sp = sp_first + (i // BPS) * P
            if (i % BPS == 0) & (i > 0):
                # Split sp - P ended: merge (or store) its partial, restart m = -inf, l = 0. Split sp's first
                # block then has alpha = exp2(-inf - m') = 0 for every row that sees it, so acc * alpha restarts
                # acc from 0 inside the MMA's accumulator input; a row that does not see the block sees nothing
                # of the split, and its stale acc is never merged. Resetting acc itself, or merging after the
                # block's MMA, puts non-wgmma instructions on the accumulator while the MMA is in flight (ptxas
                # C7514/C7515: the wgmma pipeline is serialised); here alpha depends on the reset, which keeps
                # this before the P.V MMA is issued.
                if PARTIAL:
                    _store_partial(PM, PL, PACC, sp - P, part_rows, part_row, row_ok, m, l, acc, dcolv, DV)
                else:
                    M, L, ACC = _merge_split(M, L, ACC, m, l, acc, pos >= (sp - P) * SPLIT_KEYS)
                m = tl.full((BM,), float("-inf"), tl.float32)
                l = tl.zeros((BM,), tl.float32)
            m, l, acc = _visit_block(sp * BPS + i % BPS, q, pos, m, l, acc, s, h, q_start, kv_len, K, V, bt_ptr,
                                     qk_scale2, dcol, dcolv, stride_kr, stride_kh, stride_vr, stride_vh, stride_bt,
                                     D, DV, BN, PS, PAGED, SPLIT, ROWWISE)
        sp_last = sp_first + (my_splits - 1) * P
        if PARTIAL:
            _store_partial(PM, PL, PACC, sp_last, part_rows, part_row, row_ok, m, l, acc, dcolv, DV)
            if FUSED_MERGE:
                _merge_if_last(PM, PL, PACC, O, ARRIVED, part_rows, tl.minimum(P, n_sp), n_sp, tile, s, h, q_start,
                               n_q, tl.load(pos0_ptr + s), hq_total, stride_ot, stride_oh, G, DV, DPV, BM, SPLIT_KEYS,
                               FOLD_ROWS, UNROLL)
        else:
            M, L, ACC = _merge_split(M, L, ACC, m, l, acc, pos >= sp_last * SPLIT_KEYS)
    if not PARTIAL:
        if HAS_SINKS:
            M, L, ACC = _fold_sink(M, L, ACC, tl.load(SINKS + head, mask=row_ok, other=0.0) * 1.4426950408889634)
        _store_out(O, q_rows, head, row_ok, _finish(L, ACC), dcolv, stride_ot, stride_oh, DV)
        if STORE_LSE:
            # LSE is [T, Hq] fp32, base 2 (with sinks: sink-inclusive)
            tl.store(LSE + q_rows * hq_total + head, M + tl.log2(tl.where(L > 0, L, 1.0)), mask=row_ok)


@triton.jit
def _window_walk(q, pos, m, l, acc, M, L, ACC, s, h, q_start, kv_len, K, V, bt_ptr, qk_scale2, dcol, dcolv,
                 stride_kr, stride_kh, stride_vr, stride_vh, stride_bt, first_pos, n_blocks, window, D: tl.constexpr,
                 DV: tl.constexpr, BN: tl.constexpr, PS: tl.constexpr, PAGED: tl.constexpr, SPLIT: tl.constexpr,
                 ROWWISE: tl.constexpr, SPLIT_KEYS: tl.constexpr):
    """The sliding-window walk of one item (rows at ``pos``, the first at ``first_pos``) from fresh states
    -> its merged total (M, L, ACC): key blocks from the first one the tile's first row's window reaches
    (the blocks before it hold no key any row of the tile sees: visiting them would leave every row's state
    as it is) to block n_blocks - 1, on the absolute grid, in order, with the split boundaries of the
    windowless walk: a split ends at a multiple of SPLIT_KEYS and is merged (_merge_split) into the rows that
    see a key of it; m and l restart, acc restarts through alpha = 0 at each row's first seen block (a stale
    acc of an earlier split is finite, so acc * 0 is a zero). A row's arithmetic is thus a function of its
    own window: the same bits whatever tile, chunk or launch it is in."""
    BPS: tl.constexpr = SPLIT_KEYS // BN
    first = tl.maximum(first_pos - window + 1, 0) // BN
    for j in range(first, n_blocks):
        if (j % BPS == 0) & (j > first):
            sp = j // BPS - 1
            M, L, ACC = _merge_split(M, L, ACC, m, l, acc,
                                     _window_sees(pos, sp * SPLIT_KEYS, sp * SPLIT_KEYS + SPLIT_KEYS - 1, window))
            m = tl.full(m.shape, float("-inf"), tl.float32)
            l = tl.zeros(l.shape, tl.float32)
        m, l, acc = _visit_block(j, q, pos, m, l, acc, s, h, q_start, kv_len, K, V, bt_ptr, qk_scale2, dcol, dcolv,
                                 stride_kr, stride_kh, stride_vr, stride_vh, stride_bt, D, DV, BN, PS, PAGED, SPLIT,
                                 ROWWISE, window, True)
    sp = (n_blocks - 1) // BPS
    return _merge_split(M, L, ACC, m, l, acc,
                        _window_sees(pos, sp * SPLIT_KEYS, sp * SPLIT_KEYS + SPLIT_KEYS - 1, window))


@triton.jit
def _fold_sink(M, L, ACC, sink2):
    """The head's sink logit (base 2: sink * log2(e)) folded into the merged total as one more online-softmax
    step of a key whose value is 0 -- the torch formulation's definition: M' = max(M, sink2),
    L' = fma(L, a, exp2(sink2 - M')), ACC' = ACC a, a = exp2(M - M') (the fma explicit, as in _merge_split).
    Every real row has seen its own key, so M and M' are finite; padding rows (M = -inf) get L' = 1."""
    m_f = tl.maximum(M, sink2)
    a = tl.exp2(M - m_f)
    return m_f, tl.fma(L, a, tl.exp2(sink2 - m_f)), ACC * a[:, None]


@triton.jit
def _fold_partials(PM, PL, PACC, part_rows, row, pos, n_sp, dcol, D: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                   UNROLL: tl.constexpr):
    """The total (M, L, ACC) of rows ``row`` (positions ``pos``; -1: padding) from the fresh total folded with
    the stored partials of split 0, 1, ..., n_sp - 1 in order (_merge_split; a row selects the splits it sees,
    n_sp covers the rows' last). The one fold of the split launch: attn_merge_kernel and the fused merge of
    attn_fwd_kernel run it, on any rows of an item (elementwise per row: no layout can change a bit)."""
    M = tl.full(pos.shape, float("-inf"), tl.float32)
    L = tl.zeros(pos.shape, tl.float32)
    ACC = tl.zeros((pos.shape[0], dcol.shape[0]), tl.float32)
    # UNROLL splits per step: their loads do not depend on the fold, so each step issues them together
    # (one memory round trip per UNROLL splits, not per split); a split past a row's last is not seen
    # (masked load, total selected), so the fold is exactly split 0, 1, 2, ... of each row
    for first in range(0, n_sp, UNROLL):
        for u in tl.static_range(UNROLL):
            sp = first + u
            sees = pos >= sp * SPLIT_KEYS             # only these rows' partials of split sp exist
            stat, offs = _partial_offsets(sp, part_rows, row, dcol)
            m = tl.load(PM + stat, mask=sees, other=float("-inf"))
            l = tl.load(PL + stat, mask=sees, other=0.0)
            acc = tl.load(PACC + offs, mask=sees[:, None] & (dcol[None, :] < D), other=0.0)
            M, L, ACC = _merge_split(M, L, ACC, m, l, acc, sees)
    return M, L, ACC


@triton.jit
def _store_out(O, q_rows, head, row_ok, out, dcol, stride_ot, stride_oh, D: tl.constexpr):
    o_offs = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dcol[None, :]
    tl.store(O + o_offs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (dcol[None, :] < D))


@triton.jit
def _merge_if_last(PM, PL, PACC, O, ARRIVED, part_rows, n_progs, n_sp, tile, s, h, q_start, n_q, pos0, hq_total,
                   stride_ot, stride_oh, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
                   SPLIT_KEYS: tl.constexpr, FOLD_ROWS: tl.constexpr, UNROLL: tl.constexpr):
    """The fused merge of the split launch ("the last program does the reduction"): called by each of the
    item's ``n_progs`` programs that stored partials, after its stores. Each arrives on the item's counter;
    the one that arrives last (it sees n_progs - 1 before its own arrival) resets the counter to 0 and
    writes the item's output from every partial with _fold_partials and _finish -- attn_merge_kernel's
    arithmetic on the same stored values, so the same bits -- FOLD_ROWS rows at a time (fewer registers
    than the whole tile; rows are independent) over the rows that hold a query.

    Ordering (the PTX memory model's release / acquire, as in a serial split-K semaphore): the barrier puts
    every thread's partial stores before the arrival, which is one acq_rel atomic at GPU scope -- a release
    of this program's partials, an acquire of those of the programs that arrived before; Triton runs a
    scalar atomic on one thread and hands its result to the others through shared memory behind a barrier,
    so every thread's partial loads follow the acquire. The reset is a plain store: no program of this
    launch touches the counter again, and the next launch is ordered after this one on its stream."""
    TPT: tl.constexpr = BM // G
    counter = ARRIVED + (tile * tl.num_programs(1) + s) * tl.num_programs(2) + h
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == n_progs - 1:
        tl.store(counter, 0)
        dcol = tl.arange(0, DP)
        rows_with_queries = tl.minimum(n_q - tile * TPT, TPT) * G
        for first in range(0, rows_with_queries, FOLD_ROWS):
            tok, head, row_ok, pos = _row_coords(first + tl.arange(0, FOLD_ROWS), tile, h, n_q, pos0, G, BM)
            q_rows = (q_start + tok).to(tl.int64)
            M, L, ACC = _fold_partials(PM, PL, PACC, part_rows, q_rows * hq_total + head, pos, n_sp, dcol, D,
                                       SPLIT_KEYS, UNROLL)
            _store_out(O, q_rows, head, row_ok, _finish(L, ACC), dcol, stride_ot, stride_oh, D)


@triton.jit(do_not_specialize=["part_rows"])
def attn_merge_kernel(PM, PL, PACC, O, cu_q, pos0_ptr, part_rows, stride_ot, stride_oh, hq_total,
                      G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
                      SPLIT_KEYS: tl.constexpr, UNROLL: tl.constexpr):
    """The output of one (tile, sequence, kv head) item from its key splits' partials: the fresh total
    folded with split 0, 1, 2, ... in order (_fold_partials), then _finish -- the arithmetic
    attn_fwd_kernel(PARTIAL=False) does in registers."""
    TPT: tl.constexpr = BM // G
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    q_start, n_q, tok, head, row_ok, pos = _tile_rows(cu_q, pos0_ptr, s, h, tile, G, BM)
    if tile * TPT >= n_q:
        return
    last_pos = tl.load(pos0_ptr + s) + tl.minimum(n_q, (tile + 1) * TPT) - 1
    dcol = tl.arange(0, DP)
    q_rows = (q_start + tok).to(tl.int64)
    M, L, ACC = _fold_partials(PM, PL, PACC, part_rows, q_rows * hq_total + head, pos, last_pos // SPLIT_KEYS + 1,
                               dcol, D, SPLIT_KEYS, UNROLL)
    _store_out(O, q_rows, head, row_ok, _finish(L, ACC), dcol, stride_ot, stride_oh, D)


# ---- the streamed decode launch ----------------------------------------------------------------------------
# A work entry is one (item, key block) step of a decode-tile item (one query tile per sequence): its INFO row
# (STREAM_INFO int32: the fields below), its BM query rows and its BN keys' cache rows, both as row indices of
# the [rows, D] views of q ([T * Hq, D]) and of the caches ([pages * page size * Hkv, D]), -1 where there is
# none (padding rows, keys past the context).
STREAM_INFO = tl.constexpr(8)
F_N_Q, F_POS0, F_BLOCK, F_FLAGS = (tl.constexpr(i) for i in range(4))
FIRST_BLOCK, LAST_BLOCK = tl.constexpr(1), tl.constexpr(2)


@triton.jit
def attn_stream_work_kernel(INFO, Q_ROWS, KV_ROWS, START, cu_q, pos0_ptr, kvlen_ptr, bt_ptr, stride_bt, HKV,
                       TABLE_BLOCKS, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PS: tl.constexpr):
    """The work entries of item tl.program_id(0) = sequence * HKV + kv head: its key blocks 0 .. n - 1 in
    order, at entries START[item] ... (n: the blocks up to its last query's, as attn_fwd_kernel walks them;
    at most the table's, which the op's validation guarantees and the entry buffer is sized for)."""
    item = tl.program_id(0)
    s = item // HKV
    h = item % HKV
    q_start = tl.load(cu_q + s)
    n_q = tl.load(cu_q + s + 1) - q_start
    pos0 = tl.load(pos0_ptr + s)
    kv_len = tl.load(kvlen_ptr + s)
    n_blocks = tl.minimum(tl.where(n_q > 0, (pos0 + n_q - 1) // BN + 1, 0), TABLE_BLOCKS)
    base = tl.load(START + item).to(tl.int64)
    lane = tl.arange(0, STREAM_INFO)
    keys = tl.arange(0, BN)
    tok, head, row_ok, _ = _row_coords(tl.arange(0, BM), 0, h, n_q, pos0, G, BM)
    q_rows = tl.where(row_ok, (q_start + tok) * (HKV * G) + head, -1)
    fixed = tl.where(lane == F_N_Q, n_q, tl.where(lane == F_POS0, pos0, 0))
    for j in range(n_blocks):
        e = base + j
        kp = j * BN + keys
        ok = kp < kv_len
        rows = _kv_rows(s, kp, ok, q_start, bt_ptr, stride_bt, PS, True)
        tl.store(KV_ROWS + e * BN + keys, tl.where(ok, rows * HKV + h, -1).to(tl.int32))
        tl.store(Q_ROWS + e * BM + tl.arange(0, BM), q_rows)
        flags = tl.where(j == 0, FIRST_BLOCK, 0) + tl.where(j == n_blocks - 1, LAST_BLOCK, 0)
        tl.store(INFO + e * STREAM_INFO + lane, tl.where(lane == F_BLOCK, j, tl.where(lane == F_FLAGS, flags, fixed)))


@triton.jit
def _field(info, lane, F: tl.constexpr):
    return tl.sum(tl.where(lane == F, info, 0), 0)


@triton.jit
def attn_stream_kernel(Q, K, V, O, INFO, Q_ROWS, KV_ROWS, BOUNDS, qk_scale2, G: tl.constexpr, D: tl.constexpr,
                       DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                       SPLIT_KEYS: tl.constexpr, ROWWISE: tl.constexpr):
    """Program p walks work entries BOUNDS[p] .. BOUNDS[p + 1] - 1: whole items, each item's key blocks in
    order, in ONE loop, so the software pipeline loads the next item's first blocks while this item's last
    ones compute (one program per item pays its start-up -- metadata, page table, first K/V -- per item).
    The query and cache rows of an entry are data (Q_ROWS, KV_ROWS), loaded two entries ahead like the page
    table in attn_fwd_kernel, so no load address waits on a scalar loaded in the loop. Per row the arithmetic
    of attn_fwd_kernel(PARTIAL=False) on tile 0: a fresh state at the item's first block, _merge_split at
    each split boundary and after the last block, _finish, one store. A new item restarts acc through
    alpha = 0 (m = -inf), as a split does; padding rows keep stale values, never stored. (A non-finite
    accumulator of one item could reach the next one's through acc * 0; the op's output check fails the step
    either way.)"""
    BPS: tl.constexpr = SPLIT_KEYS // BN
    p = tl.program_id(0)
    e_first = tl.load(BOUNDS + p)
    e_end = tl.load(BOUNDS + p + 1)
    dcol = tl.arange(0, DP)
    lane = tl.arange(0, STREAM_INFO)
    keys = tl.arange(0, BN)
    r = tl.arange(0, BM)
    m, l, acc, M, L, ACC = _fresh_state(BM, DP)
    for e in range(e_first, e_end):
        e64 = tl.cast(e, tl.int64)
        info = tl.load(INFO + e64 * STREAM_INFO + lane)
        j = _field(info, lane, F_BLOCK)
        flags = _field(info, lane, F_FLAGS)
        _, _, _, pos = _row_coords(r, 0, 0, _field(info, lane, F_N_Q), _field(info, lane, F_POS0), G, BM)
        q_rows = tl.load(Q_ROWS + e64 * BM + r)          # int32 offsets: use_stream bounds q and the caches
        q = _load_rows(Q, q_rows, 0, q_rows >= 0, dcol, D, 0, D)
        kv_rows = tl.load(KV_ROWS + e64 * BN + keys)
        if (j % BPS == 0) & (j > 0):          # split j // BPS - 1 ended (attn_fwd_kernel's merge, same place)
            M, L, ACC = _merge_split(M, L, ACC, m, l, acc, pos >= (j - BPS) * BN)
            m = tl.full((BM,), float("-inf"), tl.float32)
            l = tl.zeros((BM,), tl.float32)
        if (flags & FIRST_BLOCK) != 0:        # a new item: the fresh state (acc restarts through alpha = 0)
            m, l, acc_unused, M, L, ACC = _fresh_state(BM, DP)
        m, l, acc = _visit_rows(j, q, pos, m, l, acc, kv_rows, kv_rows >= 0, 0, K, V, qk_scale2, dcol, dcol, D, 0, D, 0,
                                D, D, BN, SPLIT, ROWWISE)
        if (flags & LAST_BLOCK) != 0:
            M_end, L_end, ACC_end = _merge_split(M, L, ACC, m, l, acc, pos >= (j // BPS) * SPLIT_KEYS)
            tl.store(O + q_rows[:, None] * D + dcol[None, :], _finish(L_end, ACC_end).to(O.dtype.element_ty),
                     mask=(q_rows >= 0)[:, None] & (dcol[None, :] < D))


@triton.jit
def _bwd_program(GRID_HEAVY_FIRST: tl.constexpr):
    """(work index, s, h) of a backward program. Default grid (work, sequences, kv heads): the work index runs
    backwards from the last one within each (sequence, kv head). GRID_HEAVY_FIRST: grid (kv heads, sequences,
    work), the work index slowest, so the whole batch's index-0 programs start first, then index 1, ..."""
    if GRID_HEAVY_FIRST:
        return tl.program_id(2), tl.program_id(1), tl.program_id(0)
    else:
        return tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1), tl.program_id(2)


@triton.jit(do_not_specialize=["window"])
def attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, cu_q, qk_scale2, scale,
                       stride_qt, stride_qh, stride_kr, stride_kh,
                       G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, SPLIT: tl.constexpr, GRID_HEAVY_FIRST: tl.constexpr = False,
                       window=0, WINDOW: tl.constexpr = False, stride_vr=0, stride_vh=0, stride_dot=0, stride_doh=0,
                       DV: tl.constexpr = 0, DPV: tl.constexpr = 0):
    """dQ of one query tile (BM rows: BM / G tokens x the G query heads of kv head h, token-major):
    dQ = scale * sum over the BN-key blocks the tile reaches, in increasing order, of dS @ K, with
    dS = P * (dO V^T - delta) and P = exp2(Q K^T * c - lse2) recomputed (0 where the key is after the row;
    WINDOW: also where it is at or before pos - window, and the blocks before the tile's first row's window
    are skipped). With sinks, lse2 is the sink-inclusive one, so P is the forward's. V and dO rows are DV wide
    (DPV padded columns, dO's strides stride_dot / stride_doh).
    Work: the tile's last token / BN blocks, so heavy programs are the LATE tiles."""
    TPT: tl.constexpr = BM // G
    wi, s, h = _bwd_program(GRID_HEAVY_FIRST)
    q_start = tl.load(cu_q + s)
    n = tl.load(cu_q + s + 1) - q_start
    if GRID_HEAVY_FIRST:
        tile = tl.cdiv(n, TPT) - 1 - wi      # this sequence's last tile first (work index 0 = heaviest)
        if tile < 0:
            return
    else:
        tile = wi
    if tile * TPT >= n:
        return
    r = tl.arange(0, BM)
    tok = tile * TPT + r // G
    head = h * G + r % G
    row_ok = (r < TPT * G) & (tok < n)
    pos = tl.where(row_ok, tok, -1)
    dcol = tl.arange(0, DP)
    q_rows = (q_start + tok).to(tl.int64)
    offs = q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dcol[None, :]
    msk = row_ok[:, None] & (dcol[None, :] < D)
    q = tl.load(Q + offs, mask=msk, other=0.0)
    if DV == D:   # one head width: dO addressed as Q, V as K (contiguous tensors of one shape)
        dcolv = dcol
        stride_vr = stride_kr
        stride_vh = stride_kh
        do = tl.load(DO + offs, mask=msk, other=0.0)
    else:
        dcolv = tl.arange(0, DPV)
        do = tl.load(DO + q_rows[:, None] * stride_dot + head[:, None] * stride_doh + dcolv[None, :],
                     mask=row_ok[:, None] & (dcolv[None, :] < DV), other=0.0)
    hq_total = stride_qt // stride_qh
    lse2 = tl.load(LSE + q_rows * hq_total + head, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + q_rows * hq_total + head, mask=row_ok, other=0.0)
    dq = tl.zeros((BM, DP), tl.float32)
    last_pos = tl.minimum(n, (tile + 1) * TPT) - 1
    first_block = 0
    if WINDOW:
        first_block = tl.maximum(tile * TPT - window + 1, 0) // BN
    for j in range(first_block, last_pos // BN + 1):
        kp = j * BN + tl.arange(0, BN)
        k_ok = kp < n
        kv_rows = (q_start + kp).to(tl.int64)
        k = _load_rows(K, kv_rows, h, k_ok, dcol, stride_kr, stride_kh, D)
        v = _load_rows(V, kv_rows, h, k_ok, dcolv, stride_vr, stride_vh, DV)
        sc = mma(q, tl.trans(k), tl.zeros((BM, BN), tl.float32), SPLIT) * qk_scale2
        vis = kp[None, :] <= pos[:, None]
        if WINDOW:
            vis = vis & _in_window(kp, pos, window)
        p = tl.where(vis, tl.exp2(sc - lse2[:, None]), 0.0)
        dp = mma(do, tl.trans(v), tl.zeros((BM, BN), tl.float32), SPLIT)
        ds = p * (dp - delta[:, None])
        if SPLIT:
            dq = mma(ds, k, dq, SPLIT)
        else:
            dq = mma(ds.to(k.dtype), k, dq, SPLIT)
    dq = dq * scale
    tl.store(DQ + offs, dq.to(DQ.dtype.element_ty), mask=msk)


@triton.jit(do_not_specialize=["window"])
def attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DVO, cu_q, qk_scale2, scale,
                         stride_qt, stride_qh, stride_kr, stride_kh,
                         G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BMQ: tl.constexpr,
                         BN: tl.constexpr, SPLIT: tl.constexpr, GRID_HEAVY_FIRST: tl.constexpr = False,
                         window=0, WINDOW: tl.constexpr = False, stride_vr=0, stride_vh=0, stride_dot=0,
                         stride_doh=0, DV: tl.constexpr = 0, DPV: tl.constexpr = 0):
    """dK, dV of one block of BN keys of kv head h: dV = sum P^T dO, dK = scale * sum dS^T Q over the query
    rows (token-major, the G heads of kv head h each) that can see the block, in increasing row order, BMQ
    rows at a time. Work: (tokens - block start) rows, so heavy programs are the EARLY key blocks; the
    default grid runs each (sequence, kv head)'s blocks last-first (light first), GRID_HEAVY_FIRST
    first-first over the whole batch. WINDOW: only the rows whose window reaches the block (row_ok keeps
    masking the sequence's end; the visibility also asks kp > tok - window). V, dV and dO rows are DV wide
    (DPV padded columns; dV is stored with V's strides)."""
    wi, s, h = _bwd_program(GRID_HEAVY_FIRST)
    j = wi
    q_start = tl.load(cu_q + s)
    n = tl.load(cu_q + s + 1) - q_start
    if j * BN >= n:
        return
    kp = j * BN + tl.arange(0, BN)
    k_ok = kp < n
    dcol = tl.arange(0, DP)
    if DV == D:   # one head width: dO addressed as Q, V and dV as K (contiguous tensors of one shape)
        dcolv = dcol
        stride_vr = stride_kr
        stride_vh = stride_kh
    else:
        dcolv = tl.arange(0, DPV)
    kv_rows = (q_start + kp).to(tl.int64)
    k = _load_rows(K, kv_rows, h, k_ok, dcol, stride_kr, stride_kh, D)
    v = _load_rows(V, kv_rows, h, k_ok, dcolv, stride_vr, stride_vh, DV)
    dk = tl.zeros((BN, DP), tl.float32)
    dv = tl.zeros((BN, DPV), tl.float32)
    hq_total = stride_qt // stride_qh
    first_row = j * BN * G
    end_row = n * G
    if WINDOW:   # the last token whose window reaches the block's last key: j * BN + BN - 2 + window
        end_row = tl.minimum(n, j * BN + BN - 1 + window) * G
    for i in range(tl.cdiv(end_row - first_row, BMQ)):
        r = first_row + i * BMQ + tl.arange(0, BMQ)
        tok = r // G
        head = h * G + r % G
        row_ok = r < n * G
        q_rows = (q_start + tok).to(tl.int64)
        offs = q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dcol[None, :]
        msk = row_ok[:, None] & (dcol[None, :] < D)
        q = tl.load(Q + offs, mask=msk, other=0.0)
        if DV == D:
            do = tl.load(DO + offs, mask=msk, other=0.0)
        else:
            do = tl.load(DO + q_rows[:, None] * stride_dot + head[:, None] * stride_doh + dcolv[None, :],
                         mask=row_ok[:, None] & (dcolv[None, :] < DV), other=0.0)
        lse2 = tl.load(LSE + q_rows * hq_total + head, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + q_rows * hq_total + head, mask=row_ok, other=0.0)
        st = mma(k, tl.trans(q), tl.zeros((BN, BMQ), tl.float32), SPLIT) * qk_scale2
        vis = (kp[:, None] <= tok[None, :]) & row_ok[None, :]
        if WINDOW:
            vis = vis & (kp[:, None] > tok[None, :] - window)
        pt = tl.where(vis, tl.exp2(st - lse2[None, :]), 0.0)
        dpt = mma(v, tl.trans(do), tl.zeros((BN, BMQ), tl.float32), SPLIT)
        dst = pt * (dpt - delta[None, :])
        if SPLIT:
            dv = mma(pt, do, dv, SPLIT)
            dk = mma(dst, q, dk, SPLIT)
        else:
            dv = mma(pt.to(do.dtype), do, dv, SPLIT)
            dk = mma(dst.to(q.dtype), q, dk, SPLIT)
    dk = dk * scale
    offs = kv_rows[:, None] * stride_kr + h * stride_kh + dcol[None, :]
    msk = k_ok[:, None] & (dcol[None, :] < D)
    tl.store(DK + offs, dk.to(DK.dtype.element_ty), mask=msk)
    if DV != D:
        offs = kv_rows[:, None] * stride_vr + h * stride_vh + dcolv[None, :]
        msk = k_ok[:, None] & (dcolv[None, :] < DV)
    tl.store(DVO + offs, dv.to(DVO.dtype.element_ty), mask=msk)


# ---- launchers -------------------------------------------------------------------------------------

def _dpad(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _forward(q, k_src, v_src, cu_q, pos0, kv_len, block_table, page_size, scale, paged, tile, store_lse,
             max_q_tokens, max_context=0, split_programs=False, progs_per_item=None, launch=SPLIT_DECODE,
             window=None, sinks=None):
    """Launch the forward. ``split_programs``: about ``launch.programs_per_sm`` x SMs programs share the
    items' key splits (and a merge kernel folds them) instead of one program per item walking every split
    -- the same bits, more programs; ``max_context`` (an upper bound of the contexts) sizes the partials;
    ``progs_per_item`` forces the programs per item (tests). ``window`` / ``sinks`` [Hq]: the kernel's WINDOW
    and HAS_SINKS variants, on the one-program-per-item launch only."""
    t, hq, d = q.shape
    hkv, dv = k_src.shape[-2], v_src.shape[-1]
    g = hq // hkv
    bm, warps, stages = tile
    if g > bm:
        raise fail("attention_paged" if paged else "attention_varlen",
                   f"{g} query heads per kv head exceed the tile of {bm} rows")
    if split_programs and (window is not None or sinks is not None):
        raise fail("attention_paged", "sliding-window / sink attention runs the one-program-per-item launch only")
    out = torch.empty_like(q) if dv == d else q.new_empty((t, hq, dv))
    lse = torch.empty((t, hq), dtype=torch.float32, device=q.device) if store_lse else out
    n_seq = cu_q.shape[0] - 1
    tiles = triton.cdiv(max_q_tokens, bm // g)
    if t == 0 or n_seq == 0 or tiles == 0:
        return out, lse
    bt = block_table if paged else cu_q
    n_splits = triton.cdiv(max_context, KV_SPLIT) if split_programs else 1
    # programs per item: enough for ~programs_per_sm per SM, never more than the splits there can be; then the
    # fewest with the same splits per program (its longest walk): 16 splits on 9 programs -> 8 programs of 2
    # each (batch 8 at 8 kv heads: 512 programs instead of 576, no partial third wave at 2 resident per SM)
    progs = progs_per_item or _even_programs(
        n_splits, triton.cdiv(launch.programs_per_sm * device_sms(q), tiles * n_seq * hkv))
    progs = min(n_splits, progs) if split_programs else 1
    dp, dpv = _dpad(d), _dpad(dv)
    if split_programs:
        if n_splits * t * hq >= 2 ** 31:
            raise fail("attention_paged", f"{n_splits} key splits x {t * hq} rows of partials exceed int32 indexing")
        pm = torch.empty((n_splits, t * hq), dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty((n_splits, t * hq, dpv), dtype=torch.float32, device=q.device)
    else:
        pm = pl = pacc = out   # not read
    fused = split_programs and launch.fused_merge
    arrived = arrival_counters(q.device, tiles * n_seq * hkv) if fused else out   # not read unless fused
    meta = dict(G=g, D=d, DP=dp, BM=bm, num_warps=warps)
    # only a window / sinks pass these (absent, the kernel's defaults: the variant of the plain causal walk)
    extra = {} if window is None else dict(window=int(window), WINDOW=True)
    if sinks is not None:
        extra.update(SINKS=sinks.detach().to(device=q.device, dtype=torch.float32).contiguous(), HAS_SINKS=True)
    attn_fwd_kernel[(tiles * progs, n_seq, hkv)](
        q, k_src, v_src, out, lse, pm, pl, pacc, arrived, cu_q, pos0, kv_len, bt, scale * LOG2E, progs, t * hq,
        q.stride(0), q.stride(1), k_src.stride(-3), k_src.stride(-2), out.stride(0), out.stride(1),
        bt.stride(0) if paged else 0,
        BN=KV_BLOCK, PS=page_size if paged else 1, PAGED=paged, STORE_LSE=store_lse, SPLIT=split_for(q.dtype),
        SPLIT_KEYS=KV_SPLIT, PARTIAL=split_programs, ROWWISE=is_interpreter(), FUSED_MERGE=fused,
        FOLD_ROWS=launch.fold_rows if fused else 16, UNROLL=launch.merge_unroll if fused else 4, num_stages=stages,
        stride_vr=v_src.stride(-3), stride_vh=v_src.stride(-2), DV=dv, DPV=dpv,
        **meta, **_register_cap(launch, tile), **extra)
    if split_programs and not fused:
        # elementwise only (no dot, no row reduction): its layout, hence its warps, cannot change a bit; its
        # rows are the output's (DV wide)
        meta.update(num_warps=launch.merge_warps, D=dv, DP=dpv)
        attn_merge_kernel[(tiles, n_seq, hkv)](pm, pl, pacc, out, cu_q, pos0, t * hq, out.stride(0), out.stride(1),
                                               hq, SPLIT_KEYS=KV_SPLIT, UNROLL=launch.merge_unroll, num_stages=1,
                                               **meta)
    return out, lse


def _register_cap(launch: DecodeLaunch, tile) -> dict:
    """The forward's compile option for ``launch.max_registers``: only on the launch's own (decode) tile --
    never on a prefill or training tile the same call might run with -- and none under the CPU interpreter,
    which compiles nothing."""
    capped = launch.max_registers and tuple(tile) == tuple(launch.tile) and not is_interpreter()
    return {"maxnreg": launch.max_registers} if capped else {}


def _even_programs(n_splits: int, progs: int) -> int:
    """The fewest programs (<= min(progs, n_splits)) that take each item's splits in as few rounds as progs do."""
    n_splits = max(n_splits, 1)
    progs = max(1, min(progs, n_splits))
    return triton.cdiv(n_splits, triton.cdiv(n_splits, progs))


def split_scratch_bytes(t: int, hq: int, d: int, max_context: int) -> int:
    """fp32 bytes of the split partials of a split-program launch: (m, l, acc[DP]) per row and split."""
    return triton.cdiv(max_context, KV_SPLIT) * t * hq * (_dpad(d) + 2) * 4


def decode_items(max_q_tokens: int, n_seq: int, hq: int, hkv: int) -> int:
    """Programs of the one-program-per-item launch on the decode tile: (query tiles) x sequences x kv heads."""
    return triton.cdiv(max_q_tokens, max(DECODE_TILE[0] // (hq // hkv), 1)) * n_seq * hkv


def use_split_programs(items: int, table_keys: int, scratch_bytes: int, sms: int) -> bool:
    """Whether a decode-tile paged call takes the split launch (speed only: the bits are the same either
    way). A function of the batch's shape alone -- ``items`` (:func:`decode_items`), ``table_keys`` = the
    block table's width x page size (the longest context it can hold), ``scratch_bytes`` for that width
    (:func:`split_scratch_bytes`) and the SMs -- never of the contexts or any tensor's values, so a call and
    its CUDA-graph capture take the same launch. True when the items are at most SPLIT_MAX_ITEMS_PER_SM per SM
    (the per-item grid would leave SMs idle), the table holds more than one key split and the partials fit
    SPLIT_SCRATCH_MAX_BYTES; monotone: more items, or a wider table of several splits, never turn it on."""
    return (items <= SPLIT_MAX_ITEMS_PER_SM * sms and table_keys > KV_SPLIT
            and scratch_bytes <= SPLIT_SCRATCH_MAX_BYTES)


def stream_work_bytes(n_seq: int, hkv: int, table_keys: int, bm: int) -> int:
    """Bytes of a streamed launch's work entries: one per (sequence, kv head, key block of the table's width),
    each an INFO row, BM query rows and KV_BLOCK cache rows (int32)."""
    return n_seq * hkv * triton.cdiv(table_keys, KV_BLOCK) * (STREAM_INFO.value + bm + KV_BLOCK) * 4


def use_stream(items: int, elements: int, sms: int, work_bytes: int = 0) -> bool:
    """Whether a decode-tile paged call that does not take the split launch takes the streamed one (speed
    only: the same bits). A function of the shapes alone, as :func:`use_split_programs`: ``items``
    (:func:`decode_items`) at least STREAM_MIN_ITEMS_PER_SM per SM; ``elements`` -- the most elements of
    q and of a cache -- below 2**31 (the streamed kernel's offsets are int32: fewer registers, no spills);
    the work entries (:func:`stream_work_bytes`, sized by the table's width) within STREAM_WORK_MAX_BYTES."""
    return (items >= STREAM_MIN_ITEMS_PER_SM * sms and elements < 2 ** 31
            and work_bytes <= STREAM_WORK_MAX_BYTES)


def decode_launch(max_q: int, n_seq: int, t: int, hq: int, hkv: int, d: int, table_keys: int, elements: int, sms: int,
                  layout_ok: bool = True, tile_rows: int = DECODE_TILE[0]) -> str:
    """The launch a paged call takes: "split" (:func:`use_split_programs`), "stream" (:func:`use_stream`: one query
    tile of ``tile_rows`` rows per sequence, caches of the streamed layout -- ``layout_ok``, the most ``elements``
    of q and a cache) or "item" (one program per item; every prefill-size call). The one owner of the choice
    (paged_forward, the benchmarks); a function of the shapes alone, so an eager call and its CUDA-graph capture
    take the same launch."""
    rows = max_q * (hq // hkv)
    if rows > DECODE_TILE[0]:
        return "item"
    items = decode_items(max_q, n_seq, hq, hkv)
    if use_split_programs(items, table_keys, split_scratch_bytes(t, hq, d, table_keys), sms):
        return "split"
    if rows <= tile_rows and layout_ok and use_stream(items, elements, sms,
                                                      stream_work_bytes(n_seq, hkv, table_keys, tile_rows)):
        return "stream"
    return "item"


def _stream_work(cu, kv_len, pos0, bt, hkv: int, g: int, page_size: int, bm: int, programs: int):
    """(INFO, Q_ROWS, KV_ROWS, BOUNDS) of a streamed launch: every item's work entries (attn_stream_work_kernel)
    and the programs' entry ranges, cut at item starts so that the programs get about equal numbers of key
    blocks (program p starts at the item start nearest to p / programs of all blocks: non-decreasing in p,
    0 for the first, every block for the last). Device ops only (no host read): a decode graph captures them
    once per step and every layer reads them."""
    n_seq = cu.shape[0] - 1
    table_blocks = triton.cdiv(bt.shape[1] * page_size, KV_BLOCK)
    n_q = cu[1:] - cu[:-1]
    blocks = torch.where(n_q > 0, torch.div(pos0 + n_q - 1, KV_BLOCK, rounding_mode="floor") + 1, 0)
    per_item = blocks.clamp(max=table_blocks)[:, None].expand(n_seq, hkv).reshape(-1)   # item = s * hkv + h
    ends = torch.cumsum(per_item, 0, dtype=torch.int64)
    start = ends - per_item
    total = ends[-1:]
    marks = torch.arange(programs + 1, device=cu.device, dtype=torch.int64) * total // programs
    starts = torch.cat([start, total])
    after = starts[torch.searchsorted(start, marks)]                     # first item start >= mark
    before = starts[(torch.searchsorted(start, marks, right=True) - 1).clamp(min=0)]   # last item start <= mark
    bounds = torch.where(marks - before < after - marks, before, after).to(torch.int32)
    entries = n_seq * hkv * table_blocks
    info = torch.empty((entries, STREAM_INFO.value), dtype=torch.int32, device=cu.device)
    q_rows = torch.empty((entries, bm), dtype=torch.int32, device=cu.device)
    kv_rows = torch.empty((entries, KV_BLOCK), dtype=torch.int32, device=cu.device)
    attn_stream_work_kernel[(n_seq * hkv,)](info, q_rows, kv_rows, start, cu, pos0, kv_len, bt, bt.stride(0), hkv,
                                      table_blocks, G=g, BM=bm, BN=KV_BLOCK, PS=page_size)
    return info, q_rows, kv_rows, bounds


def _stream_forward(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, tile, launch):
    """The streamed launch of a decode-tile paged call (one query tile per sequence; q contiguous)."""
    t, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    n_seq = cu_seqlens_q.shape[0] - 1
    if t == 0 or n_seq == 0:
        return out
    programs = launch.programs_per_sm * device_sms(q)
    bm, warps, stages = tile

    def work():
        cu, kv_len, pos0, bt, _, _ = _paged_meta(block_table, seq_lens, cu_seqlens_q, q.device)
        return _stream_work(cu, kv_len, pos0, bt, hkv, hq // hkv, page_size, bm, programs)
    info, q_rows, kv_rows, bounds = chk.memo("stream_work", work, block_table, seq_lens, cu_seqlens_q,
                                             extra=(q.device, hkv, hq, page_size, bm, programs), capturing=work)
    attn_stream_kernel[(programs,)](
        q, k_cache, v_cache, out, info, q_rows, kv_rows, bounds, scale * LOG2E, G=hq // hkv, D=d, DP=_dpad(d),
        BM=bm, BN=KV_BLOCK, SPLIT=split_for(q.dtype), SPLIT_KEYS=KV_SPLIT, ROWWISE=is_interpreter(),
        num_warps=warps, num_stages=stages, **_register_cap(launch, tile))
    return out


def stream_layout_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The caches' layout the streamed launch addresses: [pages, page size, Hkv, D] with contiguous rows
    (D) and heads, so that (cache row, kv head) is one row index of a [rows * Hkv, D] view."""
    return all(c.stride(-1) == 1 and c.stride(-2) == c.shape[-1] and c.stride(-3) == c.shape[-2] * c.shape[-1]
               for c in (k_cache, v_cache)) and k_cache.stride() == v_cache.stride()


def _seq_info(cu_seqlens: torch.Tensor, device):
    cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    lens = (cu[1:] - cu[:-1])
    return cu, lens


# The index tensors of a batch are the same objects in every layer (and in the backward), so what
# is derived from them -- int32 copies, positions, the longest length, which needs a host sync --
# is computed once per forward (chk.memo: keyed by tensor identity and version).

def _varlen_meta(cu_seqlens, device):
    """(cu int32, lens, zeros, max_len) of a packed batch."""
    def build():
        cu, lens = _seq_info(cu_seqlens, device)
        return cu, lens, torch.zeros_like(lens), int(lens.max()) if lens.numel() else 0
    return chk.memo("varlen_meta", build, cu_seqlens, extra=(device,))


def _paged_meta(block_table, seq_lens, cu_seqlens_q, device):
    """(cu int32, kv_len, pos0 = first query position, block table int32, max queries per sequence,
    longest context). While a CUDA graph is captured the tensors are derived inside the graph (every
    replay), the longest query count is the capture's ``max_query_len`` hint and the longest context
    is bounded by the block table's width (None here: the caller knows the page size)."""
    def tensors():
        cu, n_q = _seq_info(cu_seqlens_q, device)
        kv_len = seq_lens.to(device=device, dtype=torch.int32).contiguous()
        bt = block_table.to(device=device, dtype=torch.int32).contiguous()
        return cu, kv_len, (kv_len - n_q).contiguous(), bt, n_q

    def build():
        cu, kv_len, pos0, bt, n_q = tensors()
        if not n_q.numel():
            return cu, kv_len, pos0, bt, 0, 0
        max_q, max_kv = torch.stack([n_q.max(), kv_len.max()]).tolist()   # one host sync for both
        return cu, kv_len, pos0, bt, max_q, max_kv

    def captured():
        cu, kv_len, pos0, bt, _ = tensors()
        return cu, kv_len, pos0, bt, int(chk.capture_hint("max_query_len")), None
    return chk.memo("paged_meta", build, block_table, seq_lens, cu_seqlens_q, extra=(device,), capturing=captured)


def varlen_forward(q, k, v, cu_seqlens, scale, store_lse=False, tile=None, window=None, sinks=None):
    """``RLALIGN_TRITON_ATTN_TILE="BM,warps,stages"`` forces one tile for prefill and decode alike.
    ``window`` / ``sinks``: as rlalign.ops.attention_varlen (lse then sink-inclusive)."""
    tile = tile or forced_tile("RLALIGN_TRITON_ATTN_TILE") or prefill_tile(max(q.shape[-1], v.shape[-1]))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cu, lens, zeros, max_len = _varlen_meta(cu_seqlens, q.device)
    return _forward(q, k, v, cu, zeros, lens, None, 1, scale, False, tile, store_lse, max_len, window=window,
                    sinks=sinks)


def paged_forward(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, tile=None, split_programs=None,
                  progs_per_item=None, launch=None, stream=None, window=None, sinks=None):
    """``split_programs`` / ``stream``: None picks by the batch's shape (:func:`decode_launch`); True forces the
    split-program launch or the streamed one, False rules it out (tests, benchmarks); ``launch`` replaces that
    launch's DecodeLaunch (benchmarks), ``progs_per_item`` forces how many programs share an item's splits. Every
    choice gives the same bits. ``window`` / ``sinks`` (rlalign.ops.attention_paged): the one-program-per-item
    launch, always (a choice of the arguments alone; the split and streamed launches implement neither)."""
    if window is not None or sinks is not None:
        if split_programs or stream:
            raise fail("attention_paged", "sliding-window / sink attention runs the one-program-per-item launch only "
                                          "(split_programs / stream must not be True)")
        split_programs, stream = False, False
    q = q.contiguous()
    cu, kv_len, pos0, bt, max_q, max_kv = _paged_meta(block_table, seq_lens, cu_seqlens_q, q.device)
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    t, hq, d = q.shape
    table_keys = block_table.shape[1] * page_size
    if max_kv is None:   # captured: every context fits its table
        max_kv = table_keys
    decode_tile = max_q * (hq // hkv) <= DECODE_TILE[0]   # (a GQA group wider than the tile is refused by _forward)
    forced = tile or forced_tile("RLALIGN_TRITON_ATTN_TILE")
    tile_rows = forced[0] if forced else DECODE_TILE[0]
    elements = max(q.numel(), k_cache.numel(), v_cache.numel())
    auto = decode_launch(max_q, cu.shape[0] - 1, t, hq, hkv, d, table_keys, elements, device_sms(q),
                         stream_layout_ok(k_cache, v_cache) and v_cache.shape[-1] == d, tile_rows)
    if split_programs is None:
        split_programs = auto == "split" and not stream
    if stream is None:
        stream = auto == "stream" and not split_programs
    if stream and split_programs:
        raise fail("attention_paged", "stream=True and split_programs=True are two different launches; pick one")
    if stream and max_q * (hq // hkv) > tile_rows:
        raise fail("attention_paged", f"the streamed launch takes one query tile per sequence: {max_q} queries x "
                                      f"{hq // hkv} heads per kv head exceed the tile's rows")
    if stream and elements >= 2 ** 31:
        raise fail("attention_paged", f"the streamed launch indexes q and the caches in int32: {elements} elements "
                                      "in q or a cache are too many for it")
    if stream and v_cache.shape[-1] != d:
        raise fail("attention_paged", f"the streamed launch takes K and V of one head width; got {d} and "
                                      f"{v_cache.shape[-1]}")
    if stream and not stream_layout_ok(k_cache, v_cache):
        raise fail("attention_paged", f"the streamed launch needs caches with contiguous heads and rows; got strides "
                                      f"{tuple(k_cache.stride())} / {tuple(v_cache.stride())}")
    launch = launch or (STREAM_DECODE if stream else SPLIT_DECODE if split_programs else ITEM_DECODE)
    tile = forced or (launch.tile if decode_tile else prefill_tile(max(d, v_cache.shape[-1])))
    if stream:
        return _stream_forward(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, tile, launch)
    out, _ = _forward(q, k_cache, v_cache, cu, pos0, kv_len, bt, page_size, scale, True, tile, False,
                      max_q, max_kv, split_programs, progs_per_item, launch, window, sinks)
    return out


def varlen_backward(q, k, v, out, lse, cu_seqlens, grad_out, scale, tile=None, launch=None, window=None, sinks=None):
    """dq, dk, dv of the packed causal forward (``lse``: its base-2 lse). ``launch`` (default BWD_LAUNCH);
    ``tile`` overrides its dq_tile, dkdv_rows and dkdv_stages (tests). ``window``: the kernels' WINDOW variant.
    With ``sinks`` (``lse`` then sink-inclusive) -> (dq, dk, dv, dsinks): :func:`sink_grad`."""
    launch = launch or backward_launch(max(q.shape[-1], v.shape[-1]))
    if tile is not None:
        launch = dataclasses.replace(launch, dq_tile=tuple(tile), dkdv_rows=tile[0], dkdv_stages=tile[2])
    q, k, v, grad_out = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous()
    t, hq, d = q.shape
    hkv, d_v = k.shape[1], v.shape[-1]
    g = hq // hkv
    cu, _, _, max_len = _varlen_meta(cu_seqlens, q.device)
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()   # [T, Hq]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    grads = (dq, dk, dv) if sinks is None else (dq, dk, dv, sink_grad(sinks, lse, delta))
    if t == 0 or max_len == 0:
        return grads
    bm, warps, stages = launch.dq_tile
    if g > bm or g > launch.dkdv_rows:
        raise fail("attention_varlen", f"{g} query heads per kv head exceed the backward tile of "
                                       f"{min(bm, launch.dkdv_rows)} rows")
    n_seq = cu.shape[0] - 1
    args = (q, k, v, grad_out, lse, delta)
    common = dict(G=g, D=d, DP=_dpad(d), SPLIT=split_for(q.dtype), GRID_HEAVY_FIRST=launch.heavy_first,
                  stride_vr=v.stride(0), stride_vh=v.stride(1), stride_dot=grad_out.stride(0),
                  stride_doh=grad_out.stride(1), DV=d_v, DPV=_dpad(d_v))
    if window is not None:   # absent, the kernels' defaults: the plain causal variants
        common.update(window=int(window), WINDOW=True)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    attn_bwd_dq_kernel[_bwd_grid(triton.cdiv(max_len, bm // g), n_seq, hkv, launch.heavy_first)](
        *args, dq, cu, scale * LOG2E, scale, *strides, BM=bm, BN=launch.dq_keys, num_warps=warps, num_stages=stages,
        **common)
    # no row reductions here: warps may split the columns
    attn_bwd_dkdv_kernel[_bwd_grid(triton.cdiv(max_len, launch.dkdv_keys), n_seq, hkv, launch.heavy_first)](
        *args, dk, dv, cu, scale * LOG2E, scale, *strides, BMQ=launch.dkdv_rows, BN=launch.dkdv_keys,
        num_warps=launch.dkdv_warps, num_stages=launch.dkdv_stages, **common)
    return grads


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [Hq] in sinks' dtype: a sink is a key of value 0 whose probability in row (t, h) is
    p = exp2(sinks[h] log2(e) - lse[t, h]) (``lse``: the sink-inclusive base-2 one), so its score gradient is
    p (0 - delta[t, h]), summed over the tokens by rlalign.reductions.tree_sum (a fixed order: a function of T
    only, as the torch backend's)."""
    if lse.shape[0] == 0:
        return torch.zeros_like(sinks)
    p_sink = torch.exp2(sinks.detach().float().unsqueeze(0) * LOG2E - lse)          # [T, Hq]
    return (-tree_sum((p_sink * delta).t().contiguous())).to(sinks.dtype)


def _bwd_grid(work: int, n_seq: int, hkv: int, heavy_first: bool) -> tuple[int, int, int]:
    """The backward kernels' grid (:func:`_bwd_program`): ``work`` programs per (sequence, kv head)."""
    if heavy_first and work > 65535:
        raise fail("attention_varlen", f"{work} backward programs per sequence exceed the grid's third dimension "
                                       "(65,535) of the heavy-first launch; use BackwardLaunch(heavy_first=False)")
    return (hkv, n_seq, work) if heavy_first else (work, n_seq, hkv)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, window=None, sinks=None):
        out, lse = varlen_forward(q, k, v, cu_seqlens, scale, store_lse=True, window=window, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, sinks)
        ctx.scale, ctx.window = scale, window
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens, sinks = ctx.saved_tensors
        grads = varlen_backward(q, k, v, out, lse, cu_seqlens, grad_out, ctx.scale, window=ctx.window, sinks=sinks)
        return (*grads[:3], None, None, None, grads[3] if sinks is not None else None)


def attention_varlen(q, k, v, cu_seqlens, scale, window=None, sinks=None):
    """Validated inputs (rlalign.ops.attention_varlen); ``window`` / ``sinks`` as there (sinks get a gradient)."""
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    if torch.is_grad_enabled() and any(x.requires_grad for x in leaves):
        return _VarlenAttention.apply(q, k, v, cu_seqlens, float(scale), window, sinks)
    return varlen_forward(q, k, v, cu_seqlens, float(scale), window=window, sinks=sinks)[0]


def attention_paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, window=None, sinks=None):
    """Validated inputs (rlalign.ops.attention_paged). Non-finite K/V inside a context make the
    output non-finite, which is detected here and raised (the cache outside contexts is never read
    into the math)."""
    out = paged_forward(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, float(scale), window=window,
                        sinks=sinks)
    # deferred to the next sync point (chk.flush, called by the logprob ops): no host wait per layer
    chk.finite("attention_paged", "out", out, "k_cache/v_cache contain NaN or inf within a sequence's context "
                                              "(or the scores overflow fp32)")
    return out


__all__ = ["attention_varlen", "attention_paged", "varlen_forward", "paged_forward", "varlen_backward",
           "PREFILL_TILE", "DECODE_TILE", "WIDE_PREFILL_TILE", "WIDE_BWD_LAUNCH", "prefill_tile", "backward_launch", "KV_BLOCK", "DecodeLaunch", "BackwardLaunch", "BWD_LAUNCH",
           "ITEM_DECODE", "SPLIT_DECODE", "STREAM_DECODE",
           "decode_items", "decode_launch", "use_split_programs", "use_stream", "stream_work_bytes",
           "arrival_counters"]
