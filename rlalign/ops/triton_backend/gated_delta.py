"""The gated delta rule (Qwen3-Next's Gated-DeltaNet) on the Triton backend: one program per (sequence, value head)
walks its chunks in order, the state in registers.

The formula is ``ops.gated_delta.delta_chunks``' (chunks of C = spec.GDN_CHUNK rows at absolute positions 0, C, 2C,
...; S the state at the chunk's start; rows past the chunk's valid prefix load as zeros)::

    Gamma  = cumsum(g)                                   tl.cumsum over the chunk's C rows
    D_ij   = exp(Gamma_i - Gamma_j) (j <= i), else 0
    A      = beta_i (k_i . k_j) D_ij (j < i), else 0     one C x C x Dk dot
    T      = (I + A)^-1                                  forward substitution, row i from rows < i only
    Uv, W  = T (beta v), T (beta exp(Gamma) k)           (the delta rule's UT rows; returned as ``u`` = [Uv | W])
    v'     = Uv - W S
    o      = (q exp(Gamma)) S + (where(j <= i, (q . k) D, 0)) v'
    S'     = exp(Gamma_C-1) S + (k exp(Gamma_C-1 - Gamma))^T v'     (only a full chunk moves the state)

Why a row's bits do not depend on how its sequence was cut (packed training == any chunked prefill == decode):
every chunk runs the same compiled kernel on tiles of one shape (C rows, Dk and Dv padded to powers of two fixed by
the model), whatever the number of chunks, sequences or valid rows; the integer arguments that vary with the batch
or the caller (chunk and sequence counts, what is stored) are not specialised on (``do_not_specialize``) and every
pointer is a fresh contiguous tensor, so the binary and its register layouts -- which fix the order of each
``tl.sum`` and scan -- are the same for every call. In that binary row i of each result reads rows <= i only: the cumsum
is a prefix scan; T's row i is written from A's row i and T's rows < i (later rows are still +0); every product
is the backend's one matrix primitive (``_common.mma``: fp32 operands split bf16x3, fp32 accumulation, wgmma on
Hopper -- an output element's sum over K does not depend on the tile's other rows, the property every strict GEMM
here rests on, docs/design/tile-shapes.md), and the terms of rows past i are products with an exact +0
coefficient (the causal masks are selects). So a decode step, which recomputes its
open chunk from the rows stored so far, gives its row the bits the full chunk gave it -- up to the sign of an output
that is exactly zero (a +0 coefficient times a negative later value is -0; it only matters when every other term is
-0 too). The state moves only at full chunks, from all C rows: the same bits whichever call closed the chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlalign.contract import spec
from rlalign.contract.errors import fail
from rlalign.ops.triton_backend._common import mma, split_for


@triton.jit
def _dot(a, b, SPLIT: tl.constexpr):
    """a @ b in fp32 by the backend's one matrix primitive (``_common.mma``: fp32 operands split bf16x3 on the GPU,
    an exact fp32 dot under the interpreter)."""
    return mma(a, b, tl.zeros((a.shape[0], b.shape[1]), dtype=tl.float32), SPLIT)


@triton.jit
def _unit_lower_inverse(a, C: tl.constexpr):
    """(I + a)^-1 of a strictly lower-triangular [C, C] tile, row by row: T_i = e_i - sum_j a_ij T_j (the rows
    j >= i of T still +0, a_i's entries there +0), so row i depends on a's rows <= i only."""
    rows = tl.arange(0, C)
    t = tl.zeros((C, C), dtype=tl.float32)
    for i in range(C):
        here = rows[:, None] == i
        a_i = tl.sum(tl.where(here, a, 0.0), 0)                       # a's row i (one non-zero term per column)
        t_i = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_i[:, None] * t, 0)
        t = tl.where(here, t_i[None, :], t)
    return t


@triton.jit
def _chunk_rows(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, item, n, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr):
    """The chunk's rows (``item`` its flat (j, b, h) index, ``n`` valid rows; zeros past them): q, k [C, BK],
    v [C, BV], g, beta [C]. The forward and the backward's recompute load through this one function."""
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    rmask = rows < n
    kmask = rmask[:, None] & (ck < DK)[None, :]
    vmask = rmask[:, None] & (cv < DV)[None, :]
    q = tl.load(q_ptr + (item * C + rows[:, None]) * DK + ck[None, :], mask=kmask, other=0.0)
    k = tl.load(k_ptr + (item * C + rows[:, None]) * DK + ck[None, :], mask=kmask, other=0.0)
    v = tl.load(v_ptr + (item * C + rows[:, None]) * DV + cv[None, :], mask=vmask, other=0.0)
    g = tl.load(g_ptr + item * C + rows, mask=rmask, other=0.0)
    beta = tl.load(b_ptr + item * C + rows, mask=rmask, other=0.0)
    return q, k, v, g, beta


@triton.jit
def _chunk_terms(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, item, n, S, DK: tl.constexpr, DV: tl.constexpr,
                 C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr):
    """One chunk (``item`` = its flat (j, b, h) index, ``n`` valid rows) from the state S [BK, BV] at its start:
    (o [C, BV], the state after it (S when n < C), Gamma [C], Uv [C, BV], W [C, BK])."""
    rows = tl.arange(0, C)
    q, k, v, g, beta = _chunk_rows(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, item, n, DK, DV, C, BK, BV)

    gamma = tl.cumsum(g, 0)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    decay = tl.where(causal, tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    kk = _dot(k, tl.trans(k), SPLIT)
    t = _unit_lower_inverse(tl.where(strict, beta[:, None] * kk * decay, 0.0), C)

    eg = tl.exp(gamma)
    uv = _dot(t, v * beta[:, None], SPLIT)
    w = _dot(t, k * (beta * eg)[:, None], SPLIT)
    v_new = uv - _dot(w, S, SPLIT)
    qk = tl.where(causal, _dot(q, tl.trans(k), SPLIT) * decay, 0.0)
    o = _dot(q * eg[:, None], S, SPLIT) + _dot(qk, v_new, SPLIT)

    last = tl.sum(tl.where(rows == C - 1, gamma, 0.0), 0)              # Gamma_C-1 (exact: one non-zero term)
    k_end = k * tl.exp(last - gamma)[:, None]
    moved = tl.exp(last) * S + _dot(tl.trans(k_end), v_new, SPLIT)
    return o, tl.where(n == C, moved, S), gamma, uv, w


@triton.jit(do_not_specialize=["J", "B", "store_states", "store_u"])
def delta_fwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, n_ptr, s0_ptr, o_ptr, states_ptr, gamma_ptr, u_ptr,
                     J, B, store_states, store_u, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr):
    """Program (b, h): chunks j = 0 .. J-1 of sequence b, head h, in order (module docstring). ``store_states`` and
    ``store_u`` are run-time flags, not constexprs: training (no Gamma / U) and the engine (both) run one binary,
    so the same register layouts and reduction orders."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    smask = (ck < DK)[:, None] & (cv < DV)[None, :]
    s_off = ck[:, None] * DV + cv[None, :]
    S = tl.load(s0_ptr + (b * H + h).to(tl.int64) * DK * DV + s_off, mask=smask, other=0.0)
    for j in range(J):
        item = (j * B + b).to(tl.int64) * H + h   # int64: offsets past 2**31 elements at long packed batches
        n = tl.load(n_ptr + j * B + b)
        o, S, gamma, uv, w = _chunk_terms(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, item, n, S, DK, DV, C, BK, BV,
                                                 SPLIT)
        rmask = rows < n
        tl.store(o_ptr + (item * C + rows[:, None]) * DV + cv[None, :], o,
                 mask=rmask[:, None] & (cv < DV)[None, :])
        if store_states != 0:
            tl.store(states_ptr + item * DK * DV + s_off, S, mask=smask)
        if store_u != 0:   # per row: Gamma, then U = [Uv | W] (ops.gated_delta.delta_chunks' ``gamma``, ``u``)
            tl.store(gamma_ptr + item * C + rows, gamma, mask=rmask)
            u_row = (item * C + rows[:, None]) * (DV + DK)
            tl.store(u_ptr + u_row + cv[None, :], uv, mask=rmask[:, None] & (cv < DV)[None, :])
            tl.store(u_ptr + u_row + DV + ck[None, :], w, mask=rmask[:, None] & (ck < DK)[None, :])


@triton.jit(do_not_specialize=["J", "B"])
def delta_bwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, n_ptr, s0_ptr, states_ptr, do_ptr, dstates_ptr,
                     dq_ptr, dk_ptr, dv_ptr, dg_ptr, db_ptr, ds0_ptr,
                     J, B, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr):
    """Program (b, h): the gradients of chunks j = J-1 .. 0 of sequence b, head h, in that order, the state's
    gradient carried from each chunk to the one before. Each chunk's forward quantities are recomputed from its
    inputs and the state at its start (the forward's ``states`` of the chunk before, or the initial state);
    the gradient of every product is written out by hand (the formula: module docstring):

        dv' = P^T do + [full] K_end dS_out          dP = where(j <= i, do v'^T, 0)
        dS  = [full] exp(Gamma_C-1) dS_out + [not full] dS_out + (q exp(Gamma))^T do - W^T dv'
        dT  = dv' (beta v)^T - (dv' S^T) (beta exp(Gamma) k)^T      dA = where(j < i, -T^T dT T^T, 0)
        dGamma from exp(Gamma) q, exp(Gamma) k, exp(Gamma_i - Gamma_j), exp(Gamma_C-1 - Gamma); dg = reverse
        cumsum of dGamma.

    Every sum is a dot or tl.sum of a fixed tile shape in one binary: deterministic run to run."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    smask = (ck < DK)[:, None] & (cv < DV)[None, :]
    s_off = ck[:, None] * DV + cv[None, :]
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    dS = tl.zeros((BK, BV), dtype=tl.float32)
    for jj in range(J):
        j = J - 1 - jj
        item = (j * B + b).to(tl.int64) * H + h   # int64: offsets past 2**31 elements at long packed batches
        n = tl.load(n_ptr + j * B + b)
        full = n == C
        rmask = rows < n
        kmask = rmask[:, None] & (ck < DK)[None, :]
        vmask = rmask[:, None] & (cv < DV)[None, :]
        if j == 0:
            S = tl.load(s0_ptr + (b * H + h).to(tl.int64) * DK * DV + s_off, mask=smask, other=0.0)
        else:
            before = ((j - 1) * B + b).to(tl.int64) * H + h                    # the chunk before's item
            S = tl.load(states_ptr + before * DK * DV + s_off, mask=smask, other=0.0)
        dS = dS + tl.load(dstates_ptr + item * DK * DV + s_off, mask=smask, other=0.0)   # dS_out
        q, k, v, g, beta = _chunk_rows(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, item, n, DK, DV, C, BK, BV)
        do = tl.load(do_ptr + (item * C + rows[:, None]) * DV + cv[None, :], mask=vmask, other=0.0)

        # the forward, recomputed
        gamma = tl.cumsum(g, 0)
        decay = tl.where(causal, tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
        kk = _dot(k, tl.trans(k), SPLIT)
        t = _unit_lower_inverse(tl.where(strict, beta[:, None] * kk * decay, 0.0), C)
        eg = tl.exp(gamma)
        vb = v * beta[:, None]
        kb = k * (beta * eg)[:, None]
        w = _dot(t, kb, SPLIT)
        v_new = _dot(t, vb, SPLIT) - _dot(w, S, SPLIT)
        qk = _dot(q, tl.trans(k), SPLIT)
        p = tl.where(causal, qk * decay, 0.0)
        qd = q * eg[:, None]
        last = tl.sum(tl.where(rows == C - 1, gamma, 0.0), 0)
        e_end = tl.exp(last - gamma)
        k_end = k * e_end[:, None]

        # S_out = exp(Gamma_C-1) S + K_end^T v' (a full chunk), else S
        d_end = _dot(v_new, tl.trans(dS), SPLIT)                       # dK_end [C, BK]
        r_end = tl.sum(d_end * k_end, 1)
        d_last = tl.exp(last) * tl.sum(tl.sum(S * dS, 1), 0) + tl.sum(r_end, 0)
        dv_new = tl.where(full, _dot(k_end, dS, SPLIT), 0.0)
        dk = tl.where(full, d_end * e_end[:, None], 0.0)
        d_gamma = tl.where(full, -r_end, 0.0) + tl.where(full & (rows == C - 1), d_last, 0.0)
        dS_in = tl.where(full, tl.exp(last) * dS, dS)

        # o = qd S + p v'
        d_qd = _dot(do, tl.trans(S), SPLIT)                             # [C, BK]
        dS_in += _dot(tl.trans(qd), do, SPLIT)
        dq = d_qd * eg[:, None]
        d_gamma += tl.sum(d_qd * qd, 1)
        dp = tl.where(causal, _dot(do, tl.trans(v_new), SPLIT), 0.0)
        dv_new += _dot(tl.trans(p), do, SPLIT)

        # v' = T vb - W S
        d_w = -_dot(dv_new, tl.trans(S), SPLIT)                        # [C, BK]
        dS_in -= _dot(tl.trans(w), dv_new, SPLIT)
        d_t = _dot(dv_new, tl.trans(vb), SPLIT) + _dot(d_w, tl.trans(kb), SPLIT)
        d_vb = _dot(tl.trans(t), dv_new, SPLIT)
        d_kb = _dot(tl.trans(t), d_w, SPLIT)
        d_a = tl.where(strict, -_dot(tl.trans(t), _dot(d_t, tl.trans(t), SPLIT),
                                         SPLIT), 0.0)

        # vb = beta v, kb = beta exp(Gamma) k
        dv = d_vb * beta[:, None]
        d_beta = tl.sum(d_vb * v, 1)
        s_kb = tl.sum(d_kb * k, 1)
        dk += d_kb * (beta * eg)[:, None]
        d_beta += eg * s_kb
        d_gamma += beta * eg * s_kb

        # p = (q k^T) decay, a = beta_i (k k^T) decay (masked)
        dm = dp * decay
        dq += _dot(dm, k, SPLIT)
        dk += _dot(tl.trans(dm), q, SPLIT)
        d_kk = d_a * beta[:, None] * decay
        dk += _dot(d_kk, k, SPLIT) + _dot(tl.trans(d_kk), k, SPLIT)
        d_beta += tl.sum(d_a * kk * decay, 1)
        d_x = tl.where(causal, (dp * qk + d_a * beta[:, None] * kk) * decay, 0.0)        # d(Gamma_i - Gamma_j)
        d_gamma += tl.sum(d_x, 1) - tl.sum(d_x, 0)
        d_gamma = tl.where(rmask, d_gamma, 0.0)
        dg = tl.cumsum(d_gamma, 0, reverse=True)                                         # Gamma = cumsum(g)

        tl.store(dq_ptr + (item * C + rows[:, None]) * DK + ck[None, :], dq, mask=kmask)
        tl.store(dk_ptr + (item * C + rows[:, None]) * DK + ck[None, :], dk, mask=kmask)
        tl.store(dv_ptr + (item * C + rows[:, None]) * DV + cv[None, :], dv, mask=vmask)
        tl.store(dg_ptr + item * C + rows, dg, mask=rmask)
        tl.store(db_ptr + item * C + rows, d_beta, mask=rmask)
        dS = dS_in
    tl.store(ds0_ptr + (b * H + h).to(tl.int64) * DK * DV + s_off, dS, mask=smask)


def delta_chunks_backward(q, k, v, g, beta, valid, state, states, d_out, d_states):
    """Gradients (dq, dk, dv, dg, dbeta, dstate) of :func:`delta_chunks_forward`'s (out, states) given theirs;
    ``states`` is that forward's (the state after every chunk). Rows past a chunk's valid prefix get zeros."""
    j, bsz, h, c, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta, state, states, d_out, d_states = (
        _fresh(x) for x in (q, k, v, g, beta, state, states, d_out, d_states))
    counts = valid.to(device=q.device).sum(-1, dtype=torch.int32).contiguous()
    grads = [torch.zeros_like(x) for x in (q, k, v, g, beta, state)]
    if j * bsz * h:
        delta_bwd_kernel[(bsz, h)](q, k, v, g, beta, counts, state, states, d_out, d_states, *grads, j, bsz, H=h,
                                   DK=dk, DV=dv, C=c, BK=_block(dk), BV=_block(dv), SPLIT=split_for(torch.float32),
                                   num_warps=_warps(dk, dv))
    return tuple(grads)


def _warps(dk: int, dv: int) -> int:
    """Warps per program: 8 from a 64 x 128 state tile on, else 4 (measured with ptxas for sm_90a: at Dk = Dv = 128
    8 warps spill 2.9 KB (forward) and 12.7 KB (backward) a thread against 4.9 and 21.4 KB with 4; at 8 x 12 4 warps
    spill less). A function of the head shape only, as every launch parameter here: one binary per model."""
    return 8 if _block(dk) * _block(dv) >= 64 * 128 else 4


def _block(d: int) -> int:
    """A head dim's tile width: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(d))


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous fp32 tensor at the start of its own (aligned) allocation: every call then runs the same
    specialisation of the kernel (module docstring)."""
    x = x.float().contiguous()
    return x if x.storage_offset() == 0 else x.clone()


def delta_chunks_forward(q, k, v, g, beta, valid, state, *, store_states: bool, store_u: bool):
    """The rule over J chunks of B sequences (shapes as ``ops.gated_delta.delta_chunks``) ->
    (out [J, B, H, C, Dv] (rows past a chunk's valid prefix unwritten: zeros), states [J, B, H, Dk, Dv] or None,
    gamma [J, B, H, C] or None, u [J, B, H, C, Dv + Dk] or None)."""
    j, bsz, h, c, dk = q.shape
    dv = v.shape[-1]
    if c != spec.GDN_CHUNK:
        raise fail("delta_chunks", f"chunks must have spec.GDN_CHUNK={spec.GDN_CHUNK} rows, got {c}")
    q, k, v, g, beta, state = (_fresh(x) for x in (q, k, v, g, beta, state))
    counts = valid.to(device=q.device).sum(-1, dtype=torch.int32).contiguous()     # [J, B]: a prefix of each chunk
    out = torch.zeros((j, bsz, h, c, dv), dtype=torch.float32, device=q.device)
    states = torch.empty((j, bsz, h, dk, dv), dtype=torch.float32, device=q.device) if store_states else None
    gamma = torch.zeros((j, bsz, h, c), dtype=torch.float32, device=q.device) if store_u else None
    u = torch.zeros((j, bsz, h, c, dv + dk), dtype=torch.float32, device=q.device) if store_u else None
    if j * bsz * h == 0:
        return out, states, gamma, u
    dummy = out
    delta_fwd_kernel[(bsz, h)](q, k, v, g, beta, counts, state, out, dummy if states is None else states,
                               dummy if gamma is None else gamma, dummy if u is None else u, j, bsz, int(store_states),
                               int(store_u), H=h, DK=dk, DV=dv, C=c, BK=_block(dk), BV=_block(dv),
                               SPLIT=split_for(torch.float32), num_warps=_warps(dk, dv))
    return out, states, gamma, u


__all__ = ["delta_chunks_backward", "delta_chunks_forward", "delta_bwd_kernel", "delta_fwd_kernel"]
