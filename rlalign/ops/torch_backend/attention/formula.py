"""The torch formulation of strict attention: the online softmax over a plan's items, key block by key block.

The arithmetic is the formula of :mod:`rlalign.ops.torch_backend.attention` (its module docstring); this
module runs it with torch ops for the packed (varlen) forward and the paged forward, on a plan of
:mod:`.plan`. On GPUs every bmm is padded to one fixed batch count (``GPU_BATCH``); rows that are padding in
every tile of a chunk are not pushed through the elementwise math (:func:`_online_softmax`).
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import fail
from rlalign.ops import _checks as chk
from rlalign.ops.torch_backend.attention.gemms import item_gemm
from rlalign.ops.torch_backend.attention.plan import (GPU_BATCH, KV_BLOCK, Q_TILE, Plan, block_data, build_plan,
                                                      packed_rows, paged_rows)
from rlalign.ops.torch_backend.attention.scratch import scratch_buffer
from rlalign.reductions import tree_sum

NONFINITE_CACHE = "k_cache/v_cache contain NaN or inf within a sequence's context (or the scores overflow fp32)"


def _pad_batch(x: torch.Tensor) -> torch.Tensor:
    padded = x.new_zeros((GPU_BATCH,) + tuple(x.shape[1:]))
    padded[:x.shape[0]] = x
    return padded


def _bmm(a: torch.Tensor, b: torch.Tensor, transpose_b: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 a @ b (or a @ b^T) per item; on GPUs issued as one bmm of exactly GPU_BATCH items
    (``out`` unused there); on the CPU the library's bmm where its items are row invariant for this shape
    here, else the compiled kernel per item (:mod:`.gemms`)."""
    n = a.shape[0]
    if a.device.type != "cpu":
        a, b = _pad_batch(a), _pad_batch(b)
        return torch.bmm(a, b.transpose(1, 2) if transpose_b else b)[:n]
    return item_gemm(a, b, transpose_b, out)


def _gather(table: torch.Tensor, rows: torch.Tensor, inside: torch.Tensor | None, name: str,
            shape: tuple) -> torch.Tensor:
    """fp32 [c, 64, D] key (or value) block: ``table[rows]``, or with ``inside`` (rows of the slots
    inside the contexts) ``[table[inside]; 0][rows]``: the slots outside the contexts are exact zeros
    (a select; never a multiplication by 0)."""
    d, dev = shape[-1], table.device
    if inside is not None:
        small = scratch_buffer(name + "_in", (inside.numel() + 1, d), dev)
        if table.dtype == torch.float32:
            torch.index_select(table, 0, inside, out=small[:-1])
        else:
            small[:-1] = table.index_select(0, inside)
        small[-1] = 0.0
        table = small
    out = scratch_buffer(name, shape, dev)
    if table.dtype == torch.float32:
        torch.index_select(table, 0, rows, out=out.view(-1, d))
    else:
        out.view(-1, d).copy_(table.index_select(0, rows))
    return out


def _online_softmax(plan: Plan, q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, scale: float,
                    check_keys: bool, out_rows: torch.Tensor, lse_rows: torch.Tensor | None,
                    sink_rows: torch.Tensor | None = None) -> bool:
    """Every key block over the plan's items, chunk by chunk (the formula of
    :mod:`rlalign.ops.torch_backend.attention`). Writes acc / l + 0.0 of rows < r into ``out_rows``
    [T * Hq + 1, D] (and m + log(l) into ``lse_rows``); the last row is the dump row of padding rows. With
    ``check_keys`` returns whether a score or accumulator sum was non-finite (a non-finite K/V within a
    context, or an overflow).

    Rows >= r of a chunk's tiles are padding in every tile (q = 0; they see every key). With finite
    keys their scores are +-0, so p = exp(+-0 - +-0) = 1 for every key of every block, m = +-0 and
    alpha = 1 after block 0 (alpha = 0 at block 0, against an accumulator of 0): their p rows are set
    to 1 rather than computed, and only the p @ V GEMM (whose operand keeps all 16 rows: the library
    call is unchanged) and the accumulator (read by the finiteness check) carry them, up to the sign
    of zeros, which no check can see; their results are dropped. A non-finite key within a context
    makes the score sum non-finite (that check is on the full tiles), so it is reported either way.
    Rows < r are computed exactly as the formula says.

    ``sink_rows`` [T * Hq + 1] fp32 (attention sinks: one extra logit per query head, no value): after the
    last key block every row folds its sink in as one more online-softmax step, m' = max(m, sink),
    l' = l exp(m - m') + exp(sink - m'), acc' = acc exp(m - m'); lse is then the sink-inclusive one.
    """
    d, dev = q_rows.shape[1], q_rows.device
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    for ch in plan.chunks:
        n, r = ch.b - ch.a, ch.r
        if r == Q_TILE:
            qt = torch.index_select(q_rows, 0, ch.q_src,
                                    out=scratch_buffer("q", (n * Q_TILE, d), dev)).view(n, Q_TILE, d)
        else:  # rows >= r are padding (q = 0) in every tile of the chunk: only rows < r are gathered
            qt = scratch_buffer("q", (n, Q_TILE, d), dev, fill=(0.0, r))
            qt[:, :r] = q_rows.index_select(0, ch.dest).view(n, r, d)
        m = torch.full((n, r), float("-inf"), device=dev)
        l = torch.zeros((n, r), device=dev)
        acc = None
        for blk in ch.blocks:
            c = blk.c
            rows, inside, mask, sees = block_data(plan, ch, blk)
            k = _gather(k_rows, rows, inside, "k", (c, KV_BLOCK, d))
            v = _gather(v_rows, rows, inside, "v", (c, KV_BLOCK, d))
            raw = _bmm(qt[:c], k, transpose_b=True, out=scratch_buffer("s", (c, Q_TILE, KV_BLOCK), dev))
            raw.mul_(scale)
            if check_keys:
                # a non-finite key in a context makes its whole score column non-finite
                bad |= ~torch.isfinite(raw.sum())
            s = raw[:, :r]
            if mask is not None:  # some row does not see the whole block
                s = torch.where(mask, s, float("-inf"))
            m_old, l_old = m[:c], l[:c]
            m_new = torch.maximum(m_old, s.amax(-1))
            # Without a window every real row sees block 0 and padding rows see every block, so a row that
            # cannot see this block has a finite m and all-(-inf) scores: m_new = m, p = 0, alpha = 1 (no
            # NaN). With a window a row may see no block yet (m = -inf): its NaNs are discarded by ``sees``.
            if r == Q_TILE:
                p_full = scratch_buffer("p", (c, Q_TILE, KV_BLOCK), dev)
                p = torch.exp_(torch.sub(s, m_new.unsqueeze(-1), out=p_full))
            else:
                p_full = scratch_buffer("p", (c, Q_TILE, KV_BLOCK), dev, fill=(1.0, r))
                p = torch.exp_(s - m_new.unsqueeze(-1))
                p_full[:, :r] = p
            alpha = torch.exp_(m_old - m_new)
            l_new = l_old * alpha + tree_sum(p)
            acc_new = _bmm(p_full, v)
            if acc is None:   # block 0: acc = 0 before it (padding rows: 0 * 0, a zero's sign at most)
                acc_new[:, :r] += (0.0 * alpha).unsqueeze(-1)
            else:
                acc_new[:, :r] += acc[:c, :r] * alpha.unsqueeze(-1)   # == acc * alpha + p @ v (IEEE add commutes)
                if r < Q_TILE:
                    acc_new[:, r:] += acc[:c, r:]                       # padding rows: alpha = 1
            if sees is not None:
                # rows that cannot see the block keep their state bits: selected, not multiplied by 1 + 0
                m_new = torch.where(sees, m_new, m_old)
                l_new = torch.where(sees, l_new, l_old)
                acc_old = acc[:c, :r] if acc is not None else 0.0   # block 0 (windows only): the fresh state
                acc_new[:, :r] = torch.where(sees.unsqueeze(-1), acc_new[:, :r], acc_old)
            if c == n:
                m, l, acc = m_new, l_new, acc_new
            else:
                m[:c], l[:c], acc[:c] = m_new, l_new, acc_new
        if check_keys:
            # a non-finite value reaches the accumulator of its sequence's last row (it sees every key)
            bad |= ~torch.isfinite(acc.sum())
        if sink_rows is not None:
            m, l, acc = _fold_sinks(sink_rows.index_select(0, ch.dest).view(n, r), m, l, acc, r)
        res = torch.div(acc[:, :r], l.unsqueeze(-1))
        res += 0.0
        out_rows.index_copy_(0, ch.dest, res.reshape(-1, d))
        if lse_rows is not None:
            lse_rows.index_copy_(0, ch.dest, (m + torch.log(l)).reshape(-1))
    return check_keys and bool(bad)


def _fold_sinks(sink: torch.Tensor, m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, r: int):
    """The sink as one more online-softmax step (a logit with a zero value): every real row has seen its own
    key, so m is finite and so is m' = max(m, sink)."""
    m_f = torch.maximum(m, sink)
    alpha = torch.exp(m - m_f)
    l = l * alpha + torch.exp(sink - m_f)
    acc = acc.clone()
    acc[:, :r] = acc[:, :r] * alpha.unsqueeze(-1)
    return m_f, l, acc


def sink_table(sinks: torch.Tensor, t: int) -> torch.Tensor:
    """sinks [Hq] -> fp32 [T * Hq + 1]: row (token, head) gets sinks[head]; the dump row 0."""
    return torch.cat([sinks.float().repeat(t), sinks.new_zeros(1, dtype=torch.float32)])


def ext_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> fp32 [T * H + 1, D], the extra last row all zeros (target of masked indices)."""
    d = x.shape[-1]
    return torch.cat([x.reshape(-1, d).float(), x.new_zeros((1, d), dtype=torch.float32)])


def varlen_formula(q, k, v, cu_seqlens, scale: float, window: int | None = None, sinks: torch.Tensor | None = None):
    t, hq, d = q.shape
    hkv = k.shape[1]

    def build():
        cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
        start, length = cu[:-1], cu[1:] - cu[:-1]
        return build_plan(hq, hkv, d, length, start, torch.zeros_like(start), t,
                           packed_rows(start, length, hkv, t * hkv), zero_outside=False, window=window)

    plan = chk.memo("torch_attention_varlen_plan", build, cu_seqlens, extra=(t, hq, hkv, d, q.device, window),
                    capturing=build)
    out = torch.empty((t * hq + 1, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((t * hq + 1,), dtype=torch.float32, device=q.device)
    sink_rows = None if sinks is None else sink_table(sinks, t)
    _online_softmax(plan, ext_rows(q), ext_rows(k), ext_rows(v), scale, False, out, lse, sink_rows)
    return out[:t * hq].reshape(t, hq, d).to(q.dtype), lse[:t * hq].reshape(t, hq)


def paged_formula(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float, window: int | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    t, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    dev = q.device

    def build():
        cu = cu_seqlens_q.to(device=dev, dtype=torch.int64)
        ctx_len = seq_lens.to(device=dev, dtype=torch.int64)
        n_q = cu[1:] - cu[:-1]
        table = block_table.to(device=dev, dtype=torch.int64)
        return build_plan(hq, hkv, d, n_q, cu[:-1], ctx_len - n_q, t, paged_rows(table, ctx_len, page_size, hkv),
                           zero_outside=True, window=window)

    # one plan per forward: every layer (of one window) gets the same index tensors
    plan = chk.memo("torch_attention_paged_plan", build, block_table, seq_lens, cu_seqlens_q,
                    extra=(t, hq, hkv, d, page_size, dev, window), capturing=build)
    q_rows = torch.cat([q.reshape(t * hq, d).float(), q.new_zeros((1, d), dtype=torch.float32)])
    out = torch.empty((t * hq + 1, d), dtype=torch.float32, device=dev)
    sink_rows = None if sinks is None else sink_table(sinks, t)
    if _online_softmax(plan, q_rows, k_cache.reshape(-1, d), v_cache.reshape(-1, d), scale, True, out, None,
                       sink_rows):
        raise fail("attention_paged", NONFINITE_CACHE)
    return out[:t * hq].reshape(t, hq, d).to(q.dtype)
