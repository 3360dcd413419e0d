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
are not specialised on (``do_not_specialize``) and every pointer is a fresh contiguous tensor, so the binary and its
register layouts are the same for every call. In that binary row i of each result reads rows <= i only: the cumsum
is a prefix scan; T's row i is written from A's row i and T's rows < i (later rows are still +0); every dot sums
over a fixed K in a fixed order (``input_precision="ieee"``: fp32 FMA chains, no tf32), and the terms of rows past i
are products with an exact +0 coefficient (the causal masks are selects). So a decode step, which recomputes its
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

IEEE = "ieee"   # fp32 dots as fp32 FMA chains: no tf32 rounding of the operands


@triton.jit
def _chunk_terms(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, item, n, S, DK: tl.constexpr, DV: tl.constexpr,
                 C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One chunk (``item`` = its flat (j, b, h) index, ``n`` valid rows) from the state S [BK, BV] at its start:
    (o [C, BV], the state after it (S when n < C), Gamma [C], Uv [C, BV], W [C, BK])."""
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

    gamma = tl.cumsum(g, 0)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    decay = tl.where(causal, tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    kk = tl.dot(k, tl.trans(k), input_precision=IEEE)
    a = tl.where(strict, beta[:, None] * kk * decay, 0.0)
    # T = (I + A)^-1 row by row: T_i = e_i - sum_j A_ij T_j, the rows j >= i of T still +0 (a_i's too)
    t = tl.zeros((C, C), dtype=tl.float32)
    for i in range(C):
        here = rows[:, None] == i
        a_i = tl.sum(tl.where(here, a, 0.0), 0)                       # A's row i (one non-zero term per column)
        t_i = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_i[:, None] * t, 0)
        t = tl.where(here, t_i[None, :], t)

    eg = tl.exp(gamma)
    uv = tl.dot(t, v * beta[:, None], input_precision=IEEE)
    w = tl.dot(t, k * (beta * eg)[:, None], input_precision=IEEE)
    v_new = uv - tl.dot(w, S, input_precision=IEEE)
    qk = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=IEEE) * decay, 0.0)
    o = tl.dot(q * eg[:, None], S, input_precision=IEEE) + tl.dot(qk, v_new, input_precision=IEEE)

    last = tl.sum(tl.where(rows == C - 1, gamma, 0.0), 0)              # Gamma_C-1 (exact: one non-zero term)
    k_end = k * tl.exp(last - gamma)[:, None]
    moved = tl.exp(last) * S + tl.dot(tl.trans(k_end), v_new, input_precision=IEEE)
    return o, tl.where(n == C, moved, S), gamma, uv, w


@triton.jit(do_not_specialize=["J", "B"])
def delta_fwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, n_ptr, s0_ptr, o_ptr, states_ptr, gamma_ptr, u_ptr,
                     J, B, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, STORE_STATES: tl.constexpr, STORE_U: tl.constexpr):
    """Program (b, h): chunks j = 0 .. J-1 of sequence b, head h, in order (module docstring)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    smask = (ck < DK)[:, None] & (cv < DV)[None, :]
    s_off = ck[:, None] * DV + cv[None, :]
    S = tl.load(s0_ptr + (b * H + h) * DK * DV + s_off, mask=smask, other=0.0)
    for j in range(J):
        item = (j * B + b) * H + h
        n = tl.load(n_ptr + j * B + b)
        o, S, gamma, uv, w = _chunk_terms(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, item, n, S, DK, DV, C, BK, BV)
        rmask = rows < n
        tl.store(o_ptr + (item * C + rows[:, None]) * DV + cv[None, :], o,
                 mask=rmask[:, None] & (cv < DV)[None, :])
        if STORE_STATES:
            tl.store(states_ptr + item * DK * DV + s_off, S, mask=smask)
        if STORE_U:   # per row: Gamma, then U = [Uv | W] (ops.gated_delta.delta_chunks' ``gamma``, ``u``)
            tl.store(gamma_ptr + item * C + rows, gamma, mask=rmask)
            u_row = (item * C + rows[:, None]) * (DV + DK)
            tl.store(u_ptr + u_row + cv[None, :], uv, mask=rmask[:, None] & (cv < DV)[None, :])
            tl.store(u_ptr + u_row + DV + ck[None, :], w, mask=rmask[:, None] & (ck < DK)[None, :])


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
                               dummy if gamma is None else gamma, dummy if u is None else u, j, bsz, H=h, DK=dk, DV=dv,
                               C=c, BK=_block(dk), BV=_block(dv), STORE_STATES=store_states, STORE_U=store_u,
                               num_warps=4)
    return out, states, gamma, u


__all__ = ["delta_chunks_forward", "delta_fwd_kernel"]
