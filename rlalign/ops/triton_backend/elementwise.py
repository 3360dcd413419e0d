"""rms_norm, rope and silu_mul on the Triton backend (forward and deterministic backward).

rms_norm (rows of H; with a residual, x = x + residual first, rounded once, in the same kernel): ss = sum of x^2
over the row's BLOCK_H = next_pow2(H) columns (zeros past H) by a fixed pairwise tree (:func:`_row_sum`: level by
level, element j of the next level is element 2j + element 2j + 1 of this one); inv = 1 / sqrt_rn(ss / H + eps)
(IEEE sqrt and division); y = (x * inv) * w in fp32, one rounding.
Backward: dx = inv * (w dy) - x * inv^3 * (sum(x w dy) / H) per row (the same tree); dw = sum over rows of
dy x inv, as per-program partials over fixed row groups summed in program order.

Why a tree and not ``tl.sum``: ``tl.sum`` adds a row in the order of the tile's register layout (each thread's
elements in turn, then across lanes), and Triton derives that layout from how it vectorises the tile's load --
from the divisibility it can prove for the pointer and the strides. Two kernels that load the same row through
different addresses (rms_fwd_kernel reads contiguous rows; rope_write_kv_kernel's fused q/k norm reads column
views whose head offset Triton cannot prove a multiple of 16 at head_dim 16), or one kernel called on differently
aligned tensors, then sum in different orders: fp32 q/k norms one bit apart between the packed and the paged
forward at head_dim 16 (an H100 run caught it). A sum of exactly two values does not depend on their order, so
the tree's bits depend on the values alone, whatever the layout.

rope (rotate-half): y1 = x1 c - x2 s, y2 = x2 c + x1 s in fp32 (cos/sin fp32 tables), one rounding;
backward: dx1 = dy1 c + dy2 s, dx2 = dy2 c - dy1 s. The formula is written once (``_rope_rows``), inlined by
rope_kernel and by rope_write_kv_kernel: the paged forward's per-layer rope of q and k, KV-cache write of the
rotated k and of v, and the flags of its K finiteness check, in one launch (ops.rope_write_kv) -- with Qwen3's
q/k norms first when asked (``_rms_tile``, rms_fwd_kernel's formula on its tile).

silu_mul: y = g / (1 + exp(-g)) * u in fp32, one rounding; backward dg = dy u sig (1 + g (1 - sig)),
du = dy silu(g), sig = 1 / (1 + exp(-g)).

All elementwise: a value's result does not depend on where it sits (the compiled code is the
same for every element; contraction of a*b+c into an fma, if any, is the same everywhere in one kernel).
A formula inlined into two kernels whose results must agree (rope; rms_norm's sum of squares) is compiled without
fma contraction (``no_fma``): two kernels may contract the same expression differently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlalign.ops.triton_backend._common import arrival_counters, is_interpreter

ELEM_BLOCK = 1024


def no_fma() -> dict:
    """Triton's launch option for no a*b+c contraction into an fma anywhere in the kernel (PTX mul.rn / add.rn /
    sub.rn, each rounded once); the interpreter's numpy rounds each operation anyway and takes no such option."""
    return {} if is_interpreter() else {"enable_fp_fusion": False}


def _rows_per_program(block_h: int) -> int:
    return max(1, 4096 // block_h)


@triton.jit
def _row_sum(v):
    """Row sums of the fp32 tile v [ROWS, BH] (BH a power of two) in a fixed pairwise order: while a row has more
    than one element, element j becomes element 2j + element 2j + 1 (a sum of two values, the same bits in either
    order). The order is the tree's, not the register layout's (module docstring)."""
    for _ in tl.static_range(31):   # unrolled at compile time; levels past a width of 1 compile to nothing
        if v.shape[1] > 1:
            v = tl.sum(tl.reshape(v, (v.shape[0], v.shape[1] // 2, 2)), axis=2)
    return tl.reshape(v, (v.shape[0],))


@triton.jit
def _rms_tile(x, W, cols, H, eps):
    """(y, inv) of the rows of the fp32 tile x [ROWS, BH] (columns ``cols``, the first H real, the others 0):
    ss = the pairwise-tree sum of x^2 per row, inv = 1 / sqrt_rn(ss / H + eps), y = (x * inv) * w in fp32 -- the
    one copy of the formula (rms_fwd_kernel and rope_write_kv_kernel's fused q/k norm inline it; both compile
    without fma contraction, so every step is the same rounded operation, and the tree fixes the sum's order)."""
    w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
    ss = _row_sum(x * x)
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(ss, H * 1.0) + eps))
    return (x * inv[:, None]) * w[None, :], inv


@triton.jit
def rms_fwd_kernel(X, W, Y, INV, R, HS, n_rows, H, eps, ROWS: tl.constexpr, BH: tl.constexpr,
                   HAS_RES: tl.constexpr = False):
    """HAS_RES: x is first replaced by h = x + R rounded once to X's dtype (torch's add: an fp32 sum, one
    rounding to nearest even), which is stored to HS (the residual stream)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BH)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < H)
    offs = rows[:, None].to(tl.int64) * H + cols[None, :]
    x = tl.load(X + offs, mask=ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(R + offs, mask=ok, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(HS + offs, x, mask=ok)
    y, inv = _rms_tile(x.to(tl.float32), W, cols, H, eps)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=ok)
    tl.store(INV + rows, inv, mask=rows < n_rows)


@triton.jit
def _normed_rows(X, W, Y, rows, n_rows, HEADS, X_TOK, HALF, eps, BHALF: tl.constexpr):
    """rms_fwd_kernel's rows ``rows`` (token, head) of x [T, HEADS, 2 * HALF] (tokens X_TOK elements apart; its
    tile: the same rows per program, 2 * BHALF columns), rounded to Y's dtype and stored to Y (contiguous); then a
    barrier, so that the program's threads read the normed rows back (the rotation loads halves of them)."""
    cols = tl.arange(0, 2 * BHALF)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < 2 * HALF)
    offs = rows[:, None].to(tl.int64) * (2 * HALF) + cols[None, :]
    src = _strided_rows(rows, HEADS, X_TOK, HALF)[:, None] + cols[None, :]
    y, _ = _rms_tile(tl.load(X + src, mask=ok, other=0.0).to(tl.float32), W, cols, 2 * HALF, eps)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=ok)
    tl.debug_barrier()


@triton.jit
def rms_bwd_kernel(X, W, DY, INV, DX, DWP, n_rows, H, ROWS: tl.constexpr, BH: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BH)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < H)
    offs = rows[:, None].to(tl.int64) * H + cols[None, :]
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
    inv = tl.load(INV + rows, mask=rows < n_rows, other=0.0)
    gw = w[None, :] * dy
    c = tl.math.div_rn(_row_sum(x * gw), H * 1.0)
    dx = inv[:, None] * gw - x * (inv * inv * inv * c)[:, None]
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)
    dw = tl.sum(dy * x * inv[:, None], 0)
    tl.store(DWP + pid.to(tl.int64) * H + cols, dw, mask=cols < H)


@triton.jit
def _strided_rows(rows, HEADS, X_TOK, HALF):
    """int64 offsets of rows (token, head) of x [T, HEADS, 2 * HALF] whose tokens are X_TOK elements apart (heads
    contiguous within a token: a column view of a stacked q/k/v output; X_TOK = HEADS * 2 * HALF when x is
    contiguous)."""
    tok = (rows // HEADS).to(tl.int64)
    return tok * X_TOK + (rows - tok * HEADS) * (2 * HALF)


@triton.jit
def _rope_rows(X, C, S, rows, n_rows, HEADS, X_TOK, HALF, SIGN: tl.constexpr, BHALF: tl.constexpr):
    """The rotation of rows (token, head) of x [T, HEADS, 2*HALF] (tokens X_TOK elements apart), the one copy of
    the formula (rope_kernel and rope_write_kv_kernel inline it, so both compile the same fp32 ops): (y1, y2,
    offsets of the first half in a contiguous [T, HEADS, 2*HALF] output, mask). Only the loads' addresses depend
    on X_TOK."""
    cols = tl.arange(0, BHALF)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < HALF)
    base = rows[:, None].to(tl.int64) * (2 * HALF) + cols[None, :]
    src = _strided_rows(rows, HEADS, X_TOK, HALF)[:, None] + cols[None, :]
    tok = (rows // HEADS).to(tl.int64)
    t_offs = tok[:, None] * HALF + cols[None, :]
    c = tl.load(C + t_offs, mask=ok, other=0.0)
    s = tl.load(S + t_offs, mask=ok, other=0.0) * SIGN
    x1 = tl.load(X + src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(X + src + HALF, mask=ok, other=0.0).to(tl.float32)
    # every product and sum rounded on its own: the launches pass no_fma() (no fma contraction; left to the
    # compiler, ``x1 * c - x2 * s`` was contracted differently in rope_kernel and in rope_write_kv_kernel's k
    # branch: fp32 k differed in the last bit on the H200, 2026-12-02) -- torch's eager bits
    return x1 * c - x2 * s, x2 * c + x1 * s, base, ok


@triton.jit
def rope_kernel(X, C, S, Y, n_rows, HEADS, HALF, SIGN: tl.constexpr, ROWS: tl.constexpr,
                BHALF: tl.constexpr):
    """Rows are (token, head) pairs of x [T, HEADS, 2*HALF]; SIGN=+1 forward, -1 backward (transpose)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    y1, y2, base, ok = _rope_rows(X, C, S, rows, n_rows, HEADS, HEADS * 2 * HALF, HALF, SIGN, BHALF)
    tl.store(Y + base, y1.to(Y.dtype.element_ty), mask=ok)
    tl.store(Y + base + HALF, y2.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _all_finite(y1, y2, ok):
    """1 if every unmasked element of the (rounded) tile is finite, else 0: |y| <= FLT_MAX is False for
    +-inf and for NaN (every compare with NaN is False)."""
    fin = (tl.abs(y1) <= 3.4028234663852886e38) & (tl.abs(y2) <= 3.4028234663852886e38)
    return tl.min(tl.min(tl.where(ok, fin, True).to(tl.int32), 1), 0)


@triton.jit
def rope_write_kv_kernel(Q, K, V, C, S, QO, KO, KC, VC, SLOTS, FLAGS, VERDICT, ARRIVED, QW, KW, eps, n_q_rows,
                         n_k_rows, HQ, HKV, HALF, Q_TOK, K_TOK, V_TOK, Q_PROGRAMS, ROWS: tl.constexpr,
                         BHALF: tl.constexpr, NORM: tl.constexpr = False):
    """Programs [0, Q_PROGRAMS) rotate ROWS (token, head) rows of q; the others ROWS rows of k each: rotate,
    store the rotated k (KO) and, at the token's cache slot, the rotated k (KC) and v's row unchanged (VC:
    an exact copy, no conversion), and write FLAGS[program - Q_PROGRAMS] = 1 if every rotated k element
    (after the rounding to the cache dtype, the value the cache holds) is finite, else 0; the last k program
    to finish writes their AND to VERDICT (int8, 0-dim; ARRIVED: its arrival counter). NORM: q's and k's
    rows are first RMS-normalised over the head dim (weights QW / KW: the q_norm / k_norm of Qwen3) into
    QO / KO, rms_fwd_kernel's bits, and the rotation reads them from there."""
    pid = tl.program_id(0)
    if pid < Q_PROGRAMS:
        rows = pid * ROWS + tl.arange(0, ROWS)
        if NORM:
            _normed_rows(Q, QW, QO, rows, n_q_rows, HQ, Q_TOK, HALF, eps, BHALF)
            y1, y2, base, ok = _rope_rows(QO, C, S, rows, n_q_rows, HQ, HQ * 2 * HALF, HALF, 1.0, BHALF)
        else:
            y1, y2, base, ok = _rope_rows(Q, C, S, rows, n_q_rows, HQ, Q_TOK, HALF, 1.0, BHALF)
        tl.store(QO + base, y1.to(QO.dtype.element_ty), mask=ok)
        tl.store(QO + base + HALF, y2.to(QO.dtype.element_ty), mask=ok)
    else:
        kp = pid - Q_PROGRAMS
        rows = kp * ROWS + tl.arange(0, ROWS)
        if NORM:
            _normed_rows(K, KW, KO, rows, n_k_rows, HKV, K_TOK, HALF, eps, BHALF)
            y1, y2, base, ok = _rope_rows(KO, C, S, rows, n_k_rows, HKV, HKV * 2 * HALF, HALF, 1.0, BHALF)
        else:
            y1, y2, base, ok = _rope_rows(K, C, S, rows, n_k_rows, HKV, K_TOK, HALF, 1.0, BHALF)
        k1, k2 = y1.to(KO.dtype.element_ty), y2.to(KO.dtype.element_ty)
        tl.store(KO + base, k1, mask=ok)
        tl.store(KO + base + HALF, k2, mask=ok)
        # row (t, h) sits at (t * HKV + h) * D in k and at (slot[t] * HKV + h) * D in the cache
        tok = (rows // HKV).to(tl.int64)
        slot = tl.load(SLOTS + tok, mask=rows < n_k_rows, other=0)
        dst = base + ((slot - tok) * HKV * (2 * HALF))[:, None]
        tl.store(KC + dst, k1, mask=ok)
        tl.store(KC + dst + HALF, k2, mask=ok)
        v_src = _strided_rows(rows, HKV, V_TOK, HALF)[:, None] + tl.arange(0, BHALF)[None, :]
        tl.store(VC + dst, tl.load(V + v_src, mask=ok), mask=ok)
        tl.store(VC + dst + HALF, tl.load(V + v_src + HALF, mask=ok), mask=ok)
        tl.store(FLAGS + kp, _all_finite(k1.to(tl.float32), k2.to(tl.float32), ok).to(tl.int8))
        _verdict_if_last(FLAGS, VERDICT, ARRIVED, tl.num_programs(0) - Q_PROGRAMS)


@triton.jit
def _verdict_if_last(FLAGS, VERDICT, ARRIVED, n_flags, BLOCK: tl.constexpr = 1024):
    """The k programs' verdict, by the one that arrives last (attention's fused merge's pattern: a barrier puts
    the program's flag store before its acq_rel arrival, so the last one's loads see every flag): VERDICT = 1 if
    every FLAGS[0 .. n_flags) is 1, else 0; the counter back to 0. No reduction kernel of its own per layer."""
    tl.debug_barrier()
    if tl.atomic_add(ARRIVED, 1, sem="acq_rel", scope="gpu") == n_flags - 1:
        tl.store(ARRIVED, 0)
        ok = tl.full((), 1, tl.int32)
        for first in range(0, n_flags, BLOCK):
            idx = first + tl.arange(0, BLOCK)
            ok = tl.minimum(ok, tl.min(tl.load(FLAGS + idx, mask=idx < n_flags, other=1).to(tl.int32), 0))
        tl.store(VERDICT, ok.to(tl.int8))


@triton.jit
def silu_mul_fwd_kernel(G, U, Y, cols, stride_g, stride_u, BLOCK: tl.constexpr):
    """Row tl.program_id(0), columns of block tl.program_id(1): g and u rows at their own strides (e.g. column
    views of one stacked gate/up output), y contiguous."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < cols
    g = tl.load(G + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    y = tl.math.div_rn(g, 1.0 + tl.exp(-g)) * u
    tl.store(Y + row * cols + offs, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def silu_mul_bwd_kernel(G, U, DY, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
    sig = tl.math.div_rn(1.0, 1.0 + tl.exp(-g))
    silu = g * sig
    tl.store(DG + offs, (dy * u * (sig * (1.0 + g * (1.0 - sig)))).to(DG.dtype.element_ty), mask=ok)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=ok)


# ---- launchers -------------------------------------------------------------------------------------

def _rms_launch_shape(h: int):
    bh = triton.next_power_of_2(h)
    rows = _rows_per_program(bh)
    warps = 4 if bh * rows <= 4096 else 8
    return bh, rows, warps


def rms_forward(x2d: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """(y, inv) of rows x2d; with ``residual`` (x2d's shape), of h = x2d + residual (one rounding), and h:
    (y, inv, h)."""
    n, h = x2d.shape
    y = torch.empty_like(x2d)
    inv = torch.empty(n, dtype=torch.float32, device=x2d.device)
    stream = torch.empty_like(x2d) if residual is not None else None
    if n:
        bh, rows, warps = _rms_launch_shape(h)
        rms_fwd_kernel[(triton.cdiv(n, rows),)](x2d, w, y, inv, residual if stream is not None else x2d,
                                                stream if stream is not None else y, n, h, float(eps), ROWS=rows,
                                                BH=bh, HAS_RES=stream is not None, num_warps=warps, **no_fma())
    return (y, inv) if stream is None else (y, inv, stream)


def rms_backward(x2d, w, dy, inv):
    n, h = x2d.shape
    dx = torch.empty_like(x2d)
    bh, rows, warps = _rms_launch_shape(h)
    progs = triton.cdiv(n, rows)
    partial = torch.empty((max(progs, 1), h), dtype=torch.float32, device=x2d.device)
    if n:
        rms_bwd_kernel[(progs,)](x2d, w, dy, inv, dx, partial, n, h, ROWS=rows, BH=bh, num_warps=warps)
    else:
        partial.zero_()
    return dx, partial.sum(0).to(w.dtype)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, w, eps):
        y, inv = rms_forward(x2d, w, eps)
        ctx.save_for_backward(x2d, w, inv)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, w, inv = ctx.saved_tensors
        dx, dw = rms_backward(x2d, w, dy.contiguous().to(x2d.dtype), inv)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``residual`` (no autograd only: ops.rms_norm passes it only then): the residual add in the same kernel ->
    (normed(x + residual), x + residual); one kernel reads x and the residual and writes the stream and the normed
    rows (the add was a torch kernel of its own)."""
    shape = x.shape
    x2d = x.reshape(-1, shape[-1]).contiguous()
    w = weight.contiguous()
    if residual is not None:
        y, _, stream = rms_forward(x2d, w, float(eps), residual.reshape(-1, shape[-1]).contiguous())
        return y.reshape(shape), stream.reshape(shape)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _RmsNorm.apply(x2d, w, float(eps))
    else:
        y = rms_forward(x2d, w, float(eps))[0]
    return y.reshape(shape)



def _rope_launch(x, cos, sin, sign):
    t, heads, d = x.shape
    half = d // 2
    y = torch.empty_like(x)
    n = t * heads
    if n:
        bhalf, rows = _rope_rows_per_program(half)
        rope_kernel[(triton.cdiv(n, rows),)](x, cos, sin, y, n, heads, half, SIGN=sign, ROWS=rows, BHALF=bhalf,
                                             num_warps=4, **no_fma())
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope_launch(dy.contiguous(), cos, sin, -1.0), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, cos, sin)
    return _rope_launch(x, cos, sin, 1.0)


def _rope_rows_per_program(half: int) -> tuple[int, int]:
    """(next power of two >= half, (token, head) rows per program): rope_kernel's tiles and rope_write_kv's."""
    bhalf = triton.next_power_of_2(half)
    return bhalf, max(1, 2048 // bhalf)


def rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, check_k, qk_norm=None):
    """ops.rope_write_kv on the Triton backend: one launch (rope_write_kv_kernel), then
    ``check_k(rope(k), verdict)`` with the kernel's verdict (its per-program flags, ANDed by the last k program:
    one kernel per layer for the rotations, the cache write and the K check, which were six). The rotated
    tensors have rope_kernel's bits (same inlined formula, same row tiles); with ``qk_norm`` = (q weight,
    k weight, eps), of the rows normalised first in the same launch with rms_norm's bits (its tile: the rope's
    rows per program are rms_norm's for a head-dim row, 4,096 / next_pow2(D), on 4 warps). No autograd."""
    q, k, v = (_token_rows(x) for x in (q, k, v))   # column views of one q/k/v output are read in place
    cos, sin = cos.contiguous(), sin.contiguous()
    t, hq, d = q.shape
    hkv = k.shape[1]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    bhalf, rows = _rope_rows_per_program(d // 2)
    q_programs, k_programs = triton.cdiv(t * hq, rows), triton.cdiv(t * hkv, rows)
    flags = torch.empty(k_programs, dtype=torch.int8, device=k.device)
    verdict = torch.empty((), dtype=torch.int8, device=k.device)
    # the fused norms run on rms_norm's own tile: _rms_launch_shape(d) == (2 * bhalf, rows, 4) for every even d
    # (tests/ops/rope_write_kv_worker.py checks it over head dims 2..1024)
    qw, kw, eps = (qk_norm[0].contiguous(), qk_norm[1].contiguous(), float(qk_norm[2])) if qk_norm else (q, q, 0.0)
    if t:
        rope_write_kv_kernel[(q_programs + k_programs,)](
            q, k, v, cos, sin, qo, ko, k_cache, v_cache, slots, flags, verdict,
            arrival_counters(k.device, 1, "rope_write_kv"), qw, kw, eps, t * hq, t * hkv, hq, hkv, d // 2,
            q.stride(0), k.stride(0), v.stride(0), q_programs, ROWS=rows, BHALF=bhalf, NORM=qk_norm is not None,
            num_warps=4, **no_fma())
    check_k(ko, verdict.view(torch.bool))
    return qo, ko


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] as it is where each token's heads are contiguous (any token stride: a column view of a
    stacked projection output), else a contiguous copy."""
    heads, d = x.shape[1], x.shape[2]
    return x if x.stride(2) == 1 and x.stride(1) == d and x.stride(0) >= heads * d else x.contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, cols] rows of one stride with contiguous columns: a view when its layout allows (a column
    view of a wider tensor does), else a contiguous copy."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _silu_fwd(g, u):
    """y = silu(g) * u for g, u of one shape whose rows may be strided (last dim contiguous); y contiguous."""
    g2, u2 = _rows(g), _rows(u)
    rows, cols = g2.shape
    y = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if rows and cols:
        silu_mul_fwd_kernel[(rows, triton.cdiv(cols, ELEM_BLOCK))](g2, u2, y, cols, g2.stride(0), u2.stride(0),
                                                                   BLOCK=ELEM_BLOCK, num_warps=4)
    return y


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return _silu_fwd(g, u)

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dy = dy.contiguous().to(g.dtype)
        dg, du = torch.empty_like(g), torch.empty_like(u)
        n = g.numel()
        if n:
            silu_mul_bwd_kernel[(triton.cdiv(n, ELEM_BLOCK),)](g, u, dy, dg, du, n, BLOCK=ELEM_BLOCK, num_warps=4)
        return dg, du


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate.contiguous(), up.contiguous())
    return _silu_fwd(gate, up)   # strided rows read in place (ops.linear_group's column views of gate/up)


__all__ = ["rms_norm", "rope", "silu_mul", "rms_forward", "rms_backward", "rope_write_kv"]
