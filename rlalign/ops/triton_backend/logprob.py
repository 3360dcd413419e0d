"""Fused LM head + token log-prob + entropy on the Triton backend (forward and backward).

Per token t (fp32 throughout; the [T, V] logits never reach memory in the forward):

    z[t, v]   = (h[t] . W[v]) / temperature   the strict GEMM's K order (64-column steps, fp32
                                              accumulator); IEEE division, skipped at temperature 1
                                              (the temperature rule of rlalign/ops/temperature.py, in-kernel)
    vocab tiles j of VOCAB_TILE = 256 columns at absolute offsets 256 j (the last one masked):
        m_j = max z,  s_j = sum exp(z - m_j),  w_j = sum exp(z - m_j) * z
        (one fixed-shape [128, 256] tile per program; each row reduced in the same order whatever T)
    tiles folded strictly left to right, the state starting as tile 0's:
        m' = max(m, m_j);  a = exp(m - m');  c = exp(m_j - m')
        s = s * a + s_j * c;   w = w * a + w_j * c;   m = m'
    lse = m + log(s);  logprob = z[target] - lse;  entropy = lse - w / s

(exp(x) is evaluated as exp2(x * log2(e)) everywhere.) The GPU's vocab block is the GEMM tile
(256), not the torch backend's 1024: each backend agrees with itself; token_chunk and
vocab_chunk only set memory here too.

Backward (recomputes logits in vocab chunks, never [T, V]):

    p = exp(z - lse);  q = g_lp + g_ent * (z - w / s)
    dz = where(v == target, g_lp - p q, -(p q)) / temperature     stored in the input dtype
    dh = sum over vocab in 64-column steps, in increasing order, of dz @ W   (fp32 accumulator
         carried across chunks through memory: the bits do not depend on the chunk size)
    dW[chunk] = dz[:, chunk]^T @ h, reduced over all T tokens in 64-row steps in order
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlalign.ops import gemm_census
from rlalign.ops.temperature import divide_by_temperature, temperature_divisor
from rlalign.ops.triton_backend._common import BLOCK_K, aligned, descriptor, split_for, tma_ok
from rlalign.ops.triton_backend.gemm import reduce_segment, tile_coords, gemm

VOCAB_TILE = 256
LOG2E = tl.constexpr(1.4426950408889634)
TOKEN_CHUNK = 16384   # tokens per forward launch (stats memory 12 B x V/256 per token)
GRAD_CHUNK = 8192     # vocab columns per backward chunk (dz is T x 8192; bits do not depend on it)
GROUP_M = 16


def lp_tile(dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, warps, stages): fixed per dtype (the row reductions depend on it)."""
    if dtype == torch.float32:
        return 64, VOCAB_TILE, 8, 2
    return 128, VOCAB_TILE, 8, 3


@triton.jit
def _logits_tile(h_src, w_src, off_m, off_n, T, V, H, stride_hm, stride_hk, stride_wv, stride_wk, temperature,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr,
                 SPLIT: tl.constexpr, HAS_TEMP: tl.constexpr):
    acc = reduce_segment(tl.zeros((BM, BN), tl.float32), h_src, w_src, off_m, off_n, 0, H, tl.cdiv(H, BK),
                          T, V, stride_hm, stride_hk, stride_wk, stride_wv, BM, BN, BK, False, True,
                          USE_TMA, SPLIT)
    if HAS_TEMP:
        acc = tl.math.div_rn(acc, temperature)
    return acc


@triton.jit
def lp_stats_kernel(h_src, w_src, tgt_ptr, stats_ptr, zt_ptr, T, V, H,
                    stride_hm, stride_hk, stride_wv, stride_wk, temperature,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr,
                    SPLIT: tl.constexpr, HAS_TEMP: tl.constexpr, WITH_W: tl.constexpr, GROUP: tl.constexpr):
    """Per (token tile, vocab tile): (m_j, s_j, w_j) of each row -> stats[:, j, row]; z[target]."""
    num_pid_m = tl.cdiv(T, BM)
    num_pid_n = tl.cdiv(V, BN)
    pid_m, pid_n = tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP)
    off_m = pid_m * BM
    off_n = pid_n * BN
    z = _logits_tile(h_src, w_src, off_m, off_n, T, V, H, stride_hm, stride_hk, stride_wv, stride_wk,
                     temperature, BM, BN, BK, USE_TMA, SPLIT, HAS_TEMP)
    rows = off_m + tl.arange(0, BM)
    cols = off_n + tl.arange(0, BN)
    row_ok = rows < T
    col_ok = cols < V
    zm = tl.where(col_ok[None, :], z, float("-inf"))
    m_j = tl.max(zm, 1)
    e = tl.exp2((zm - m_j[:, None]) * LOG2E)
    s_j = tl.sum(e, 1)
    plane = num_pid_n * T                      # < 2**31: T <= TOKEN_CHUNK
    base = stats_ptr + pid_n * T + rows
    tl.store(base, m_j, mask=row_ok)
    tl.store(base + plane, s_j, mask=row_ok)
    if WITH_W:
        w_j = tl.sum(tl.where(col_ok[None, :], e * z, 0.0), 1)
        tl.store(base + 2 * plane, w_j, mask=row_ok)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    hit = cols[None, :] == tgt[:, None]
    z_t = tl.sum(tl.where(hit, z, 0.0), 1)     # exactly one term is z, the rest are +0.0
    mine = row_ok & (tgt >= off_n) & (tgt < off_n + BN)
    tl.store(zt_ptr + rows, z_t, mask=mine)


@triton.jit
def lp_merge_kernel(stats_ptr, zt_ptr, lp_ptr, ent_ptr, lse_ptr, mu_ptr, T, NT,
                    BT: tl.constexpr, WITH_W: tl.constexpr):
    """Fold the NT vocab-tile statistics of BT tokens left to right (see module docstring)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = rows < T
    plane = NT * T
    m = tl.load(stats_ptr + rows, mask=ok, other=0.0)
    s = tl.load(stats_ptr + plane + rows, mask=ok, other=1.0)
    w = tl.zeros((BT,), tl.float32)
    if WITH_W:
        w = tl.load(stats_ptr + 2 * plane + rows, mask=ok, other=0.0)
    # software-pipelined (the loads of later tiles in flight: the loop carries only m, s, w): at a decode batch one
    # program folds all rows' ~600 tiles, and an unpipelined loop waits one load latency per tile (0.14 ms a step
    # at the 8B shape, H200 profiles of 2026-12-03). The arithmetic per row is the same, in the same order.
    for j in tl.range(1, NT, num_stages=4):
        base = stats_ptr + j * T + rows
        m_j = tl.load(base, mask=ok, other=0.0)
        s_j = tl.load(base + plane, mask=ok, other=1.0)
        m_new = tl.maximum(m, m_j)
        a = tl.exp2((m - m_new) * LOG2E)
        c = tl.exp2((m_j - m_new) * LOG2E)
        s = s * a + s_j * c
        if WITH_W:
            w_j = tl.load(base + 2 * plane, mask=ok, other=0.0)
            w = w * a + w_j * c
        m = m_new
    lse = m + tl.log(s)
    zt = tl.load(zt_ptr + rows, mask=ok, other=0.0)
    tl.store(lp_ptr + rows, zt - lse, mask=ok)
    tl.store(lse_ptr + rows, lse, mask=ok)
    if WITH_W:
        mu = tl.math.div_rn(w, s)
        tl.store(ent_ptr + rows, lse - mu, mask=ok)
        tl.store(mu_ptr + rows, mu, mask=ok)


@triton.jit
def lp_grad_logits_kernel(h_src, w_src, tgt_ptr, lse_ptr, mu_ptr, glp_ptr, gent_ptr, dz_ptr,
                          T, V, H, v0, stride_hm, stride_hk, stride_wv, stride_wk, stride_dz, temperature,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr,
                          SPLIT: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ENT: tl.constexpr,
                          GROUP: tl.constexpr):
    """dz [T, V] for the vocab chunk held by w_src (V columns starting at absolute column v0)."""
    num_pid_m = tl.cdiv(T, BM)
    num_pid_n = tl.cdiv(V, BN)
    pid_m, pid_n = tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP)
    off_m = pid_m * BM
    off_n = pid_n * BN
    z = _logits_tile(h_src, w_src, off_m, off_n, T, V, H, stride_hm, stride_hk, stride_wv, stride_wk,
                     temperature, BM, BN, BK, USE_TMA, SPLIT, HAS_TEMP)
    rows = off_m + tl.arange(0, BM)
    cols = off_n + tl.arange(0, BN)
    row_ok = rows < T
    col_ok = cols < V
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - v0
    p = tl.exp2((z - lse[:, None]) * LOG2E)
    if HAS_ENT:
        mu = tl.load(mu_ptr + rows, mask=row_ok, other=0.0)
        g_ent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        q = g_lp[:, None] + g_ent[:, None] * (z - mu[:, None])
    else:
        q = g_lp[:, None] + tl.zeros((BM, BN), tl.float32)
    pq = p * q
    dz = tl.where(cols[None, :] == tgt[:, None], g_lp[:, None] - pq, -pq)
    if HAS_TEMP:
        dz = tl.math.div_rn(dz, temperature)
    ptrs = dz_ptr + rows[:, None].to(tl.int64) * stride_dz + cols[None, :]
    tl.store(ptrs, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ---- launchers -------------------------------------------------------------------------------------

def lp_sources(h: torch.Tensor, w: torch.Tensor, bm: int, bn: int):
    """TMA descriptors for h [T, H] and W [V, H] when both allow it (a shape-only choice), else pointers."""
    if tma_ok(h) and tma_ok(w):
        return descriptor(h, [bm, BLOCK_K]), descriptor(w, [bn, BLOCK_K]), True
    return h, w, False


def _note(role, kernel, h, w, out, tma, **options) -> None:
    """One lp kernel launch into the collecting GEMM census: its GEMM is z [T, V] = h [T, H] @ w [V, H]^T."""
    bm, bn, warps, stages = lp_tile(h.dtype)
    gemm_census.ACTIVE.add(role, w, entry=kernel.removesuffix("_kernel"), kernel=kernel,
                           config=f"lp_tile(BM={bm}, BN={bn}, warps={warps}, stages={stages}, group_m={GROUP_M})",
                           m=h.shape[0], n=w.shape[0], k=h.shape[1], a_trans=False, b_trans=True,
                           a_strides=gemm_census.strides(h), b_strides=gemm_census.strides(w),
                           out_strides=gemm_census.strides(out), dtype=gemm_census.dtype_name(h.dtype),
                           out_dtype=gemm_census.dtype_name(out.dtype), tma=tma, options=tuple(sorted(options.items())))


def launch_stats(hc, w, tgt, stats, zt, temperature: float, with_entropy: bool) -> None:
    """lp_stats_kernel over one token chunk hc [T, H] (T <= TOKEN_CHUNK): stats [2 or 3, V/256, T], zt [T]."""
    bm, bn, warps, stages = lp_tile(hc.dtype)
    tc, hdim = hc.shape
    v = w.shape[0]
    h_src, w_src, tma = lp_sources(hc, w, bm, bn)
    if gemm_census.ACTIVE is not None:
        _note("lm_stats", "lp_stats_kernel", hc, w, stats[0], tma, with_entropy=with_entropy, temperature=temperature)
    grid = (triton.cdiv(tc, bm) * triton.cdiv(v, bn),)
    lp_stats_kernel[grid](h_src, w_src, tgt, stats, zt, tc, v, hdim,
                          hc.stride(0), hc.stride(1), w.stride(0), w.stride(1), float(temperature),
                          BM=bm, BN=bn, BK=BLOCK_K, USE_TMA=tma, SPLIT=split_for(hc.dtype), HAS_TEMP=temperature != 1.0,
                          WITH_W=with_entropy, GROUP=GROUP_M, num_warps=warps, num_stages=stages)


def launch_grad_logits(h, wc, tgt, lse, mu, g_lp, g_ent, dz, v0: int, temperature: float, has_ent: bool) -> None:
    """lp_grad_logits_kernel: dz [T, Vc] for the vocab chunk wc [Vc, H] starting at absolute column v0."""
    bm, bn, warps, stages = lp_tile(h.dtype)
    t, hdim = h.shape
    vc = wc.shape[0]
    h_src, w_src, tma = lp_sources(h, wc, bm, bn)
    if gemm_census.ACTIVE is not None:
        _note("lm_grad_logits", "lp_grad_logits_kernel", h, wc, dz, tma, has_ent=has_ent, temperature=temperature)
    grid = (triton.cdiv(t, bm) * triton.cdiv(vc, bn),)
    lp_grad_logits_kernel[grid](h_src, w_src, tgt, lse, mu, g_lp, g_ent, dz, t, vc, hdim, v0,
                                h.stride(0), h.stride(1), wc.stride(0), wc.stride(1), dz.stride(0),
                                float(temperature), BM=bm, BN=bn, BK=BLOCK_K, USE_TMA=tma, SPLIT=split_for(h.dtype),
                                HAS_TEMP=temperature != 1.0, HAS_ENT=has_ent, GROUP=GROUP_M,
                                num_warps=warps, num_stages=stages)


def forward_stats(hidden, weight, targets, temperature, with_entropy):
    """-> (logprob, entropy or None, lse, mu or None), fp32 [T]."""
    h, w = aligned(hidden), aligned(weight)
    tgt = targets.to(torch.int64).contiguous()
    t, hdim = h.shape
    v = w.shape[0]
    dev = h.device
    lp = torch.empty(t, dtype=torch.float32, device=dev)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if with_entropy else lp
    mu = torch.empty_like(lp) if with_entropy else lp
    nt = triton.cdiv(v, VOCAB_TILE)
    for r0 in range(0, t, TOKEN_CHUNK):
        r1 = min(t, r0 + TOKEN_CHUNK)
        tc = r1 - r0
        stats = torch.empty((3 if with_entropy else 2, nt, tc), dtype=torch.float32, device=dev)
        zt = torch.empty(tc, dtype=torch.float32, device=dev)
        launch_stats(h[r0:r1], w, tgt[r0:r1], stats, zt, temperature, with_entropy)
        bt = 256
        lp_merge_kernel[(triton.cdiv(tc, bt),)](stats, zt, lp[r0:r1], ent[r0:r1], lse[r0:r1], mu[r0:r1], tc, nt,
                                                BT=bt, WITH_W=with_entropy, num_warps=4)
    return lp, (ent if with_entropy else None), lse, (mu if with_entropy else None)


def backward_grads(hidden, weight, targets, lse, mu, temperature, g_lp, g_ent, need_dh, need_dw):
    h, w = aligned(hidden), aligned(weight)
    tgt = targets.to(torch.int64).contiguous()
    t, hdim = h.shape
    v = w.shape[0]
    dev = h.device
    g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
    has_ent = g_ent is not None and mu is not None
    g_ent = g_ent.float().contiguous() if has_ent else g_lp
    mu_arg = mu if has_ent else lse
    dh = torch.zeros((t, hdim), dtype=torch.float32, device=dev) if need_dh else None
    dw = torch.empty_like(w) if need_dw else None
    for c0 in range(0, v, GRAD_CHUNK):
        c1 = min(v, c0 + GRAD_CHUNK)
        wc = w[c0:c1]
        vc = c1 - c0
        # rows padded to 64 columns: 16-byte aligned rows keep every chunk on the TMA path
        dz = torch.empty((t, triton.cdiv(vc, 64) * 64), dtype=h.dtype, device=dev)[:, :vc]
        launch_grad_logits(h, wc, tgt, lse, mu_arg, g_lp, g_ent, dz, c0, temperature, has_ent)
        if need_dh:
            gemm(dz, wc, out=dh, acc_in=True, role="lm_dX", role_of=weight)
        if need_dw:
            gemm(dz, h, a_trans=True, out=dw[c0:c1], role="lm_dW", role_of=weight)
    return (None if dh is None else dh.to(hidden.dtype)), dw


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy):
        lp, ent, lse, mu = forward_stats(hidden, weight, targets, temperature, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, lse, mu)
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        return (lp, ent) if with_entropy else lp

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, targets, lse, mu = ctx.saved_tensors
        g_lp = grads[0]
        g_ent = grads[1] if ctx.with_entropy else None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        dh, dw = backward_grads(hidden, weight, targets, lse, mu, ctx.temperature, g_lp, g_ent,
                                ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dh, dw, None, None, None


def logprob_entropy(hidden, weight, targets, temperature, token_chunk, vocab_chunk, with_entropy):
    """Validated inputs (rlalign.ops.logprob_entropy). token_chunk / vocab_chunk only set memory on
    the torch backend; here the chunking is fixed (TOKEN_CHUNK, GRAD_CHUNK) and never
    changes bits either."""
    temperature = float(temperature)
    with_entropy = bool(with_entropy)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        out = _LogprobEntropy.apply(hidden, weight, targets, temperature, with_entropy)
        return out if with_entropy else (out, None)
    lp, ent, _, _ = forward_stats(hidden, weight, targets, temperature, with_entropy)
    return lp, ent


def lm_logits(hidden, weight, temperature, vocab_chunk):
    """fp32 [S, V] = z of the module docstring (the same GEMM K order, IEEE division)."""
    with torch.no_grad():
        out = gemm(hidden, weight, b_trans=True, out_dtype=torch.float32, role="lm_logits", role_of=weight)
        out = divide_by_temperature(out, temperature_divisor(float(temperature), out.device), in_place=True)
    return out


__all__ = ["logprob_entropy", "lm_logits", "forward_stats", "backward_grads", "launch_stats", "launch_grad_logits",
           "VOCAB_TILE", "TOKEN_CHUNK", "GRAD_CHUNK"]
