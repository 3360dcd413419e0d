"""The varlen backward's length buckets by csrc/attention.c (CPU), with exactly the formulation's bits.

The formulation (:func:`.backward._backward_bucket`) runs, per key block, five padded bmm per bucket and
the elementwise steps between them; rl_attn_bwd_args / rl_attn_bwd_grads run the same IEEE operations
row by row (each dot product an fp32 FMA chain -- multiply-then-add under MKL COMPATIBLE -- in increasing
order from +0; torch's exp applied between the two, as in the formulation), without the padding, the gathers
and the per-block Python work.

That chain is what MKL's bmm computes for the bucket's GEMMs only where a block's row count (the M of
q k^T, dO v^T, ds k and the K of p^T dO, ds^T q) is 12 to 192 -- measured (torch 2.13, 2-core AMD EPYC,
AVX2): fewer rows take other kernels (1 to 3 rows always, 5 to 11 in a batch of one item), more than 192
split the K chain into blocks. Under MKL's COMPATIBLE branch (the cross-machine mode; the kernel is then built to
its multiply-then-add chains, csrc/common.h) a chain is cut every 112 rows, and the kernel's chains are not cut;
buckets of fewer than 12 rows a block differ there too (measured, GQA group 2: 4 to 10 rows): 12 to 112 there.
So a bucket runs here only when every one of its blocks is in that range
(:func:`bucket_shapes_fit`), and only after the kernel reproduced the formulation bit for bit on random
inputs for this head_dim, GQA group and thread count (:func:`bwd_matches`); every other bucket, and every
call where the check failed, runs the formulation -- the same bits either way.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from rlalign.contract.bits import bits_equal
from rlalign.ops.torch_backend import clib
from rlalign.ops.torch_backend.attention.backward import varlen_backward
from rlalign.ops.torch_backend.attention.compiled import CLayout
from rlalign.ops.torch_backend.attention.plan import KV_BLOCK
from rlalign.ops.torch_backend.attention.scratch import scratch_buffer

# a block's row count for which the kernel's chains are the library's (see the module docstring): MKL's native
# branches, its COMPATIBLE branch
MIN_BLOCK_ROWS, MAX_BLOCK_ROWS = 12, 192
COMPATIBLE_BLOCK_ROWS = (12, 112)


def block_rows() -> tuple[int, int]:
    """The (fewest, most) rows of a key block that the kernel takes with the library MKL runs in this process."""
    return COMPATIBLE_BLOCK_ROWS if clib.compatible() else (MIN_BLOCK_ROWS, MAX_BLOCK_ROWS)


def bucket_shapes_fit(longest: int, g: int) -> bool:
    """Whether every key block of a bucket padded to ``longest`` tokens has a row count (g per token) in
    :func:`block_rows`' range."""
    low, high = block_rows()
    n_blocks = (longest + KV_BLOCK - 1) // KV_BLOCK
    return all(low <= g * (longest - j * KV_BLOCK) <= high for j in range(n_blocks))


def bucket_compiled(seqs, start, length, src, grads, hq: int, hkv: int, scale: float, window) -> bool:
    """The ``bucket_route`` of :func:`.backward.varlen_backward`: computes the bucket ``seqs`` (sorted by
    length, descending) into ``grads`` and returns True where the kernel applies, else returns False."""
    d = src[0].shape[1]
    if (not _fits(seqs, length, src, hq, hkv, window) or clib.library() is None
            or not bwd_matches(d, hq // hkv, torch.get_num_threads())):
        return False
    _run_bucket(seqs, start, length, src, grads, hq, hkv, scale)
    return True


def _fits(seqs, length, src, hq: int, hkv: int, window) -> bool:
    """The kernel's scope: CPU, no sliding window, head_dim <= 256, every block's rows in :func:`block_rows`."""
    qf = src[0]
    return (window is None and qf.device.type == "cpu" and qf.shape[1] <= clib.MAX_HEAD_DIM
            and bucket_shapes_fit(int(length[seqs[0]]), hq // hkv))


def _run_bucket(seqs, start, length, src, grads, hq: int, hkv: int, scale: float) -> None:
    """The bucket's dq, dk, dv rows by csrc/attention.c (see bucket_compiled)."""
    lib = clib.library()
    qf, kf, vf, dof, lse_f, delta_f = src
    dq, dk, dv = grads
    st, ln = start[seqs], length[seqs]
    lay = CLayout.of(st, ln, torch.zeros_like(st), ln, key_start=st)
    layout = ctypes.byref(lay.struct(kf, vf, hq, hkv, qf.shape[1]))
    threads = torch.get_num_threads()
    p = scratch_buffer("bwd_p", (qf.shape[0], KV_BLOCK), qf.device)
    for j in range(lay.n_blocks):
        lib.rl_attn_bwd_args(layout, qf.data_ptr(), lse_f.data_ptr(), scale, j, p.data_ptr(), threads)
        torch.exp_(p)   # rows outside the bucket hold stale entries; the kernel never reads them
        lib.rl_attn_bwd_grads(layout, qf.data_ptr(), dof.data_ptr(), delta_f.data_ptr(), p.data_ptr(), scale, j,
                              dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), threads)


@functools.lru_cache(maxsize=None)
def bwd_matches(d: int, g: int, threads: int) -> bool:
    """Whether the kernel gave the formulation's dq, dk, dv bits for head_dim d and GQA group g at this thread
    count, on random inputs (:func:`bwd_agrees`); checked once before the first use."""
    return bwd_agrees(d, g, torch.Generator().manual_seed(2000 + 7 * d + g))


def bwd_agrees(d: int, g: int, gen: torch.Generator) -> bool:
    """Both routes of :func:`.backward.varlen_backward` on random fp32 inputs (2 kv heads, group g) whose buckets
    the kernel takes: lengths 1 up to the longest that fits, and where it fits (g <= 2; g = 1 under MKL's
    COMPATIBLE branch) a bucket whose sequences cross a key block. False also when the kernel took no bucket
    (nothing was checked)."""
    low, high = block_rows()
    top = min(30, high // g)
    if g * top < low:
        return False
    lens = [1, top, 3, max(1, top // 2), top - 1, 1]
    if bucket_shapes_fit(80, g):   # the native branches' g <= 2; g = 1 under COMPATIBLE
        lens += [80, 70, 64, 65, 2]
    hkv = 2
    hq = g * hkv
    t = sum(lens)
    q, dout, out = (torch.randn(t, hq, d, generator=gen) for _ in range(3))
    k, v = (torch.randn(t, hkv, d, generator=gen) for _ in range(2))
    lse = torch.randn(t, hq, generator=gen) + 3.0
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    taken = []

    def route(seqs, start, length, src, grads, hq, hkv, scale, window):   # bucket_compiled less the self-check
        taken.append(_fits(seqs, length, src, hq, hkv, window))
        if taken[-1]:
            _run_bucket(seqs, start, length, src, grads, hq, hkv, scale)
        return taken[-1]

    args = (q, k, v, out, lse, cu, dout, d ** -0.5)
    kernel = varlen_backward(*args, bucket_route=route)
    formula = varlen_backward(*args)
    return any(taken) and all(bits_equal(a, b) for a, b in zip(kernel[:3], formula[:3]))
