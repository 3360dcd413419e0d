"""Probe: does a warp-level ``mma.sync`` tile give each element the bits of Hopper's ``wgmma`` tile? (H200)

The strict attention fixes its MMA shape (rlalign/ops/triton_backend/attention.py: "mma always sees a 64-key
block and a tile of >= 64 rows on 4 or 8 warps laid along the rows"), so a decode item -- one token x the 4
query heads of a kv head -- fills 4 of 64 rows, and 15/16 of the softmax work is padding (the 8B shape at 512
sequences, H200 profile of 2026-12-03; docs/performance.md). A decode tile of 16 rows on one warp would compile to ``mma.sync``
m16n8k16 instead of ``wgmma`` m64nNk16. This probe answers whether the two give the same bits per element, on
the attention's two products, through the attention's own ``mma`` helper (bf16 operands, fp32 accumulator):

    qk   acc = 0 + q [rows, 128] @ k^T [128, 64]       (the scores; k loaded [64, 128] and transposed)
    pv   acc = acc0 + p [rows, 64] @ v [64, 128]      (the output update; acc0 nonzero, p in [0, 1])

Each trial is one program; the 64-row launch (4 warps: wgmma), the 128-row launch (8 warps: wgmma, the prefill
tile -- the control, equal by the contract) and the 16-row (1 warp) and 32-row (2 warps) launches (mma.sync) see
the same first 16 rows. Printed: per product and launch, how many of the compared elements differ in raw bits from
the 64-row launch's, and the first difference. ``--ptx`` (any machine: tests/sm90.py's stand-in driver) prints
which MMA instruction each launch compiles to instead of running.

    python benchmarks/mma_bits_probe.py [--trials 4096] [--ptx]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (rows, warps): the contract's tiles first (64 / 4: the decode tile, the reference; 128 / 8: prefill), then the
# warp-level ones the probe asks about
LAUNCHES = ((64, 4), (128, 8), (16, 1), (32, 2))
COMPARED_ROWS = 16
D, KEYS = 128, 64
# rlalign's mma helper (rlalign.ops.triton_backend._common.mma), bound by _bind_mma before the first compile: the
# backend package refuses to import without a CUDA device until --ptx's stand-in driver is active
mma = None


def _bind_mma() -> None:
    global mma
    from rlalign.ops.triton_backend._common import mma as helper
    mma = helper


@triton.jit
def probe_kernel(A, B, ACC0, C, BM: tl.constexpr, K: tl.constexpr, N: tl.constexpr, B_ROWS_N: tl.constexpr):
    """C[t] = ACC0[t] + A[t] @ B[t] on the first BM rows of trial t (rlalign's mma helper, bf16 operands). B_ROWS_N:
    B is stored [N, K] and transposed in registers, as the attention loads k."""
    t = tl.program_id(0).to(tl.int64)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, K)
    rn = tl.arange(0, N)
    a = tl.load(A + t * 128 * K + rm[:, None] * K + rk[None, :])
    if B_ROWS_N:
        b = tl.trans(tl.load(B + t * N * K + rn[:, None] * K + rk[None, :]))
    else:
        b = tl.load(B + t * K * N + rk[:, None] * N + rn[None, :])
    acc = tl.load(ACC0 + t * 128 * N + rm[:, None] * N + rn[None, :])
    tl.store(C + t * 128 * N + rm[:, None] * N + rn[None, :], mma(a, b, acc, False))


def products(trials: int, device) -> dict:
    """The two products' inputs, ``trials`` independent tiles each (128 rows: the largest launch)."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device) * scale
    q, k = randn(trials, 128, D).bfloat16(), randn(trials, KEYS, D).bfloat16()
    p = torch.rand(trials, 128, KEYS, generator=g, device=device).bfloat16()
    v, acc0 = randn(trials, KEYS, D).bfloat16(), randn(trials, 128, D, scale=10.0)
    return {"qk": (q, k, torch.zeros(trials, 128, KEYS, device=device), D, KEYS, True),
            "pv": (p, v, acc0, KEYS, D, False)}


def run(a, b, acc0, k, n, b_rows_n, rows, warps):
    out = torch.full_like(acc0, float("nan"))
    probe_kernel[(a.shape[0],)](a, b, acc0, out, BM=rows, K=k, N=n, B_ROWS_N=b_rows_n, num_warps=warps)
    return out[:, :COMPARED_ROWS]


def compare(trials: int) -> int:
    _bind_mma()
    for name, (a, b, acc0, k, n, b_rows_n) in products(trials, "cuda").items():
        ref = run(a, b, acc0, k, n, b_rows_n, *LAUNCHES[0])
        for rows, warps in LAUNCHES[1:]:
            out = run(a, b, acc0, k, n, b_rows_n, rows, warps)
            differ = (out.view(torch.int32) != ref.view(torch.int32))
            line = f"{name}: {rows} rows / {warps} warps vs 64 / 4: {int(differ.sum())} of {differ.numel()} differ"
            if differ.any():
                i = tuple(int(x) for x in differ.nonzero()[0])
                line += f" (first at trial/row/col {i}: {out[i].item()!r} vs {ref[i].item()!r})"
            print(line, flush=True)
    return 0


def ptx_report() -> int:
    """Which MMA instruction each launch compiles to (sm_90a, no GPU needed)."""
    from tests.sm90 import activate_fake_sm90
    activate_fake_sm90()
    _bind_mma()
    for rows, warps in LAUNCHES:
        for name, (a, b, acc0, k, n, b_rows_n) in products(2, "cpu").items():
            kernel = probe_kernel.warmup(a, b, acc0, acc0, BM=rows, K=k, N=n, B_ROWS_N=b_rows_n, num_warps=warps,
                                         grid=(1,))
            ptx = kernel.asm["ptx"]
            print(f"{name} {rows} rows / {warps} warps: wgmma {ptx.count('wgmma.mma_async')}, "
                  f"mma.sync {ptx.count('mma.sync.aligned')}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4096)
    ap.add_argument("--ptx", action="store_true", help="compile for sm_90a and print the MMA instructions instead")
    args = ap.parse_args()
    if args.trials < 1:
        ap.error(f"--trials must be >= 1, got {args.trials}")
    if args.ptx:
        return ptx_report()
    if not torch.cuda.is_available():
        print("mma_bits_probe: no CUDA device (--ptx compiles without one)")
        return 1
    return compare(args.trials)


if __name__ == "__main__":
    sys.exit(main())
