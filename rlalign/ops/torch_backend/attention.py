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

Speed only (no bit depends on it): the index work of a call (tiles, their order, key rows, masks)
is a plan built once per forward from the batch's index tensors (``chk.memo``: every layer passes
the same ones); on the CPU the big temporaries are per-thread scratch buffers; rows that are padding
in every tile of a chunk are not pushed through the elementwise math (see :func:`_online_softmax`).

The varlen backward (:class:`_VarlenAttention`) recomputes probabilities flash-style from the
saved log-sum-exp; it is deterministic run to run (fixed-shape GEMMs, no atomics, no
index_add) but, like dW of a linear, not invariant to how sequences are packed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading

import torch

from rlalign.contract import spec
from rlalign.contract.bits import bits_equal
from rlalign.contract.errors import fail
from rlalign.ops import _checks as chk
from rlalign.ops._registry import register
from rlalign.ops.torch_backend import clib
from rlalign.ops.torch_backend.primitives import tree_sum

KV_BLOCK = spec.ATTN_KV_BLOCK
Q_TILE = spec.ATTN_Q_TILE
# Items per bmm chunk on the CPU are capped so that a gathered fp32 key block holds at most this
# many elements (cache sized). Speed and memory only.
_CHUNK_ELEMS = 1 << 20
# On GPUs every bmm is issued with exactly this many items (zero padded): cuBLAS picks its kernel
# by batch count, so an item's bits change with it (the measurement: docs/LOG.md), and the library
# must only ever see one shape. MKL's bmm on the CPU is batch-count
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


# ---- the forward plan: tiles, chunks and key rows, derived from the batch's index tensors only ----------

# Padding rows of a tile (q = 0) are given this position: they "see" every key, so their running
# state stays finite (scores 0) without a special case; their results are dropped.
_PAD_POS = 1 << 62
# A plan keeps its per-block key rows and masks (reused by every layer of a forward) while they
# cover at most this many (item, key) slots; beyond that they are rebuilt per block (memory only).
_PLAN_SLOTS = 1 << 20


@dataclasses.dataclass
class _BlockPlan:
    """Key block j for the chunk's items [0, c) (a prefix: items are sorted by their last position)."""
    j: int
    c: int
    lowest: int                       # lowest position of a row < r among the c items
    data: tuple | None = None         # (key_rows, inside, mask, sees) when kept, see _block_data


@dataclasses.dataclass
class _ChunkPlan:
    """Items [a, b) of the sorted item list, processed together (memory only; an item's bits do not
    depend on the chunk). Rows >= ``r`` of every tile of the chunk are padding rows."""
    a: int
    b: int
    r: int
    q_src: torch.Tensor      # [(b - a) * 16] int64 row of the query table (the zero row for padding rows)
    dest: torch.Tensor       # [(b - a) * r] int64 output row of rows 0..r-1 (the dump row for padding)
    row_pos: torch.Tensor    # [b - a, r] int64
    blocks: list


@dataclasses.dataclass
class _Plan:
    seq: torch.Tensor        # [N] int64 sequence of each (sorted) item
    head: torch.Tensor       # [N] int64 kv head
    key_rows: object         # (seq [n], head [n], pos [64]) -> (rows [n, 64] into the key table, valid [n, 64])
    zero_outside: bool       # whether the table lacks a zero row for the slots outside the contexts
    chunks: list


def _tile_layout(hq: int, hkv: int, n_q: torch.Tensor, q_start: torch.Tensor, pos0: torch.Tensor, t: int):
    """Every (sequence, kv head, tile) item of ``ATTN_Q_TILE`` (query, head) rows (token-major, the g heads
    of the kv head), sorted by the position of its last real row (descending, stable), so that the items
    needing key block j are the prefix [:block_counts[j]].
    -> (row_pos [N, 16] (_PAD_POS for padding), dest [N, 16] (t * hq for padding), seq [N], head [N],
    real rows per item [N], block_counts)."""
    g = hq // hkv
    dev = n_q.device
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
    n_blocks = int(last.max()) // KV_BLOCK + 1
    hist = torch.bincount(last // KV_BLOCK, minlength=n_blocks)
    counts = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])
    return (torch.where(valid, pos, _PAD_POS)[order], dest[order], seq[order], head[order],
            valid.sum(1)[order], counts.tolist())


def _build_plan(hq: int, hkv: int, d: int, n_q, q_start, pos0, t: int, key_rows, zero_outside: bool) -> _Plan:
    """The plan of one attention call (index tensors only: one per forward, shared by its layers).
    ``key_rows(seq, head, pos [64]) -> (rows [n, 64], valid [n, 64])`` addresses the key table; with
    ``zero_outside`` the slots outside the contexts get zeros by a second gather (paged: the cache may
    hold anything there), else ``rows`` already point at a zero row there."""
    row_pos, dest, seq, head, real, counts = _tile_layout(hq, hkv, n_q, q_start, pos0, t)
    n, dev = dest.shape[0], dest.device
    chunk = _chunk_items(d, dev)
    starts = list(range(0, n, chunk))
    # per chunk: the most real rows of one of its tiles (real rows are a prefix of each tile)
    r_max = torch.stack([real[a:a + chunk].amax() for a in starts]).tolist()
    # lowest position of a real row per item, and per chunk prefix [:c] for each block
    lowest_item = row_pos.amin(1)
    plan = _Plan(seq, head, key_rows, zero_outside, [])
    keep = n * len(counts) * KV_BLOCK <= _PLAN_SLOTS
    for a, r in zip(starts, r_max):
        b = min(n, a + chunk)
        # off the CPU every tile keeps its 16 rows (the GPU path is the plain one)
        r = int(r) if dev.type == "cpu" else Q_TILE
        cs = [min(b, count) - a for count in counts]
        cs = [c for c in cs if c > 0]
        # lowest over items [a, a + c) for each block's prefix: a running min from the front
        lows = torch.cummin(lowest_item[a:b], 0).values[torch.tensor(cs, device=dev) - 1].tolist()
        ch = _ChunkPlan(a, b, r, dest[a:b].reshape(-1), dest[a:b, :r].reshape(-1), row_pos[a:b, :r],
                        [_BlockPlan(j, c, int(low)) for j, (c, low) in enumerate(zip(cs, lows))])
        if keep:
            for blk in ch.blocks:
                blk.data = _block_data(plan, ch, blk)
        plan.chunks.append(ch)
    return plan


def _block_data(plan: _Plan, ch: _ChunkPlan, blk: _BlockPlan):
    """(rows [c * 64], inside, mask, sees): ``rows`` index the key table, or with ``inside`` (the
    table rows of the slots inside the contexts, when some slot is outside one and the table has no
    zero row) the small table [table[inside]; 0] (see _gather); mask [c, r, 64] key_pos <= row_pos,
    None when every row sees the whole block; sees [c, r] row_pos >= 64 j, None when every row sees
    the block."""
    if blk.data is not None:
        return blk.data
    a, c, first = ch.a, blk.c, blk.j * KV_BLOCK
    key_pos = first + torch.arange(KV_BLOCK, device=plan.seq.device)
    rows, valid = plan.key_rows(plan.seq[a:a + c], plan.head[a:a + c], key_pos)
    rows, valid = rows.reshape(-1), valid.reshape(-1)
    inside = None
    if plan.zero_outside and not bool(valid.all()):
        # two gathers, no fill: the rows inside the contexts into a small table whose extra last
        # row is zero, then every slot from that table (outside slots from the zero row)
        inside = rows[valid]
        rows = torch.full_like(rows, inside.numel())
        rows[valid] = torch.arange(inside.numel(), device=rows.device)
    rp = ch.row_pos[:c]
    mask = (key_pos <= rp.unsqueeze(-1)) if blk.lowest < first + KV_BLOCK - 1 else None
    sees = (rp >= first) if blk.lowest < first else None
    return rows, inside, mask, sees


def _packed_rows(start: torch.Tensor, length: torch.Tensor, hkv: int, zero_row: int):
    """Key rows of a packed batch [T * Hkv (+ 1 zero row), D]: sequence s owns tokens start[s] ..."""
    def rows(seq, head, pos):
        valid = pos < length[seq].unsqueeze(1)
        r = (start[seq].unsqueeze(1) + pos) * hkv + head.unsqueeze(1)
        return torch.where(valid, r, zero_row), valid
    return rows


def _paged_rows(block_table: torch.Tensor, length: torch.Tensor, page_size: int, hkv: int):
    """Key rows of a paged cache viewed as [num_pages * page_size * Hkv, D], through the block table;
    row 0 outside the context (replaced by zeros, see _gather)."""
    def rows(seq, head, pos):
        valid = pos < length[seq].unsqueeze(1)
        page_col = torch.clamp(pos // page_size, max=block_table.shape[1] - 1)
        page = block_table[seq.unsqueeze(1), page_col.unsqueeze(0)]
        r = (page * page_size + pos % page_size) * hkv + head.unsqueeze(1)
        return torch.where(valid, r, 0), valid
    return rows


# ---- scratch buffers (CPU): the big per-call temporaries are reused instead of allocated --------

_scratch = threading.local()


class _Scratch:
    """One per-thread scratch buffer: the storage, its views by shape, and what is known of its
    contents: ``fill`` = (trailing shape, value, r, n) when view[:n, r:] holds ``value``."""

    def __init__(self, numel: int, device: torch.device):
        self.buf = torch.empty(numel, dtype=torch.float32, device=device)
        self.views: dict = {}
        self.fill = None


def _buffer(name: str, shape: tuple, device: torch.device, fill: tuple | None = None) -> torch.Tensor:
    """A contiguous fp32 [shape] view of a per-thread scratch buffer, contents undefined; with
    ``fill`` = (value, r), rows r.. of dim 1 hold ``value`` (the caller then writes only rows < r, so
    the next call with the same trailing shape and value finds them still there and skips the fill).
    Fresh off the CPU (the caching allocator is cheap there). One name is one buffer: a caller
    never holds two views of one name at once."""
    if device.type != "cpu":
        out = torch.empty(shape, dtype=torch.float32, device=device)
        if fill is not None:
            out[:, fill[1]:] = fill[0]
        return out
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    # a buffer made under torch.inference_mode is an inference tensor: no in-place writes outside it
    name = (name, torch.is_inference_mode_enabled())
    entry = bufs.get(name)
    view = None if entry is None else entry.views.get(shape)
    if view is None:
        numel = 1
        for s in shape:
            numel *= s
        if entry is None or entry.buf.numel() < numel:
            entry = bufs[name] = _Scratch(numel, device)
        if len(entry.views) >= 32:
            entry.views.clear()
        view = entry.views[shape] = entry.buf[:numel].view(shape)
    if fill is None:
        entry.fill = None
        return view
    value, r = fill
    known = entry.fill
    if known is not None and known[0] == shape[1:] and known[1] == value and r >= known[2] and shape[0] <= known[3]:
        entry.fill = (shape[1:], value, r, known[3])
    else:
        view[:, r:] = value
        entry.fill = (shape[1:], value, r, shape[0])
    return view


def _bmm(a: torch.Tensor, b: torch.Tensor, transpose_b: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 a @ b (or a @ b^T) per item; on GPUs issued as one bmm of exactly _GPU_BATCH items
    (``out`` unused there)."""
    n = a.shape[0]
    if a.device.type != "cpu":
        a, b = _pad_batch(a), _pad_batch(b)
        return torch.bmm(a, b.transpose(1, 2) if transpose_b else b)[:n]
    b = b.transpose(1, 2) if transpose_b else b
    return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)


def _gather(table: torch.Tensor, rows: torch.Tensor, inside: torch.Tensor | None, name: str,
            shape: tuple) -> torch.Tensor:
    """fp32 [c, 64, D] key (or value) block: ``table[rows]``, or with ``inside`` (rows of the slots
    inside the contexts) ``[table[inside]; 0][rows]``: the slots outside the contexts are exact zeros
    (a select; never a multiplication by 0)."""
    d, dev = shape[-1], table.device
    if inside is not None:
        small = _buffer(name + "_in", (inside.numel() + 1, d), dev)
        if table.dtype == torch.float32:
            torch.index_select(table, 0, inside, out=small[:-1])
        else:
            small[:-1] = table.index_select(0, inside)
        small[-1] = 0.0
        table = small
    out = _buffer(name, shape, dev)
    if table.dtype == torch.float32:
        torch.index_select(table, 0, rows, out=out.view(-1, d))
    else:
        out.view(-1, d).copy_(table.index_select(0, rows))
    return out


# ---- the online softmax --------------------------------------------------------------------------

def _chunk_items(d: int, device: torch.device) -> int:
    """Items per chunk: on the CPU the gathered fp32 key block holds at most _CHUNK_ELEMS elements
    (speed and memory only); on GPUs the fixed bmm batch."""
    if device.type != "cpu":
        return _GPU_BATCH
    return max(1, _CHUNK_ELEMS // (KV_BLOCK * d))


def _online_softmax(plan: _Plan, q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, scale: float,
                    check_keys: bool, out_rows: torch.Tensor, lse_rows: torch.Tensor | None) -> bool:
    """Every key block over the plan's items, chunk by chunk (the module docstring's formula).
    Writes acc / l + 0.0 of rows < r into ``out_rows`` [T * Hq + 1, D] (and m + log(l) into
    ``lse_rows``); the last row is the dump row of padding rows. With ``check_keys`` returns whether
    a score or accumulator sum was non-finite (a non-finite K/V within a context, or an overflow).

    Rows >= r of a chunk's tiles are padding in every tile (q = 0; they see every key). With finite
    keys their scores are +-0, so p = exp(+-0 - +-0) = 1 for every key of every block, m = +-0 and
    alpha = 1 after block 0 (alpha = 0 at block 0, against an accumulator of 0): their p rows are set
    to 1 rather than computed, and only the p @ V GEMM (whose operand keeps all 16 rows: the library
    call is unchanged) and the accumulator (read by the finiteness check) carry them, up to the sign
    of zeros, which no check can see; their results are dropped. A non-finite key within a context
    makes the score sum non-finite (that check is on the full tiles), so it is reported either way.
    Rows < r are computed exactly as the formula says.
    """
    d, dev = q_rows.shape[1], q_rows.device
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    for ch in plan.chunks:
        n, r = ch.b - ch.a, ch.r
        if r == Q_TILE:
            qt = torch.index_select(q_rows, 0, ch.q_src, out=_buffer("q", (n * Q_TILE, d), dev)).view(n, Q_TILE, d)
        else:  # rows >= r are padding (q = 0) in every tile of the chunk: only rows < r are gathered
            qt = _buffer("q", (n, Q_TILE, d), dev, fill=(0.0, r))
            qt[:, :r] = q_rows.index_select(0, ch.dest).view(n, r, d)
        m = torch.full((n, r), float("-inf"), device=dev)
        l = torch.zeros((n, r), device=dev)
        acc = None
        for blk in ch.blocks:
            c = blk.c
            rows, inside, mask, sees = _block_data(plan, ch, blk)
            k = _gather(k_rows, rows, inside, "k", (c, KV_BLOCK, d))
            v = _gather(v_rows, rows, inside, "v", (c, KV_BLOCK, d))
            raw = _bmm(qt[:c], k, transpose_b=True, out=_buffer("s", (c, Q_TILE, KV_BLOCK), dev))
            raw.mul_(scale)
            if check_keys:
                # a non-finite key in a context makes its whole score column non-finite
                bad |= ~torch.isfinite(raw.sum())
            s = raw[:, :r]
            if mask is not None:  # some row does not see the whole block
                s = torch.where(mask, s, float("-inf"))
            m_old, l_old = m[:c], l[:c]
            m_new = torch.maximum(m_old, s.amax(-1))
            # Every real row sees block 0 and padding rows see every block, so a row that cannot see
            # this block has a finite m and all-(-inf) scores: m_new = m, p = 0, alpha = 1 (no NaN).
            if r == Q_TILE:
                p_full = _buffer("p", (c, Q_TILE, KV_BLOCK), dev)
                p = torch.exp_(torch.sub(s, m_new.unsqueeze(-1), out=p_full))
            else:
                p_full = _buffer("p", (c, Q_TILE, KV_BLOCK), dev, fill=(1.0, r))
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
                acc_new[:, :r] = torch.where(sees.unsqueeze(-1), acc_new[:, :r], acc[:c, :r])
            if c == n:
                m, l, acc = m_new, l_new, acc_new
            else:
                m[:c], l[:c], acc[:c] = m_new, l_new, acc_new
        if check_keys:
            # a non-finite value reaches the accumulator of its sequence's last row (it sees every key)
            bad |= ~torch.isfinite(acc.sum())
        res = torch.div(acc[:, :r], l.unsqueeze(-1))
        res += 0.0
        out_rows.index_copy_(0, ch.dest, res.reshape(-1, d))
        if lse_rows is not None:
            lse_rows.index_copy_(0, ch.dest, (m + torch.log(l)).reshape(-1))
    return check_keys and bool(bad)


# ---- the same arithmetic row by row, compiled (CPU) -------------------------------------------------

def _compiled_applies(device: torch.device, d: int) -> bool:
    """Whether csrc/attention.c runs this call: on the CPU, when the kernels are built and reproduced
    the torch formulation bit for bit for this head_dim on this machine (:func:`compiled_matches`).
    Otherwise the torch formulation runs -- the same bits, slower."""
    return (device.type == "cpu" and d <= clib.MAX_HEAD_DIM and clib.library() is not None
            and compiled_matches(d, torch.get_num_threads()))


@functools.lru_cache(maxsize=None)
def compiled_matches(d: int, threads: int) -> bool:
    """The kernels compute q.k and p.v as increasing-order FMA chains, which is what the library's
    fixed-shape GEMM tiles of the formulation compute for the head dims seen (MKL, AVX2: 16 to 128) --
    but not for every one (d = 8: p.v is ordered otherwise; d = 256: q.k is split). So before the first
    use for a head_dim, both paths run a paged call (decode, prefill chunks, contexts of 1 to 3 key
    blocks) and a packed one on random inputs; the kernels are used only if every bit agrees. Per
    thread count too: the library's tiles may depend on it."""
    return compiled_agrees(d, torch.Generator().manual_seed(1000 + d), [1, 70, 150, 9, 64], [1, 6, 1, 9, 2])


def compiled_agrees(d: int, gen: torch.Generator, lens: list[int], n_new: list[int]) -> bool:
    """Whether the kernels give the formulation's bits (out, and lse of the packed call) on random fp32
    inputs of head_dim d: a paged call (2 query heads on 1 kv head, page size 16; sequence s has context
    ``lens[s]``, of which the last ``n_new[s]`` tokens are queries) and a packed call of the same lengths."""
    ps, hq, hkv = 16, 2, 1
    n_pages = sum(-(-n // ps) for n in lens)
    table = torch.randperm(n_pages, generator=gen)
    rows, nxt = [], 0
    for n in lens:
        rows.append(table[nxt:nxt + -(-n // ps)].tolist())
        nxt += len(rows[-1])
    width = max(len(r) for r in rows)
    bt = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    kc, vc = (torch.randn(n_pages, ps, hkv, d, generator=gen) * 2 for _ in range(2))
    q = torch.randn(sum(n_new), hq, d, generator=gen)
    cu = torch.tensor([0] + torch.tensor(n_new).cumsum(0).tolist(), dtype=torch.int32)
    args = (q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), cu, d ** -0.5)
    same = bits_equal(_paged_compiled(*args), _paged_formula(*args))
    qv, kv, vv = (torch.randn(sum(lens), h, d, generator=gen) for h in (hq, hkv, hkv))
    cuv = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    (oc, lc), (of, lf) = (path(qv, kv, vv, cuv, d ** -0.5) for path in (_varlen_compiled, _varlen_formula))
    return same and bits_equal(oc, of) and bits_equal(lc, lf)


@dataclasses.dataclass
class _CLayout:
    """Per-sequence index arrays of one call (int64, contiguous; kept alive here for the C side)."""
    seqs: torch.Tensor                 # [4, S]: first query row, query count, first query position, context length
    block_table: torch.Tensor | None   # paged: [S, max_pages] page ids
    page_size: int
    key_start: torch.Tensor | None     # packed: token index of each sequence's position 0
    n_blocks: int                      # key blocks the call visits (64 positions each)

    @staticmethod
    def of(q_start, n_q, pos0, ctx_len, *, block_table=None, page_size: int = 1, key_start=None) -> "_CLayout":
        seqs = torch.stack([q_start, n_q, pos0, ctx_len]).contiguous()
        last = torch.where(n_q > 0, pos0 + n_q - 1, -1)
        n_blocks = int(last.max()) // KV_BLOCK + 1 if last.numel() else 0
        if key_start is not None:
            key_start = key_start.contiguous()
        return _CLayout(seqs, block_table, page_size, key_start, max(n_blocks, 0))

    def struct(self, k: torch.Tensor, v: torch.Tensor, hq: int, hkv: int, d: int) -> clib.Layout:
        seqs, ptr = self.seqs, self.seqs.data_ptr()
        row = seqs.stride(0) * seqs.element_size()
        table = self.block_table
        return clib.Layout(k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16), ptr, ptr + row,
                           ptr + 2 * row, ptr + 3 * row, table.data_ptr() if table is not None else None,
                           table.shape[1] if table is not None else 0, self.page_size,
                           self.key_start.data_ptr() if self.key_start is not None else None,
                           seqs.shape[1], hq, hkv, d)


def _c_online_softmax(lay: _CLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hq: int, hkv: int,
                      scale: float):
    """The module docstring's formula for every query row of the call, by csrc/attention.c, with
    torch's exp applied between its two per-block halves (the same exp as the torch formulation).
    k/v: contiguous tables whose rows are [token * hkv + head] (a packed [T, Hkv, D] tensor or a paged
    cache). Returns (out [T * Hq, D] fp32, m, l, bad): bad when a score or an accumulator is not finite."""
    lib = clib.library()
    d = q.shape[-1]
    q_rows = q.reshape(-1, d).float().contiguous()
    rows = q_rows.shape[0]
    k, v = k.contiguous(), v.contiguous()   # fp32 or bf16: the op validated the strict dtypes
    layout = ctypes.byref(lay.struct(k, v, hq, hkv, d))
    threads = torch.get_num_threads()
    # per-thread scratch (the per-row state; every entry a row reads is written first)
    m = _buffer("c_m", (rows,), q.device)
    m.fill_(float("-inf"))
    l = _buffer("c_l", (rows,), q.device)
    l.zero_()
    acc, m_new = _buffer("c_acc", (rows, d), q.device), _buffer("c_m_new", (rows,), q.device)
    a, p = _buffer("c_alpha", (rows,), q.device), _buffer("c_p", (rows, KV_BLOCK), q.device)
    bad = 0
    for j in range(lay.n_blocks):
        bad |= lib.rl_attn_scores(layout, q_rows.data_ptr(), scale, j, m.data_ptr(), p.data_ptr(), a.data_ptr(),
                                  m_new.data_ptr(), threads)
        # rows that do not see block j keep stale entries here; the update skips them
        torch.exp_(p)
        torch.exp_(a)
        lib.rl_attn_update(layout, j, p.data_ptr(), a.data_ptr(), m_new.data_ptr(), m.data_ptr(), l.data_ptr(),
                           acc.data_ptr(), threads)
    out = torch.empty((rows, d))
    bad |= lib.rl_attn_finish(layout, acc.data_ptr(), l.data_ptr(), out.data_ptr(), threads)
    return out, m, l, bool(bad)


# ---- varlen (training) ----------------------------------------------------------------------------

def _ext_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> fp32 [T * H + 1, D], the extra last row all zeros (target of masked indices)."""
    d = x.shape[-1]
    return torch.cat([x.reshape(-1, d).float(), x.new_zeros((1, d), dtype=torch.float32)])


def _varlen_forward(q, k, v, cu_seqlens, scale: float):
    """Returns (out [T, Hq, D] in q.dtype, lse [T, Hq] fp32)."""
    t, hq, d = q.shape
    if t == 0:
        return q.new_empty(q.shape), q.new_empty((0, hq), dtype=torch.float32)
    if _compiled_applies(q.device, d):
        return _varlen_compiled(q, k, v, cu_seqlens, scale)
    return _varlen_formula(q, k, v, cu_seqlens, scale)


def _varlen_formula(q, k, v, cu_seqlens, scale: float):
    t, hq, d = q.shape
    hkv = k.shape[1]

    def build():
        cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
        start, length = cu[:-1], cu[1:] - cu[:-1]
        return _build_plan(hq, hkv, d, length, start, torch.zeros_like(start), t,
                           _packed_rows(start, length, hkv, t * hkv), zero_outside=False)

    plan = chk.memo("torch_attention_varlen_plan", build, cu_seqlens, extra=(t, hq, hkv, d, q.device),
                    capturing=build)
    out = torch.empty((t * hq + 1, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((t * hq + 1,), dtype=torch.float32, device=q.device)
    _online_softmax(plan, _ext_rows(q), _ext_rows(k), _ext_rows(v), scale, False, out, lse)
    return out[:t * hq].reshape(t, hq, d).to(q.dtype), lse[:t * hq].reshape(t, hq)


def _varlen_compiled(q, k, v, cu_seqlens, scale: float):
    t, hq, d = q.shape

    def layout():
        cu = cu_seqlens.to(dtype=torch.int64)
        start, length = cu[:-1], cu[1:] - cu[:-1]
        return _CLayout.of(start, length, torch.zeros_like(start), length, key_start=start)

    lay = chk.memo("torch_attention_varlen_c_layout", layout, cu_seqlens, extra=(t,))
    out, m, l, _ = _c_online_softmax(lay, q, k, v, q.shape[1], k.shape[1], scale)
    return out.reshape(t, hq, d).to(q.dtype), (m + torch.log(l)).reshape(t, hq)


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


_NONFINITE_CACHE = "k_cache/v_cache contain NaN or inf within a sequence's context (or the scores overflow fp32)"


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
    paged = _paged_compiled if _compiled_applies(q.device, d) else _paged_formula
    return paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale)


def _paged_formula(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float) -> torch.Tensor:
    t, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    dev = q.device

    def build():
        cu = cu_seqlens_q.to(device=dev, dtype=torch.int64)
        ctx_len = seq_lens.to(device=dev, dtype=torch.int64)
        n_q = cu[1:] - cu[:-1]
        table = block_table.to(device=dev, dtype=torch.int64)
        return _build_plan(hq, hkv, d, n_q, cu[:-1], ctx_len - n_q, t, _paged_rows(table, ctx_len, page_size, hkv),
                           zero_outside=True)

    # one plan per forward: every layer gets the same index tensors
    plan = chk.memo("torch_attention_paged_plan", build, block_table, seq_lens, cu_seqlens_q,
                    extra=(t, hq, hkv, d, page_size, dev), capturing=build)
    q_rows = torch.cat([q.reshape(t * hq, d).float(), q.new_zeros((1, d), dtype=torch.float32)])
    out = torch.empty((t * hq + 1, d), dtype=torch.float32, device=dev)
    if _online_softmax(plan, q_rows, k_cache.reshape(-1, d), v_cache.reshape(-1, d), scale, True, out, None):
        raise fail("attention_paged", _NONFINITE_CACHE)
    return out[:t * hq].reshape(t, hq, d).to(q.dtype)


def _paged_compiled(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float) -> torch.Tensor:
    t, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape

    def layout():
        cu = cu_seqlens_q.to(dtype=torch.int64)
        n_q, ctx_len = cu[1:] - cu[:-1], seq_lens.to(dtype=torch.int64)
        return _CLayout.of(cu[:-1], n_q, ctx_len - n_q, ctx_len,
                           block_table=block_table.to(dtype=torch.int64).contiguous(), page_size=page_size)

    lay = chk.memo("torch_attention_paged_c_layout", layout, block_table, seq_lens, cu_seqlens_q,
                   extra=(t, page_size))
    out, _, _, bad = _c_online_softmax(lay, q, k_cache, v_cache, hq, hkv, scale)
    if bad:
        raise fail("attention_paged", _NONFINITE_CACHE)
    return out.reshape(t, hq, d).to(q.dtype)


register("attention_varlen", "torch")(attention_varlen)
register("attention_paged", "torch")(attention_paged)
