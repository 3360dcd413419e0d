"""The same arithmetic row by row, compiled (CPU): csrc/attention.c runs the formula of
:mod:`rlalign.ops.torch_backend.attention` for every query row, with torch's exp between its two per-block
halves.

It runs a call only where it gave the torch formulation's bits (:func:`compiled_matches`: a self-check per
head_dim and thread count before the first use); otherwise the formulation (:mod:`.formula`) runs -- the
same bits, slower.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch

from rlalign.contract.bits import bits_equal
from rlalign.contract.errors import fail
from rlalign.ops import _checks as chk
from rlalign.ops.torch_backend import clib
from rlalign.ops.torch_backend.attention.formula import NONFINITE_CACHE, paged_formula, varlen_formula
from rlalign.ops.torch_backend.attention.plan import KV_BLOCK
from rlalign.ops.torch_backend.attention.scratch import scratch_buffer


def compiled_applies(device: torch.device, d: int) -> bool:
    """Whether csrc/attention.c runs this call: on the CPU, when the kernels are built and reproduced
    the torch formulation bit for bit for this head_dim on this machine (:func:`compiled_matches`).
    Otherwise the torch formulation runs -- the same bits, slower."""
    return (device.type == "cpu" and d <= clib.MAX_HEAD_DIM and clib.library() is not None
            and compiled_matches(d, torch.get_num_threads()))


@functools.lru_cache(maxsize=None)
def compiled_matches(d: int, threads: int) -> bool:
    """The kernels compute q.k and p.v as increasing-order FMA chains (multiply-then-add under MKL COMPATIBLE), which
    is what the library's fixed-shape GEMM tiles of the formulation compute for the head dims seen (MKL, AVX2: 16
    to 128) -- but not for every one (d = 8: p.v is ordered otherwise; d = 256: q.k is split). So before the first
    use for a head_dim, both paths run a paged call (decode, prefill chunks, contexts of 1 to 3 key blocks) and a
    packed one on random inputs; the kernels are used only if every bit agrees. Per thread count too: the
    library's tiles may depend on it."""
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
    same = bits_equal(paged_compiled(*args), paged_formula(*args))
    qv, kv, vv = (torch.randn(sum(lens), h, d, generator=gen) for h in (hq, hkv, hkv))
    cuv = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    (oc, lc), (of, lf) = (path(qv, kv, vv, cuv, d ** -0.5) for path in (varlen_compiled, varlen_formula))
    return same and bits_equal(oc, of) and bits_equal(lc, lf)


@dataclasses.dataclass
class CLayout:
    """Per-sequence index arrays of one call (int64, contiguous; kept alive here for the C side)."""
    seqs: torch.Tensor                 # [4, S]: first query row, query count, first query position, context length
    block_table: torch.Tensor | None   # paged: [S, max_pages] page ids
    page_size: int
    key_start: torch.Tensor | None     # packed: token index of each sequence's position 0
    n_blocks: int                      # key blocks the call visits (64 positions each)

    @staticmethod
    def of(q_start, n_q, pos0, ctx_len, *, block_table=None, page_size: int = 1, key_start=None) -> "CLayout":
        seqs = torch.stack([q_start, n_q, pos0, ctx_len]).contiguous()
        last = torch.where(n_q > 0, pos0 + n_q - 1, -1)
        n_blocks = int(last.max()) // KV_BLOCK + 1 if last.numel() else 0
        if key_start is not None:
            key_start = key_start.contiguous()
        return CLayout(seqs, block_table, page_size, key_start, max(n_blocks, 0))

    def struct(self, k: torch.Tensor, v: torch.Tensor, hq: int, hkv: int, d: int) -> clib.Layout:
        seqs, ptr = self.seqs, self.seqs.data_ptr()
        row = seqs.stride(0) * seqs.element_size()
        table = self.block_table
        return clib.Layout(k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16), ptr, ptr + row,
                           ptr + 2 * row, ptr + 3 * row, table.data_ptr() if table is not None else None,
                           table.shape[1] if table is not None else 0, self.page_size,
                           self.key_start.data_ptr() if self.key_start is not None else None,
                           seqs.shape[1], hq, hkv, d)


def _c_online_softmax(lay: CLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hq: int, hkv: int,
                      scale: float):
    """The formula of :mod:`rlalign.ops.torch_backend.attention` for every query row of the call, by
    csrc/attention.c, with torch's exp applied between its two per-block halves (the same exp as the torch
    formulation).
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
    m = scratch_buffer("c_m", (rows,), q.device)
    m.fill_(float("-inf"))
    l = scratch_buffer("c_l", (rows,), q.device)
    l.zero_()
    acc, m_new = scratch_buffer("c_acc", (rows, d), q.device), scratch_buffer("c_m_new", (rows,), q.device)
    a, p = scratch_buffer("c_alpha", (rows,), q.device), scratch_buffer("c_p", (rows, KV_BLOCK), q.device)
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


def varlen_compiled(q, k, v, cu_seqlens, scale: float):
    t, hq, d = q.shape

    def layout():
        cu = cu_seqlens.to(dtype=torch.int64)
        start, length = cu[:-1], cu[1:] - cu[:-1]
        return CLayout.of(start, length, torch.zeros_like(start), length, key_start=start)

    lay = chk.memo("torch_attention_varlen_c_layout", layout, cu_seqlens, extra=(t,))
    out, m, l, _ = _c_online_softmax(lay, q, k, v, q.shape[1], k.shape[1], scale)
    return out.reshape(t, hq, d).to(q.dtype), (m + torch.log(l)).reshape(t, hq)


def paged_compiled(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float) -> torch.Tensor:
    t, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape

    def layout():
        cu = cu_seqlens_q.to(dtype=torch.int64)
        n_q, ctx_len = cu[1:] - cu[:-1], seq_lens.to(dtype=torch.int64)
        return CLayout.of(cu[:-1], n_q, ctx_len - n_q, ctx_len,
                           block_table=block_table.to(dtype=torch.int64).contiguous(), page_size=page_size)

    lay = chk.memo("torch_attention_paged_c_layout", layout, block_table, seq_lens, cu_seqlens_q,
                   extra=(t, page_size))
    out, _, _, bad = _c_online_softmax(lay, q, k_cache, v_cache, hq, hkv, scale)
    if bad:
        raise fail("attention_paged", NONFINITE_CACHE)
    return out.reshape(t, hq, d).to(q.dtype)
