"""MoE token dispatch on the device in three launches: grouping order, inverse, offsets, row-tile tables.

An MoE layer's ``experts`` [T, k] names k experts per token; its T*k (token, slot) rows run grouped by
expert. From the ids alone, with no host read and a launch grid that depends on the shapes only (so a
decode step can be captured in a CUDA graph), :func:`dispatch` computes:

- ``order`` [T*k]: the slots grouped by expert, slot order inside a group -- exactly
  ``torch.sort(experts.reshape(-1), stable=True).indices`` for valid ids; ``token`` [T*k] = order // k
  (the row of x each grouped row copies); ``inverse`` [T*k] with ``inverse[order[i]] = i``;
- ``offsets`` [E+1] int64: expert e's grouped rows are ``offsets[e] .. offsets[e+1]``;
- the row-tile tables of :mod:`.grouped` (``grouped._slots``' values) for each requested tile height;
- ``ok``: a 0-dim bool verdict, True iff every id lies in [0, E).

All of it is integer bookkeeping: it decides where a row sits, never what is computed on it (the
experts' numerics are the grouped GEMMs', :mod:`.grouped`). An out-of-range id goes to an extra bucket E
placed after every expert, so ``order`` stays a permutation (no out-of-bounds access) and such rows lie
past ``offsets[E]``, outside every expert's range: never computed; ``ok`` is False.

Three launches (C slots per chunk, B = E + 1 buckets):

1. count, one program per chunk: ``counts[b, chunk]`` = the chunk's slots in bucket b (one-hot sums);
2. scan, one program per bucket: ``prefix[b, chunk]`` = slots of bucket b in earlier chunks (an exclusive
   running sum over the chunks), ``totals[b]``;
3. place, one program per chunk and one per block of row-tile slots: a slot's position is
   ``start[b] + prefix[b, chunk] + (earlier slots of the chunk in bucket b)`` with ``start`` the
   exclusive sum of ``totals`` over the buckets below b; the tile programs rebuild each table from
   ``totals`` (the first one also writes ``offsets`` and ``ok``).

int32 arithmetic inside (T*k and the count table's size below 2^31, checked on the host); it runs under
TRITON_INTERPRET=1 on the CPU (integers are exact there), where tests/ops/test_moe_dispatch.py compares it
with torch.sort.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from rlalign.contract.errors import fail

# Small blocks: a program holds [C or SB, next_pow2(E + 1)] integer tiles in registers (64 x 256 over 8 warps:
# 64 per thread; 128- and 256-wide blocks spilled to local memory at E = 128 in ptxas -v for sm_90a).
CHUNK = 64           # slots per count/place program (the place kernel ranks them with a [C, C] compare)
SCAN_BLOCK = 1024    # chunks per step of a scan program
SLOT_BLOCK = 64      # row-tile slots per table program
WARPS = 8


@dataclasses.dataclass(frozen=True)
class Dispatch:
    order: torch.Tensor       # [T*k] int64: grouped row i is slot order[i]
    token: torch.Tensor       # [T*k] int64: order // k
    inverse: torch.Tensor     # [T*k] int64: slot s is grouped row inverse[s]
    offsets: torch.Tensor     # [E+1] int64
    slots: dict               # {block_m: (slot_expert int32, slot_row int64, slot_end int64, n_slots)}
    ok: torch.Tensor          # 0-dim bool: every id in [0, E)


@triton.jit
def _bucket(ids, n_experts):
    """An id's bucket: itself when in [0, E), else E (the out-of-range bucket, after every expert)."""
    return tl.where((ids >= 0) & (ids < n_experts), ids, n_experts).to(tl.int32)


@triton.jit
def _moe_dispatch_count_kernel(ids_ptr, counts_ptr, n, n_chunks, n_experts, C: tl.constexpr, BB: tl.constexpr):
    chunk = tl.program_id(0)
    s = chunk * C + tl.arange(0, C)
    live = s < n
    bucket = _bucket(tl.load(ids_ptr + s, mask=live, other=0), n_experts)
    b = tl.arange(0, BB)
    hits = ((bucket[:, None] == b[None, :]) & live[:, None]).to(tl.int32)
    tl.store(counts_ptr + b * n_chunks + chunk, tl.sum(hits, axis=0), mask=b <= n_experts)


@triton.jit
def _moe_dispatch_scan_kernel(counts_ptr, prefix_ptr, totals_ptr, n_chunks, B: tl.constexpr):
    bucket = tl.program_id(0)
    row = bucket * n_chunks
    carry = tl.full((), 0, tl.int32)
    for start in range(0, n_chunks, B):
        i = start + tl.arange(0, B)
        live = i < n_chunks
        v = tl.load(counts_ptr + row + i, mask=live, other=0)
        tl.store(prefix_ptr + row + i, carry + tl.cumsum(v, 0) - v, mask=live)
        carry += tl.sum(v, 0)
    tl.store(totals_ptr + bucket, carry)


@triton.jit
def _place_chunk(ids_ptr, prefix_ptr, totals, b, order_ptr, token_ptr, inverse_ptr, chunk, n, k, n_chunks,
                 n_experts, C: tl.constexpr):
    s = chunk * C + tl.arange(0, C)
    live = s < n
    bucket = _bucket(tl.load(ids_ptr + s, mask=live, other=0), n_experts)
    lane = tl.arange(0, C)
    # rank among the chunk's earlier slots of the same bucket (dead tail lanes come last: they rank no live one)
    earlier = (bucket[:, None] == bucket[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    start = tl.sum(tl.where(b[None, :] < bucket[:, None], totals[None, :], 0), axis=1)
    before = tl.load(prefix_ptr + bucket * n_chunks + chunk, mask=live, other=0)
    pos = start + before + rank
    tl.store(order_ptr + pos, s.to(tl.int64), mask=live)
    tl.store(token_ptr + pos, (s // k).to(tl.int64), mask=live)
    tl.store(inverse_ptr + s, pos.to(tl.int64), mask=live)


@triton.jit
def _place_tiles(totals, b, n_experts, block, n_slots, block_m, t_expert, t_row, t_end, SB: tl.constexpr):
    """Slots ``block * SB ..`` of the row-tile table for tiles of ``block_m`` rows (grouped._slots' values:
    idle slots get expert -1, row ``slot * block_m`` and end ``offsets[1]``, as there)."""
    counts = tl.where(b < n_experts, totals, 0)
    tiles = (counts + block_m - 1) // block_m
    ends = tl.cumsum(tiles, 0)                                  # inclusive tile ends per expert
    slot = block * SB + tl.arange(0, SB)
    # the experts whose tiles end at or before the slot: exactly those below the slot's expert (ends ascend)
    below = (ends[None, :] <= slot[:, None]) & (b[None, :] < n_experts)
    expert = tl.sum(below.to(tl.int32), axis=1)
    valid = expert < n_experts
    first_tile = tl.where(valid, tl.sum(tl.where(below, tiles[None, :], 0), axis=1), 0)
    row0 = tl.where(valid, tl.sum(tl.where(below, counts[None, :], 0), axis=1), 0)
    own = tl.where(valid, expert, 0)
    count = tl.sum(tl.where(b[None, :] == own[:, None], counts[None, :], 0), axis=1)
    live = slot < n_slots
    tl.store(t_expert + slot, tl.where(valid, expert, -1), mask=live)
    tl.store(t_row + slot, row0.to(tl.int64) + (slot - first_tile).to(tl.int64) * block_m, mask=live)
    tl.store(t_end + slot, (row0 + count).to(tl.int64), mask=live)


@triton.jit
def _moe_dispatch_place_kernel(ids_ptr, prefix_ptr, totals_ptr, order_ptr, token_ptr, inverse_ptr, offsets_ptr, ok_ptr,
                  t_expert, t_row, t_end, n, k, n_chunks, n_experts, slots0, slots1, block_m0, block_m1,
                  progs0, C: tl.constexpr, BB: tl.constexpr, SB: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.arange(0, BB)
    totals = tl.load(totals_ptr + b, mask=b <= n_experts, other=0)
    if pid < n_chunks:
        _place_chunk(ids_ptr, prefix_ptr, totals, b, order_ptr, token_ptr, inverse_ptr, pid, n, k, n_chunks,
                     n_experts, C)
    else:
        t = pid - n_chunks
        if t == 0:
            tl.store(offsets_ptr + b, (tl.cumsum(totals, 0) - totals).to(tl.int64), mask=b <= n_experts)
            bad = tl.sum(tl.where(b == n_experts, totals, 0), 0)
            tl.store(ok_ptr, (bad == 0).to(tl.int8))
        if t < progs0:
            _place_tiles(totals, b, n_experts, t, slots0, block_m0, t_expert, t_row, t_end, SB)
        else:
            _place_tiles(totals, b, n_experts, t - progs0, slots1, block_m1, t_expert + slots0, t_row + slots0,
                         t_end + slots0, SB)


def dispatch(experts: torch.Tensor, n_experts: int, block_ms: tuple[int, ...]) -> Dispatch:
    """The dispatch of ``experts`` [T, k] (int64) over ``n_experts`` experts, with row-tile tables for the
    (one or two) tile heights ``block_ms`` (see the module docstring). Three launches, none for T*k == 0."""
    if len(block_ms) not in (1, 2):
        raise ValueError(f"dispatch: one or two row-tile heights, got {block_ms}")
    flat = experts.reshape(-1)
    n, k = flat.numel(), experts.shape[1]
    dev = flat.device
    if n >= 2 ** 31 or (n_experts + 1) * triton.cdiv(n, CHUNK) >= 2 ** 31:
        raise fail("moe_experts", f"{n} (token, expert) rows over {n_experts} experts: the dispatch indexes rows "
                                  "and its per-chunk counts in int32; split the batch")
    order = torch.empty(n, dtype=torch.int64, device=dev)
    token = torch.empty(n, dtype=torch.int64, device=dev)
    inverse = torch.empty(n, dtype=torch.int64, device=dev)
    offsets = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev) if n == 0 else \
        torch.empty(n_experts + 1, dtype=torch.int64, device=dev)
    ok = torch.ones((), dtype=torch.bool, device=dev) if n == 0 else torch.empty((), dtype=torch.bool, device=dev)
    if n == 0:     # no rows: nothing to group, and the grouped GEMMs never read a table
        return Dispatch(order, token, inverse, offsets, {}, ok)
    heights = tuple(block_ms) if len(block_ms) == 2 and block_ms[0] != block_ms[1] else (block_ms[0],)
    n_slots = [triton.cdiv(n, bm) + n_experts for bm in heights]
    table = sum(n_slots)
    t_expert = torch.empty(table, dtype=torch.int32, device=dev)
    t_row = torch.empty(table, dtype=torch.int64, device=dev)
    t_end = torch.empty(table, dtype=torch.int64, device=dev)
    n_chunks = triton.cdiv(n, CHUNK)
    work = torch.empty(2 * (n_experts + 1) * n_chunks + n_experts + 1, dtype=torch.int32, device=dev)
    counts, prefix = work[:(n_experts + 1) * n_chunks], work[(n_experts + 1) * n_chunks:-(n_experts + 1)]
    totals = work[-(n_experts + 1):]
    bb = triton.next_power_of_2(n_experts + 1)
    _moe_dispatch_count_kernel[(n_chunks,)](flat, counts, n, n_chunks, n_experts, C=CHUNK, BB=bb, num_warps=WARPS)
    _moe_dispatch_scan_kernel[(n_experts + 1,)](counts, prefix, totals, n_chunks, B=SCAN_BLOCK)
    progs = [triton.cdiv(s, SLOT_BLOCK) for s in n_slots]
    slots1, bm1 = (n_slots[1], heights[1]) if len(heights) == 2 else (0, heights[0])
    _moe_dispatch_place_kernel[(n_chunks + sum(progs),)](
        flat, prefix, totals, order, token, inverse, offsets, ok.view(torch.int8), t_expert, t_row, t_end,
        n, k, n_chunks, n_experts, n_slots[0], slots1, heights[0], bm1, progs[0],
        C=CHUNK, BB=bb, SB=SLOT_BLOCK, num_warps=WARPS)
    slots, at = {}, 0
    for bm, s in zip(heights, n_slots):
        slots[bm] = (t_expert[at:at + s], t_row[at:at + s], t_end[at:at + s], s)
        at += s
    return Dispatch(order, token, inverse, offsets, slots, ok)


class _GatherRows(torch.autograd.Function):
    """rows[i] = x[token[i]] (one copy of x's rows in grouped order). Backward: row i's gradient goes back to
    its slot through the inverse permutation (a gather, no scatter-add), and a token's k slot gradients are
    summed by ``sum_to_size`` over the fixed [T, k, H] view: the reduction the reference path's ``expand``
    backward runs (``ops.moe.sorted_experts``), so the same bits. (The reference's index_select backward
    adds the gradient into zeros, which would turn a -0.0 into +0.0; none arrives: the rows' gradient is the
    gate and up projections' grouped dX, whose fp32 accumulators start at +0.0 and so never end at -0.0.
    tests/ops/test_moe_dispatch.py feeds -0.0 output gradients to check it.)"""

    @staticmethod
    def forward(ctx, x, token, inverse, k):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        tokens, hidden = inverse.numel() // ctx.k, grad.shape[1]
        per_slot = grad.index_select(0, inverse).view(tokens, ctx.k, hidden)
        return per_slot.sum_to_size(tokens, 1, hidden).view(tokens, hidden), None, None, None


class _Permute(torch.autograd.Function):
    """out = x.index_select(0, index) for a permutation ``index`` whose inverse is ``inverse``; the gradient
    is the inverse gather (index_select's backward without its zero fill and scatter; it keeps a -0.0 that
    one turns into +0.0: this gradient only enters the grouped GEMMs' backward, whose fp32 accumulators
    start at +0.0, so their results are the same bits)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def gather_rows(x: torch.Tensor, plan: Dispatch, k: int) -> torch.Tensor:
    """x's rows in grouped order (rows[i] = x[plan.token[i]]): differentiable in x, deterministic backward."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatherRows.apply(x, plan.token, plan.inverse, k)
    return x.index_select(0, plan.token)


def ungroup_rows(grouped: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """The grouped rows back in slot order (out[s] = grouped[plan.inverse[s]]), differentiable."""
    if torch.is_grad_enabled() and grouped.requires_grad:
        return _Permute.apply(grouped, plan.inverse, plan.order)
    return grouped.index_select(0, plan.inverse)


__all__ = ["Dispatch", "dispatch", "gather_rows", "ungroup_rows"]
