"""Portable causal attention: packed varlen (trainer) and paged KV (rollout), the same bits for a query either way.

Per query row (token t at absolute position p of its sequence, query head h, kv head h // (Hq / Hkv)), over the
keys u = 0 .. L-1 of the sequence's context (L >= p + 1; keys past p are masked):

    s_u  = tree_sum_d(q[d] * k_u[d]) * scale          (fp32, scale rounded to fp32; masked: -inf)
    m    = max_u s_u
    e_u  = exp(s_u - m)  (arith.exp; masked: +0)
    l    = tree_sum_u(e_u)
    a[d] = tree_sum_u(e_u * v_u[d])                   (masked or padded keys: e_u = 0, v_u finite)
    out  = a / l + 0.0,  rounded once to q's dtype

Why prefill == decode == packed: the tree over u is indexed by absolute key position from 0, and a balanced
pairwise tree gives the same bits when zeros are appended at the end (every node sums the same key positions
plus zeros), so the context length L a call happens to use (the whole packed sequence, the paged context) does
not matter; the max is exact. ``+ 0.0`` maps a -0.0 (from 0 * negative v) to +0.0, the only other freedom.
Sliding windows and sinks are refused (gpt-oss is outside the portable profile).
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import fail
from rlalign.ops.portable import arith
from rlalign.reductions import tree_sum

# elements of one [rows, Hq, L, D] product tensor (memory only)
CHUNK_ELEMS = {"cuda": 1 << 27}
DEFAULT_CHUNK_ELEMS = 1 << 22


def _refuse_window_sinks(op: str, window, sinks) -> None:
    if window is not None or sinks is not None:
        raise fail(op, "sliding-window / sink attention is not implemented in the portable profile")


def attend_rows(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of queries q [n, Hq, D] at positions q_pos [n] (int64) over one sequence's keys and
    values k, v [L, Hkv, D] at positions 0..L-1 -> [n, Hq, D] in q's dtype (the module doc's formula)."""
    n, hq, d = q.shape
    length, hkv = k.shape[0], k.shape[1]
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    heads = torch.arange(hq, device=q.device) // (hq // hkv)
    kf = k.float().index_select(1, heads).permute(1, 0, 2)         # [Hq, L, D]
    vf = v.float().index_select(1, heads).permute(1, 2, 0)         # [Hq, D, L]
    key_pos = torch.arange(length, device=q.device)
    budget = CHUNK_ELEMS.get(q.device.type, DEFAULT_CHUNK_ELEMS)
    rows = max(1, budget // max(1, hq * length * d))
    for r in range(0, n, rows):
        qf = q[r:r + rows].float()
        seen = key_pos.unsqueeze(0) <= q_pos[r:r + rows].unsqueeze(1)               # [m, L]
        s = arith.dot(qf.unsqueeze(2), kf.unsqueeze(0)) * float(scale)               # [m, Hq, L]
        s = torch.where(seen.unsqueeze(1), s, float("-inf"))
        e = arith.exp(s - (s.amax(-1, keepdim=True) + 0.0))   # + 0.0: a max of -0.0 / +0.0 is +0.0
        e = torch.where(seen.unsqueeze(1), e, 0.0)
        total = tree_sum(e)                                                           # [m, Hq]
        acc = arith.dot(e.unsqueeze(2), vf.unsqueeze(0))                              # [m, Hq, D]
        out[r:r + rows] = (arith.div(acc, total.unsqueeze(-1)) + 0.0).to(q.dtype)
    return out


def attention_varlen(q, k, v, cu_seqlens, scale: float, window=None, sinks=None):
    """ops.attention_varlen in the portable profile (forward only)."""
    _refuse_window_sinks("attention_varlen", window, sinks)
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        if b > a:
            pos = torch.arange(b - a, device=q.device)
            out[a:b] = attend_rows(q[a:b], pos, k[a:b], v[a:b], scale)
    return out


def attention_paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float, window=None, sinks=None):
    """ops.attention_paged in the portable profile: each sequence's context gathered from its pages (exact
    copies), its queries at the last positions of the context, then :func:`attend_rows`."""
    _refuse_window_sinks("attention_paged", window, sinks)
    page = k_cache.shape[1]
    out = torch.empty_like(q)
    lens, cu = seq_lens.tolist(), cu_seqlens_q.tolist()
    for s, length in enumerate(lens):
        a, b = cu[s], cu[s + 1]
        if b == a:
            continue
        pages = block_table[s, :-(-length // page)].long()
        k = k_cache.index_select(0, pages).reshape(-1, *k_cache.shape[2:])[:length]
        v = v_cache.index_select(0, pages).reshape(-1, *v_cache.shape[2:])[:length]
        pos = torch.arange(length - (b - a), length, device=q.device)
        out[a:b] = attend_rows(q[a:b], pos, k, v, scale)
    return out
