"""Strict attention on the torch backend: packed varlen (training) and paged KV (rollout).

Both entry points run the same per-row arithmetic, so a query's output has the same bits in a
packed training forward, a one-shot or chunked prefill, and step-by-step decode:

* Work items. Each sequence's query rows, one row per (query token, query head), are grouped by
  kv head (GQA: the ``g = Hq // Hkv`` heads of one kv head, token-major) and cut into tiles of
  exactly ``ATTN_Q_TILE`` = 16 rows, zero-padded. An item is one (sequence, kv head, tile).
* Keys are visited in blocks of ``ATTN_KV_BLOCK`` = 64 ABSOLUTE positions (0..63, 64..127, ...),
  whatever the page size. Per key block j, for all items that need it at once (Python loops over
  j and over chunks of items only; chunks bound memory, a bmm item's bits do not depend on them):

      s     = bmm(Q_tile[16, D], K_j^T[D, 64]) * scale                          (fp32)
      s     = where(key_pos <= row_pos, s, -inf)      K_j / V_j rows outside the context are 0
      m'    = max(m, rowmax(s));  p = exp(s - m');  alpha = exp(m - m')
      l'    = l * alpha + tree_sum(p)
      acc'  = acc * alpha + bmm(p[16, 64], V_j[64, D])                          (fp32)
      (m, l, acc) = where(row_pos >= 64 j, (m', l', acc'), (m, l, acc))

  A block a row cannot see at all leaves its state untouched (selected, not multiplied by 1).
* out = acc / l + 0.0, rounded once to the input dtype. The ``+ 0.0`` maps -0.0 to +0.0 and
  changes nothing else: keys past a row's position but inside the block contribute 0 * V, whose
  sign of zero depends on whether V is a real row (packed forward) or a masked 0 (decode).

What is left to the libraries (a bmm of fixed per-item shapes gives an item the same bits whatever
its index, the row's position in the tile and the other rows; exp is position invariant) is listed
in :func:`rlalign.contract.spec.cpu_backend_assumptions` and checked by ``rlalign doctor``. On the
CPU the bmm batch count may vary too (MKL, checked); on GPUs every bmm is padded to one fixed
batch count, because cuBLAS chooses kernels by batch count.

The varlen backward (:class:`_VarlenAttention`) recomputes probabilities flash-style from the
saved log-sum-exp; it is deterministic run to run (fixed-shape GEMMs, no atomics, no
index_add) but, like dW of a linear, not invariant to how sequences are packed.
"""

from __future__ import annotations

import dataclasses

import torch

from rlalign.contract import spec
from rlalign.contract.errors import fail
from rlalign.ops._dispatch import register
from rlalign.ops.torch_backend.primitives import tree_sum

KV_BLOCK = spec.ATTN_KV_BLOCK
Q_TILE = spec.ATTN_Q_TILE
# Items per bmm chunk on the CPU are capped so that a gathered fp32 key block holds at most this
# many elements (cache sized). Speed and memory only.
_CHUNK_ELEMS = 1 << 20
# On GPUs every bmm is issued with exactly this many items (zero padded): cuBLAS picks its kernel
# by batch count (measured on an H200, torch 2.11: an item's bits differ between batch counts 1,
# 16, 64 and 4096), so the library must only ever see one shape. MKL's bmm on the CPU is batch-count
# invariant (spec.cpu_backend_assumptions, checked by `rlalign doctor`) and runs unpadded.
_GPU_BATCH = 1024
# The varlen backward works on [groups, rows, 64] fp32 score tiles; groups are chunked so that
# one such temporary holds about this many elements (memory only; fixed by the shapes).
_BWD_ELEMS = 1 << 23


def _take(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows[index] for a [R, ...] table and an integer index of any shape (index_select: a plain
    row copy, several times faster on the CPU than advanced indexing)."""
    return rows.index_select(0, index.reshape(-1)).view(*index.shape, *rows.shape[1:])


def _pad_batch(x: torch.Tensor) -> torch.Tensor:
    padded = x.new_zeros((_GPU_BATCH,) + tuple(x.shape[1:]))
    padded[:x.shape[0]] = x
    return padded


def _bmm(a: torch.Tensor, b: torch.Tensor, transpose_b: bool = False) -> torch.Tensor:
    """fp32 a @ b (or a @ b^T) per item; on GPUs issued as one bmm of exactly _GPU_BATCH items."""
    n = a.shape[0]
    if a.device.type != "cpu":
        a, b = _pad_batch(a), _pad_batch(b)
    return torch.bmm(a, b.transpose(1, 2) if transpose_b else b)[:n]


# ---- key sources: where the keys of (sequence, kv head, absolute position) live ---------------

@dataclasses.dataclass
class _PackedKeys:
    """K/V of a packed batch [T, Hkv, D]; sequence s owns rows start[s] .. start[s] + length[s]."""
    k_rows: torch.Tensor   # [T * Hkv + 1, D] fp32, the last row all zeros
    v_rows: torch.Tensor
    start: torch.Tensor    # [S] int64
    length: torch.Tensor   # [S] int64
    hkv: int

    def block(self, seq: torch.Tensor, head: torch.Tensor, pos: torch.Tensor):
        """fp32 K, V [n, 64, D] of items (seq, head) at positions ``pos`` [64]; 0 outside the context."""
        valid = pos < self.length[seq].unsqueeze(1)
        rows = (self.start[seq].unsqueeze(1) + pos) * self.hkv + head.unsqueeze(1)
        rows = torch.where(valid, rows, self.k_rows.shape[0] - 1)
        return _take(self.k_rows, rows), _take(self.v_rows, rows)


@dataclasses.dataclass
class _PagedKeys:
    """K/V in a paged cache [num_pages, page_size, Hkv, D] addressed through a block table."""
    k_rows: torch.Tensor        # the cache viewed as [num_pages * page_size * Hkv, D]
    v_rows: torch.Tensor
    block_table: torch.Tensor   # [S, max_pages] int64
    length: torch.Tensor        # [S] int64 context length
    page_size: int
    hkv: int

    def block(self, seq: torch.Tensor, head: torch.Tensor, pos: torch.Tensor):
        valid = pos < self.length[seq].unsqueeze(1)
        page_col = torch.clamp(pos // self.page_size, max=self.block_table.shape[1] - 1)
        page = self.block_table[seq.unsqueeze(1), page_col.unsqueeze(0)]
        rows = (page * self.page_size + pos % self.page_size) * self.hkv + head.unsqueeze(1)
        rows = torch.where(valid, rows, 0)
        k, v = _take(self.k_rows, rows).float(), _take(self.v_rows, rows).float()
        if not bool(valid.all()):
            # Outside the context the cache may hold anything: those rows become exact zeros
            # (an assignment, i.e. a select; never a multiplication by 0).
            outside = (~valid).nonzero(as_tuple=True)
            k[outside] = 0.0
            v[outside] = 0.0
        return k, v


# ---- work items --------------------------------------------------------------------------------

# Padding rows of a tile (q = 0) are given this position: they "see" every key, so their running
# state stays finite (scores 0) without a special case; their results are dropped.
_PAD_POS = 1 << 62


@dataclasses.dataclass
class _Tiles:
    """Query tiles of all (sequence, kv head, tile) items, sorted by the position of their last
    real row (descending), so that the items needing key block j are the prefix [:block_counts[j]]."""
    q: torch.Tensor          # [N, 16, D] fp32, padding rows 0
    row_pos: torch.Tensor    # [N, 16] int64 absolute position of the row's token; _PAD_POS for padding
    row_dest: torch.Tensor   # [N, 16] int64 row of the flattened [T * Hq] output; T * Hq for padding
    seq: torch.Tensor        # [N] int64
    head: torch.Tensor       # [N] int64 kv head
    block_counts: list[int]


def _build_tiles(q: torch.Tensor, hkv: int, n_q: torch.Tensor, q_start: torch.Tensor,
                 pos0: torch.Tensor) -> _Tiles:
    """Tiles for sequences whose n_q[s] queries are rows q_start[s].. of q, at positions pos0[s].."""
    t, hq, d = q.shape
    g = hq // hkv
    dev = q.device
    tiles = (n_q * g + Q_TILE - 1) // Q_TILE
    per_seq = tiles * hkv
    n_items = int(per_seq.sum())
    seq = torch.repeat_interleave(torch.arange(n_q.numel(), device=dev), per_seq, output_size=n_items)
    local = torch.arange(n_items, device=dev) - (torch.cumsum(per_seq, 0) - per_seq)[seq]
    head, tile = local // tiles[seq], local % tiles[seq]
    r = tile.unsqueeze(1) * Q_TILE + torch.arange(Q_TILE, device=dev)
    tok, head_in_group = r // g, r % g
    valid = tok < n_q[seq].unsqueeze(1)
    pos = pos0[seq].unsqueeze(1) + tok
    last = torch.where(valid, pos, -1).amax(1)
    dest = (q_start[seq].unsqueeze(1) + tok) * hq + head.unsqueeze(1) * g + head_in_group
    dest = torch.where(valid, dest, t * hq)
    order = torch.argsort(last, descending=True, stable=True)
    q_rows = torch.cat([q.reshape(t * hq, d).float(), q.new_zeros((1, d), dtype=torch.float32)])
    dest = dest[order]
    n_blocks = int(last.max()) // KV_BLOCK + 1
    hist = torch.bincount(last // KV_BLOCK, minlength=n_blocks)
    counts = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])
    return _Tiles(_take(q_rows, dest), torch.where(valid, pos, _PAD_POS)[order], dest, seq[order], head[order],
                  counts.tolist())


# ---- the online softmax --------------------------------------------------------------------------

@dataclasses.dataclass
class _State:
    m: torch.Tensor     # [n, 16] running max
    l: torch.Tensor     # [n, 16] running sum of exp
    acc: torch.Tensor   # [n, 16, D] running sum of p * v


def _visit_block(q, row_pos, state: _State, k, v, first_key: int, scale: float) -> tuple[_State, torch.Tensor]:
    """One key block for a chunk of tiles (see the module docstring); returns the new state and
    the raw scaled scores. The `where`s are skipped only where they would select everything."""
    lowest = int(row_pos.min())
    raw = _bmm(q, k, transpose_b=True)
    raw.mul_(scale)
    s = raw
    if lowest < first_key + KV_BLOCK - 1:  # some row does not see the whole block
        key_pos = first_key + torch.arange(KV_BLOCK, device=q.device)
        s = torch.where(key_pos <= row_pos.unsqueeze(-1), raw, float("-inf"))
    m_new = torch.maximum(state.m, s.amax(-1))
    # Every real row sees block 0 and padding rows see every block, so a row that cannot see this
    # block has a finite m and all-(-inf) scores: m_new = m, p = 0, alpha = 1 (no NaN).
    p = torch.exp_(s - m_new.unsqueeze(-1))
    alpha = torch.exp_(state.m - m_new)
    l_new = state.l * alpha + tree_sum(p)
    acc_new = _bmm(p, v)
    acc_new += state.acc * alpha.unsqueeze(-1)          # == acc * alpha + p @ v (IEEE add commutes)
    if lowest >= first_key:
        return _State(m_new, l_new, acc_new), raw
    # rows that cannot see the block keep their state bits: selected, not multiplied by 1 + 0
    sees = row_pos >= first_key
    return _State(torch.where(sees, m_new, state.m), torch.where(sees, l_new, state.l),
                  torch.where(sees.unsqueeze(-1), acc_new, state.acc)), raw


def _chunk_items(d: int, device: torch.device) -> int:
    """Items per chunk: on the CPU the gathered fp32 key block holds at most _CHUNK_ELEMS elements
    (speed and memory only); on GPUs the fixed bmm batch."""
    if device.type != "cpu":
        return _GPU_BATCH
    return max(1, _CHUNK_ELEMS // (KV_BLOCK * d))


def _online_softmax(tiles: _Tiles, keys, scale: float, op: str, check_keys: bool):
    """Runs every key block over the tiles, chunk by chunk of items; returns fp32
    (acc / l + 0.0) [N, 16, D] and the log-sum-exp m + log(l) [N, 16]."""
    n, _, d = tiles.q.shape
    dev = tiles.q.device
    out = torch.empty((n, Q_TILE, d), device=dev)
    lse = torch.empty((n, Q_TILE), device=dev)
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    chunk = _chunk_items(d, dev)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        st = _State(torch.full((b - a, Q_TILE), float("-inf"), device=dev),
                    torch.zeros((b - a, Q_TILE), device=dev), torch.zeros((b - a, Q_TILE, d), device=dev))
        for j, count in enumerate(tiles.block_counts):
            c = min(b, count) - a          # the chunk's items that need block j: a prefix
            if c <= 0:
                break
            pos = j * KV_BLOCK + torch.arange(KV_BLOCK, device=dev)
            k, v = keys.block(tiles.seq[a:a + c], tiles.head[a:a + c], pos)
            part = st if c == b - a else _State(st.m[:c], st.l[:c], st.acc[:c])
            new, raw = _visit_block(tiles.q[a:a + c], tiles.row_pos[a:a + c], part, k, v, j * KV_BLOCK, scale)
            if c == b - a:
                st = new
            else:
                st.m[:c], st.l[:c], st.acc[:c] = new.m, new.l, new.acc
            if check_keys:
                # a non-finite key in a context makes its whole score column non-finite
                bad |= ~torch.isfinite(raw.sum())
        if check_keys:
            # a non-finite value reaches the accumulator of its sequence's last row (it sees every key)
            bad |= ~torch.isfinite(st.acc.sum())
        torch.div(st.acc, st.l.unsqueeze(-1), out=out[a:b])
        out[a:b] += 0.0
        lse[a:b] = st.m + torch.log(st.l)
    if check_keys and bool(bad):
        raise fail(op, "k_cache/v_cache contain NaN or inf within a sequence's context (or the scores overflow fp32)")
    return out, lse


def _scatter_rows(tiles: _Tiles, rows: torch.Tensor, total: int) -> torch.Tensor:
    """Tile rows [N, 16, ...] back to the flattened [total, ...] layout (padding rows dropped)."""
    flat = rows.new_zeros((total + 1,) + tuple(rows.shape[2:]))
    # padding rows all go to the dump row `total`; every real row is written exactly once
    flat.index_copy_(0, tiles.row_dest.reshape(-1), rows.reshape((-1,) + tuple(rows.shape[2:])))
    return flat[:total]


# ---- varlen (training) ----------------------------------------------------------------------------

def _ext_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> fp32 [T * H + 1, D], the extra last row all zeros (target of masked indices)."""
    d = x.shape[-1]
    return torch.cat([x.reshape(-1, d).float(), x.new_zeros((1, d), dtype=torch.float32)])


def _varlen_forward(q, k, v, cu_seqlens, scale: float):
    """Returns (out [T, Hq, D] in q.dtype, lse [T, Hq] fp32)."""
    t, hq, d = q.shape
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    start, length = cu[:-1], cu[1:] - cu[:-1]
    if t == 0:
        return q.new_empty(q.shape), q.new_empty((0, hq), dtype=torch.float32)
    tiles = _build_tiles(q, k.shape[1], length, start, torch.zeros_like(start))
    keys = _PackedKeys(_ext_rows(k), _ext_rows(v), start, length, k.shape[1])
    out, lse = _online_softmax(tiles, keys, scale, "attention_varlen", check_keys=False)
    out = _scatter_rows(tiles, out, t * hq).reshape(t, hq, d).to(q.dtype)
    return out, _scatter_rows(tiles, lse, t * hq).reshape(t, hq)


def _length_buckets(length: torch.Tensor) -> list[torch.Tensor]:
    """Sequences grouped by ceil(log2(key blocks)), each sorted by length (descending): padding
    every sequence of a bucket to its longest costs at most 2x."""
    blocks = (length + KV_BLOCK - 1) // KV_BLOCK
    key = torch.ceil(torch.log2(blocks.clamp(min=1).double())).long()
    key = torch.where(length > 0, key, -1)
    order = torch.argsort(length, descending=True, stable=True)
    return [order[key[order] == b] for b in sorted(set(key.tolist())) if b >= 0]


def _backward_bucket(seqs, start, length, src, grads, hq: int, hkv: int, scale: float):
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
            p = torch.where(visible, torch.exp(s - lse[c, r0:].unsqueeze(-1)), 0.0)
            dvp[c, k0:k0 + KV_BLOCK] = torch.bmm(p.transpose(1, 2), dos)
            ds = p * (torch.bmm(dos, vb.transpose(1, 2)) - delta[c, r0:].unsqueeze(-1))
            dqp[c, r0:] += torch.bmm(ds, kb) * scale
            dkp[c, k0:k0 + KV_BLOCK] = torch.bmm(ds.transpose(1, 2), qs) * scale
    # every real row belongs to exactly one group: plain (unique-index) writes; padding -> dump row
    dq.index_copy_(0, q_idx.reshape(-1), dqp.reshape(-1, d))
    dk.index_copy_(0, k_idx.reshape(-1), dkp.reshape(-1, d))
    dv.index_copy_(0, k_idx.reshape(-1), dvp.reshape(-1, d))


def _varlen_backward(q, k, v, out, lse, cu_seqlens, grad_out, scale: float):
    t, hq, d = q.shape
    hkv = k.shape[1]
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    start, length = cu[:-1], cu[1:] - cu[:-1]
    delta = (grad_out.float() * out.float()).sum(-1)                       # [T, Hq]
    lse_rows = torch.cat([lse.reshape(-1), lse.new_zeros(1)])
    delta_rows = torch.cat([delta.reshape(-1), delta.new_zeros(1)])
    src = (_ext_rows(q), _ext_rows(k), _ext_rows(v), _ext_rows(grad_out), lse_rows, delta_rows)
    grads = (q.new_zeros((t * hq + 1, d), dtype=torch.float32),
             k.new_zeros((t * hkv + 1, d), dtype=torch.float32),
             v.new_zeros((t * hkv + 1, d), dtype=torch.float32))
    for seqs in _length_buckets(length):
        _backward_bucket(seqs, start, length, src, grads, hq, hkv, scale)
    dq, dk, dv = grads
    return (dq[:-1].reshape(q.shape).to(q.dtype), dk[:-1].reshape(k.shape).to(k.dtype),
            dv[:-1].reshape(v.shape).to(v.dtype))


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        out, lse = _varlen_forward(q, k, v, cu_seqlens, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.scale = scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = _varlen_backward(q, k, v, out, lse, cu_seqlens, grad_out.contiguous(), ctx.scale)
        return dq, dk, dv, None, None


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Strict causal varlen attention (inputs validated by :func:`rlalign.ops.attention_varlen`)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _VarlenAttention.apply(q, k, v, cu_seqlens, scale)
    return _varlen_forward(q, k, v, cu_seqlens, scale)[0]


# ---- paged (rollout) --------------------------------------------------------------------------------

def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float) -> torch.Tensor:
    """Strict paged attention (inputs validated by :func:`rlalign.ops.attention_paged`).

    Non-finite K/V inside a context are detected on the way (score and accumulator checks) and
    raise; the rest of the cache is never read into the math (masked to exact zeros).
    """
    t, hq, d = q.shape
    if t == 0:
        return q.new_empty(q.shape)
    _, page_size, hkv, _ = k_cache.shape
    dev = q.device
    cu = cu_seqlens_q.to(device=dev, dtype=torch.int64)
    ctx_len = seq_lens.to(device=dev, dtype=torch.int64)
    n_q = cu[1:] - cu[:-1]
    tiles = _build_tiles(q, hkv, n_q, cu[:-1], ctx_len - n_q)
    keys = _PagedKeys(k_cache.reshape(-1, d), v_cache.reshape(-1, d),
                      block_table.to(device=dev, dtype=torch.int64), ctx_len, page_size, hkv)
    out, _ = _online_softmax(tiles, keys, scale, "attention_paged", check_keys=True)
    return _scatter_rows(tiles, out, t * hq).reshape(t, hq, d).to(q.dtype)


register("attention_varlen", "torch")(attention_varlen)
register("attention_paged", "torch")(attention_paged)
