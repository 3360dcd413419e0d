"""The forward plan of one attention call: tiles, chunks and key rows, derived from the batch's index tensors only.

A plan is built once per forward (``chk.memo``: every layer passes the same index tensors) and shared by its
layers. Its items are (sequence, kv head, tile of ``ATTN_Q_TILE`` query rows), sorted so that the items
needing key block j are a prefix; chunks of items bound memory (an item's bits do not depend on its chunk);
per key block it keeps the key rows and masks while they are small enough. Speed and memory only: no bit of
the formula (:mod:`rlalign.ops.torch_backend.attention`) depends on the plan's choices.
"""

from __future__ import annotations

import dataclasses

import torch

from rlalign.contract import spec

KV_BLOCK = spec.ATTN_KV_BLOCK
Q_TILE = spec.ATTN_Q_TILE
# Items per bmm chunk on the CPU are capped so that a gathered fp32 key block holds at most this
# many elements (cache sized). Speed and memory only.
_CHUNK_ELEMS = 1 << 20
# On GPUs every bmm is issued with exactly this many items (zero padded): cuBLAS picks its kernel
# by batch count, so an item's bits change with it (H200, torch 2.11: an item's bits differed between batch counts
# 1, 16, 64 and 4,096), and the library
# must only ever see one shape. MKL's bmm on the CPU is batch-count
# invariant (spec.cpu_backend_assumptions, checked by `rlalign doctor`) and runs unpadded.
GPU_BATCH = 1024
# Padding rows of a tile (q = 0) are given this position: they "see" every key, so their running
# state stays finite (scores 0) without a special case; their results are dropped.
_PAD_POS = 1 << 62
# A plan keeps its per-block key rows and masks (reused by every layer of a forward) while they
# cover at most this many (item, key) slots; beyond that they are rebuilt per block (memory only).
_PLAN_SLOTS = 1 << 20


@dataclasses.dataclass
class BlockPlan:
    """Key block j for the chunk's items [0, c) (a prefix: items are sorted by their last position)."""
    j: int
    c: int
    lowest: int                       # lowest position of a row < r among the c items
    data: tuple | None = None         # (key_rows, inside, mask, sees) when kept, see block_data


@dataclasses.dataclass
class ChunkPlan:
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
class Plan:
    seq: torch.Tensor        # [N] int64 sequence of each (sorted) item
    head: torch.Tensor       # [N] int64 kv head
    key_rows: object         # (seq [n], head [n], pos [64]) -> (rows [n, 64] into the key table, valid [n, 64])
    zero_outside: bool       # whether the table lacks a zero row for the slots outside the contexts
    chunks: list
    window: int | None = None   # sliding window: a row at position p sees keys p - window < pos <= p


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


def build_plan(hq: int, hkv: int, d: int, n_q, q_start, pos0, t: int, key_rows, zero_outside: bool,
               window: int | None = None) -> Plan:
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
    plan = Plan(seq, head, key_rows, zero_outside, [], window)
    keep = n * len(counts) * KV_BLOCK <= _PLAN_SLOTS
    for a, r in zip(starts, r_max):
        b = min(n, a + chunk)
        # off the CPU every tile keeps its 16 rows (the GPU path is the plain one)
        r = int(r) if dev.type == "cpu" else Q_TILE
        cs = [min(b, count) - a for count in counts]
        cs = [c for c in cs if c > 0]
        # lowest over items [a, a + c) for each block's prefix: a running min from the front
        lows = torch.cummin(lowest_item[a:b], 0).values[torch.tensor(cs, device=dev) - 1].tolist()
        ch = ChunkPlan(a, b, r, dest[a:b].reshape(-1), dest[a:b, :r].reshape(-1), row_pos[a:b, :r],
                        [BlockPlan(j, c, int(low)) for j, (c, low) in enumerate(zip(cs, lows))])
        if keep:
            for blk in ch.blocks:
                blk.data = block_data(plan, ch, blk)
        plan.chunks.append(ch)
    return plan


def block_data(plan: Plan, ch: ChunkPlan, blk: BlockPlan):
    """(rows [c * 64], inside, mask, sees): ``rows`` index the key table, or with ``inside`` (the
    table rows of the slots inside the contexts, when some slot is outside one and the table has no
    zero row) the small table [table[inside]; 0] (see :mod:`.formula`'s gather); mask [c, r, 64]
    key_pos <= row_pos, None when every row sees the whole block; sees [c, r] row_pos >= 64 j, None when
    every row sees the block."""
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
    if plan.window is not None:
        return (rows, inside) + window_masks(rp, key_pos, plan.window)
    mask = (key_pos <= rp.unsqueeze(-1)) if blk.lowest < first + KV_BLOCK - 1 else None
    sees = (rp >= first) if blk.lowest < first else None
    return rows, inside, mask, sees


def window_masks(row_pos: torch.Tensor, key_pos: torch.Tensor, window: int):
    """(mask [c, r, 64], sees [c, r]) of a sliding window: a real row at position p sees the keys at
    p - window < pos <= p (its first visible key lies anywhere in the fixed grid of 64-position blocks: the
    window is a mask, the blocks stay where they are); sees = the block holds at least one of them. Padding
    rows (position ``_PAD_POS``) see every key, as without a window (their scores stay finite)."""
    pad = row_pos == _PAD_POS
    low = torch.where(pad, 0, row_pos - (window - 1)).unsqueeze(-1)      # lowest visible key position
    mask = (key_pos <= row_pos.unsqueeze(-1)) & (key_pos >= low)
    sees = (row_pos >= key_pos[0]) & (low.squeeze(-1) <= key_pos[-1])
    return mask, sees


def packed_rows(start: torch.Tensor, length: torch.Tensor, hkv: int, zero_row: int):
    """Key rows of a packed batch [T * Hkv (+ 1 zero row), D]: sequence s owns tokens start[s] ..."""
    def rows(seq, head, pos):
        valid = pos < length[seq].unsqueeze(1)
        r = (start[seq].unsqueeze(1) + pos) * hkv + head.unsqueeze(1)
        return torch.where(valid, r, zero_row), valid
    return rows


def paged_rows(block_table: torch.Tensor, length: torch.Tensor, page_size: int, hkv: int):
    """Key rows of a paged cache viewed as [num_pages * page_size * Hkv, D], through the block table;
    row 0 outside the context (replaced by zeros, see :mod:`.formula`'s gather)."""
    def rows(seq, head, pos):
        valid = pos < length[seq].unsqueeze(1)
        page_col = torch.clamp(pos // page_size, max=block_table.shape[1] - 1)
        page = block_table[seq.unsqueeze(1), page_col.unsqueeze(0)]
        r = (page * page_size + pos % page_size) * hkv + head.unsqueeze(1)
        return torch.where(valid, r, 0), valid
    return rows


def _chunk_items(d: int, device: torch.device) -> int:
    """Items per chunk: on the CPU the gathered fp32 key block holds at most _CHUNK_ELEMS elements
    (speed and memory only); on GPUs the fixed bmm batch."""
    if device.type != "cpu":
        return GPU_BATCH
    return max(1, _CHUNK_ELEMS // (KV_BLOCK * d))
