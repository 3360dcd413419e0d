"""Portable causal attention: packed varlen (trainer) and paged KV (rollout), the same bits for a query either way.

Per query row (token t at absolute position p of its sequence, query head h, kv head h // (Hq / Hkv)), over the
keys u = 0 .. L-1 of the sequence's context (L >= p + 1; keys past p are masked):

    s_u  = tree_sum_d(q[d] * k_u[d]) * scale          (fp32, scale rounded to fp32; masked: -inf)
    m    = max_u s_u + 0.0
    e_u  = exp(s_u - m)  (arith.exp; masked: +0)
    l    = tree_sum_u(e_u)
    a[d] = tree_sum_u(e_u * v_u[d])                   (masked or padded keys: e_u = 0, v_u finite)
    out  = a / l + 0.0,  rounded once to q's dtype

Why prefill == decode == packed: the tree over u is indexed by absolute key position from 0, and a balanced
pairwise tree gives the same bits when zeros are appended at the end (every node sums the same key positions
plus zeros), so the context length L a call happens to use (the whole packed sequence, the paged context) does
not matter; the max is exact. ``+ 0.0`` maps a -0.0 (from 0 * negative v) to +0.0, the only other freedom.
So one call handles every sequence at once: each query row gathers its own context's key rows (packed: from its
sequence's start; paged: through the block table) up to the largest position of its chunk of rows.
Sliding windows and sinks are refused (gpt-oss is outside the portable profile).
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import fail
from rlalign.ops.portable import arith
from rlalign.reductions import tree_sum

# elements of one [rows, Hq, L, D] product tensor (memory only: no bit depends on it)
CHUNK_ELEMS = {"cuda": 1 << 27}
DEFAULT_CHUNK_ELEMS = 1 << 22


def _refuse_window_sinks(op: str, window, sinks, q=None, v=None) -> None:
    if window is not None or sinks is not None:
        raise fail(op, "sliding-window / sink attention is not implemented in the portable profile")
    if v is not None and v.shape[-1] != q.shape[-1]:
        raise fail(op, f"V's head_dim {v.shape[-1]} differs from Q/K's {q.shape[-1]}: not implemented in the "
                       "portable profile")


def attend_rows(q: torch.Tensor, q_pos: list[int], keys, k_rows: torch.Tensor, v_rows: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Causal attention of queries q [n, Hq, D] at positions ``q_pos`` (host ints) -> [n, Hq, D] in q's dtype (the
    module doc's formula). ``keys(rows, u)`` gives, for the query rows ``rows`` (a slice) and key positions ``u``
    [L], the index [m, L] of each key's row in k_rows / v_rows [N, Hkv, D] (any index where u > the row's position:
    those keys are masked and zeroed). Rows are processed in chunks (memory only), every sequence of the call at
    once, over the keys 0 .. the chunk's largest position (the tree's zero padding invariance: no bit changes)."""
    n, hq, d = q.shape
    hkv = k_rows.shape[1]
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    group = hq // hkv
    pos = torch.tensor(q_pos, device=q.device)
    budget = CHUNK_ELEMS.get(q.device.type, DEFAULT_CHUNK_ELEMS)
    step = max(1, budget // max(1, hq * (max(q_pos) + 1) * d))
    for r in range(0, n, step):
        rows = slice(r, r + step)
        u = torch.arange(max(q_pos[rows]) + 1, device=q.device)
        seen = u.unsqueeze(0) <= pos[rows].unsqueeze(1)                                # [m, L]
        index = torch.where(seen, keys(rows, u), 0)   # masked keys read row 0: their scores are masked below,
        m, length = index.shape                          # their values zeroed (a cache row may hold anything)
        kf = k_rows[index].float().permute(0, 2, 1, 3).unsqueeze(2)                    # [m, Hkv, 1, L, D]
        vf = torch.where(seen[:, :, None, None], v_rows[index].float(), 0.0)
        vf = vf.permute(0, 2, 3, 1).unsqueeze(2)                                       # [m, Hkv, 1, D, L]
        qf = q[rows].float().view(m, hkv, group, 1, d)        # query head h = kv head h // group, in order
        s = arith.dot(qf, kf).reshape(m, hq, length) * float(scale)                   # [m, Hq, L]
        s = torch.where(seen.unsqueeze(1), s, float("-inf"))
        e = arith.exp(s - (s.amax(-1, keepdim=True) + 0.0))   # + 0.0: a max of -0.0 / +0.0 is +0.0
        e = torch.where(seen.unsqueeze(1), e, 0.0)
        total = tree_sum(e)                                                            # [m, Hq]
        acc = arith.dot(e.view(m, hkv, group, 1, length), vf).reshape(m, hq, d)        # [m, Hq, D]
        out[rows] = (arith.div(acc, total.unsqueeze(-1)) + 0.0).to(q.dtype)
    return out


def attention_varlen(q, k, v, cu_seqlens, scale: float, window=None, sinks=None):
    """ops.attention_varlen in the portable profile (forward only): token t of a sequence starting at row a sees
    the rows a .. t."""
    _refuse_window_sinks("attention_varlen", window, sinks, q, v)
    cu = cu_seqlens.tolist()
    starts, q_pos = [], []
    for a, b in zip(cu[:-1], cu[1:]):
        starts += [a] * (b - a)
        q_pos += range(b - a)
    start = torch.tensor(starts, device=q.device, dtype=torch.int64)
    return attend_rows(q, q_pos, lambda rows, u: start[rows].unsqueeze(1) + u, k, v, scale)


def attention_paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float, window=None, sinks=None):
    """ops.attention_paged in the portable profile: the queries of sequence s are the last positions of its
    context, whose key u lives in page block_table[s, u // page_size] at offset u % page_size."""
    _refuse_window_sinks("attention_paged", window, sinks, q, v_cache)
    page = k_cache.shape[1]
    lens, cu = seq_lens.tolist(), cu_seqlens_q.tolist()
    seq_of_row, q_pos = [], []
    for s, length in enumerate(lens):
        n = cu[s + 1] - cu[s]
        seq_of_row += [s] * n
        q_pos += range(length - n, length)
    tables = block_table.long()[torch.tensor(seq_of_row, device=q.device, dtype=torch.int64)]   # [n, pages]

    def keys(rows, u):
        pages = tables[rows].gather(1, (u // page).clamp(max=tables.shape[1] - 1).expand(tables[rows].shape[0], -1))
        return pages * page + u % page

    flat = (-1, *k_cache.shape[2:])
    return attend_rows(q, q_pos, keys, k_cache.reshape(flat), v_cache.reshape(flat), scale)
