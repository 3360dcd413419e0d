"""The varlen backward: flash-style, probabilities recomputed from the forward's saved log-sum-exp.

Deterministic run to run (fixed-shape GEMMs, no atomics, no index_add) but, like dW of a linear, not
invariant to how sequences are packed.
"""

from __future__ import annotations

import torch

from rlalign.ops.torch_backend.attention.formula import ext_rows
from rlalign.ops.torch_backend.attention.plan import KV_BLOCK
from rlalign.reductions import tree_sum

# The varlen backward works on [groups, rows, 64] fp32 score tiles; groups are chunked so that
# one such temporary holds about this many elements (memory only; fixed by the shapes).
_BWD_ELEMS = 1 << 23


def _take(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows[index] for a [R, ...] table and an integer index of any shape (index_select: a plain
    row copy, several times faster on the CPU than advanced indexing)."""
    return rows.index_select(0, index.reshape(-1)).view(*index.shape, *rows.shape[1:])


def _length_buckets(length: torch.Tensor) -> list[torch.Tensor]:
    """Sequences grouped by ceil(log2(key blocks)), each sorted by length (descending): padding
    every sequence of a bucket to its longest costs at most 2x."""
    blocks = (length + KV_BLOCK - 1) // KV_BLOCK
    key = torch.ceil(torch.log2(blocks.clamp(min=1).double())).long()
    key = torch.where(length > 0, key, -1)
    order = torch.argsort(length, descending=True, stable=True)
    return [order[key[order] == b] for b in sorted(set(key.tolist())) if b >= 0]


def _backward_bucket(seqs, start, length, src, grads, hq: int, hkv: int, scale: float, window: int | None):
    """Flash-style backward for sequences ``seqs`` (sorted by length, descending).

    Layout: group (sequence, kv head) x its rows (token-major, g heads each), padded to the
    bucket's longest sequence. Per key block j, only rows at positions >= 64 j and sequences
    longer than 64 j take part; every reduction is a fixed-shape GEMM (no atomics).
    """
    qf, kf, vf, dof, lse_f, delta_f = src
    dq, dk, dv = grads
    g, d, dev = hq // hkv, qf.shape[1], qf.device
    st, ln = start[seqs], length[seqs]
    longest = int(ln[0])
    n_blocks = (longest + KV_BLOCK - 1) // KV_BLOCK
    n_groups, n_rows, n_keys = seqs.numel() * hkv, longest * g, n_blocks * KV_BLOCK
    r = torch.arange(n_rows, device=dev)
    tok, head_in_group = r // g, r % g
    heads = torch.arange(hkv, device=dev).view(1, hkv, 1)
    row_ok = (tok < ln.unsqueeze(1)).unsqueeze(1)                                   # [Sb, 1, R]
    q_idx = (st.view(-1, 1, 1) + tok) * hq + heads * g + head_in_group
    q_idx = torch.where(row_ok, q_idx, qf.shape[0] - 1).reshape(n_groups, n_rows)
    row_pos = torch.where(row_ok, tok, -1).expand(-1, hkv, -1).reshape(n_groups, n_rows)
    kpos = torch.arange(n_keys, device=dev)
    key_ok = (kpos < ln.unsqueeze(1)).unsqueeze(1)
    k_idx = torch.where(key_ok, (st.view(-1, 1, 1) + kpos) * hkv + heads, kf.shape[0] - 1)
    k_idx = k_idx.reshape(n_groups, n_keys)
    qp, dop, lse, delta = _take(qf, q_idx), _take(dof, q_idx), _take(lse_f, q_idx), _take(delta_f, q_idx)
    kp, vp = _take(kf, k_idx), _take(vf, k_idx)
    dqp = torch.zeros_like(qp)
    dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)
    active = [int((ln > j * KV_BLOCK).sum()) * hkv for j in range(n_blocks)]
    for j in range(n_blocks):
        r0, k0 = j * KV_BLOCK * g, j * KV_BLOCK
        # groups in chunks so that a [groups, rows, 64] fp32 temporary stays near _BWD_ELEMS
        step = max(1, _BWD_ELEMS // ((n_rows - r0) * KV_BLOCK))
        for c0 in range(0, active[j], step):
            c = slice(c0, min(active[j], c0 + step))
            qs, dos = qp[c, r0:], dop[c, r0:]
            kb, vb = kp[c, k0:k0 + KV_BLOCK], vp[c, k0:k0 + KV_BLOCK]
            s = torch.bmm(qs, kb.transpose(1, 2)) * scale
            visible = kpos[k0:k0 + KV_BLOCK] <= row_pos[c, r0:].unsqueeze(-1)
            if window is not None:   # keys p - window < pos <= p (padding rows, p = -1, see none)
                visible &= kpos[k0:k0 + KV_BLOCK] > row_pos[c, r0:].unsqueeze(-1) - window
            p = torch.where(visible, torch.exp(s - lse[c, r0:].unsqueeze(-1)), 0.0)
            dvp[c, k0:k0 + KV_BLOCK] = torch.bmm(p.transpose(1, 2), dos)
            ds = p * (torch.bmm(dos, vb.transpose(1, 2)) - delta[c, r0:].unsqueeze(-1))
            dqp[c, r0:] += torch.bmm(ds, kb) * scale
            dkp[c, k0:k0 + KV_BLOCK] = torch.bmm(ds.transpose(1, 2), qs) * scale
    # every real row belongs to exactly one group: plain (unique-index) writes; padding -> dump row
    dq.index_copy_(0, q_idx.reshape(-1), dqp.reshape(-1, d))
    dk.index_copy_(0, k_idx.reshape(-1), dkp.reshape(-1, d))
    dv.index_copy_(0, k_idx.reshape(-1), dvp.reshape(-1, d))


def varlen_backward(q, k, v, out, lse, cu_seqlens, grad_out, scale: float, window: int | None = None,
                    sinks: torch.Tensor | None = None, bucket_route=None):
    """(dq, dk, dv, dsinks). ``lse`` is the sink-inclusive log-sum-exp, so the keys' probabilities are the
    forward's; a sink is a key whose value is 0: d sink_h = -sum_t exp(sink_h - lse[t, h]) delta[t, h]
    (summed over tokens by a balanced tree).

    ``bucket_route(seqs, start, length, src, grads, hq, hkv, scale, window) -> bool``, when given, may compute
    a length bucket itself with exactly :func:`_backward_bucket`'s bits (the compiled kernel,
    :mod:`.compiled_backward`); a bucket it declines (False) runs :func:`_backward_bucket`."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    start, length = cu[:-1], cu[1:] - cu[:-1]
    delta = (grad_out.float() * out.float()).sum(-1)                       # [T, Hq]
    lse_rows = torch.cat([lse.reshape(-1), lse.new_zeros(1)])
    delta_rows = torch.cat([delta.reshape(-1), delta.new_zeros(1)])
    src = (ext_rows(q), ext_rows(k), ext_rows(v), ext_rows(grad_out), lse_rows, delta_rows)
    grads = (q.new_zeros((t * hq + 1, d), dtype=torch.float32),
             k.new_zeros((t * hkv + 1, d), dtype=torch.float32),
             v.new_zeros((t * hkv + 1, d), dtype=torch.float32))
    for seqs in _length_buckets(length):
        if bucket_route is not None and bucket_route(seqs, start, length, src, grads, hq, hkv, scale, window):
            continue
        _backward_bucket(seqs, start, length, src, grads, hq, hkv, scale, window)
    dq, dk, dv = grads
    dsinks = None
    if sinks is not None:
        p_sink = torch.exp(sinks.float().unsqueeze(0) - lse)                   # [T, Hq]
        dsinks = (-tree_sum((p_sink * delta).t().contiguous())).to(sinks.dtype) if t else torch.zeros_like(sinks)
    return (dq[:-1].reshape(q.shape).to(q.dtype), dk[:-1].reshape(k.shape).to(k.dtype),
            dv[:-1].reshape(v.shape).to(v.dtype), dsinks)
