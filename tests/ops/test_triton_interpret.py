"""Triton backend kernels under the CPU interpreter (TRITON_INTERPRET=1): indexing and masking.

The interpreter runs the kernels' Python semantics on numpy, in fp32 (it mis-rounds bf16, so
only fp32 is checked, and fp32 operands take an exact fp32 dot there instead of the GPU's bf16x3
split). What this covers: tile/segment/page/row index arithmetic, masks at every ragged edge,
TMA-descriptor and pointer paths, the segment-tree stack (registers and scratch), chunked
accumulation, every output element written (outputs pre-filled with NaN), pages outside a
context holding NaN never reaching the math. Each check compares with a float64 reference.
Bitwise invariance is a property of the GPU's instructions and is tested in tests/cuda.

All checks run in ONE subprocess (the interpreter must be switched on before triton is
imported); each test below reports one check's result.

A second subprocess (run concurrently) compiles the default kernels for Hopper (sm_90a) without a
GPU: Triton ships ptxas, so given a target the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX ->
cubin) runs anywhere. It installs a stand-in active driver reporting an sm_90 device, turns every
launch into a compile-only ``warmup`` and runs the real launchers on CPU tensors. Checked per
variant: it compiles, every dot kernel uses ``wgmma`` (the instruction family the bitwise
interchangeability of tile shapes relies on, docs/design/tile-shapes.md), its shared memory fits the 227 KiB of an
sm_90 block. It relies on Triton internals (the driver hook, JITFunction.run): if those are not as
expected the sm_90a tests skip rather than fail.
"""

from __future__ import annotations

import dataclasses
import json
import re
import os
import subprocess
import sys
import traceback

import pytest

from tests.workers import collect, spawn

TOL = 2e-5  # fp32 kernels vs float64 (relative to the reference's max magnitude)
SMEM_LIMIT = 232448   # bytes of shared memory per block on sm_90


# ---- worker side (runs in the subprocess) ------------------------------------------------------------

def _patch_interpreter():
    """numpy >= 2.3 refuses int() of a 1-element 1-d array, which Triton 3.6's interpreter uses for
    program ids in ``range``; give its tensors an __index__ that works."""
    import numpy as np
    import triton.runtime.interpreter as interp
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def _rel(a, ref):
    import torch
    a, ref = a.double(), ref.double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def _check_gemm():
    import torch
    from rlalign.ops.triton_backend.gemm import GemmConfig, gemm
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    cases = [  # m, n, k, segments, a_trans, b_trans, config, use_tma, bias
        (5, 70, 96, 1, False, True, GemmConfig(64, 32, 4, 2), None, True),
        (130, 70, 256, 8, False, True, GemmConfig(64, 32, 4, 2, reg_levels=1), None, False),
        (130, 72, 256, 4, False, True, GemmConfig(64, 64, 4, 2), False, True),
        (70, 40, 96, 2, False, True, GemmConfig(64, 32, 4, 2), None, False),   # seg_k 48: pointer path
        (70, 48, 128, 1, True, False, GemmConfig(64, 32, 4, 2), None, False),  # dW layout
        (70, 48, 128, 1, False, False, GemmConfig(64, 32, 4, 2), False, False),  # dX layout
        (1, 33, 64, 1, False, True, GemmConfig(128, 64, 8, 2, flatten=True), None, True),
        (65, 40, 64, 8, False, True, GemmConfig(64, 32, 4, 2), None, True),     # 8-column segments
        (70, 48, 1024, 8, False, True, GemmConfig(64, 32, 4, 2), True, False),  # 2 k-steps per segment
        (70, 48, 1024, 8, False, True, GemmConfig(64, 32, 4, 2, nested=True), True, False),  # a loop per segment
        (130, 70, 384, 4, False, True, GemmConfig(64, 32, 4, 2, nested=True), None, True),
        # the decode tiles of 16 / 32 rows (gemm.SMALL_M_TILES): M off and on the tile, several row tiles
        (5, 70, 192, 1, False, True, GemmConfig(16, 32, 4, 2, flatten=True), None, True),
        (40, 70, 256, 1, False, True, GemmConfig(16, 64, 4, 2, flatten=True, ctas_per_sm=2), None, False),
        (33, 48, 128, 1, False, True, GemmConfig(32, 64, 4, 2, flatten=True), False, True),
    ]
    for m, n, k, seg, at, bt, cfg, tma, has_bias in cases:
        a = torch.randn((k, m) if at else (m, k), generator=g)
        b = torch.randn((n, k) if bt else (k, n), generator=g)
        bias = torch.randn(n, generator=g) if has_bias else None
        out = torch.full((m, n), float("nan"))
        gemm(a, b, a_trans=at, b_trans=bt, bias=bias, segments=seg, config=cfg, use_tma=tma, out=out)
        ref = (a.double().T if at else a.double()) @ (b.double().T if bt else b.double())
        if bias is not None:
            ref = ref + bias.double()
        worst = max(worst, _rel(out, ref))
    # a reduction split across calls at multiples of 64 (acc_in) equals one call
    a, b = torch.randn(40, 320, generator=g), torch.randn(320, 24, generator=g)
    acc = torch.zeros(40, 24)
    for k0 in (0, 128, 192):
        k1 = {0: 128, 128: 192, 192: 320}[k0]
        gemm(a[:, k0:k1], b[k0:k1], out=acc, acc_in=True, config=GemmConfig(64, 32, 4, 2))
    worst = max(worst, _rel(acc, a.double() @ b.double()))
    return worst


def _check_gemm_split_segments():
    """Decode-sized M on a K partition: per-segment partials + the tree kernel give the one-kernel tree's
    values (same 64x64 tile, so numpy's dots agree too), every element written, bias and fp32 output,
    segments of whole steps (TMA) and of 48 columns (pointer path, masked), the dX layout."""
    import torch
    from rlalign.ops.triton_backend.gemm import SPLIT_SEGMENTS_MAX_M, GemmConfig, SegmentSplitConfig, gemm
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for m, n, k, seg, bt, has_bias, out_dtype in ((1, 70, 512, 8, True, True, torch.float32),
                                                  (5, 128, 768, 4, True, False, torch.float32),
                                                  (SPLIT_SEGMENTS_MAX_M, 40, 96, 2, True, True, torch.float32),
                                                  (3, 72, 256, 8, False, False, torch.float32)):
        a = torch.randn(m, k, generator=g)
        b = torch.randn((n, k) if bt else (k, n), generator=g)
        bias = torch.randn(n, generator=g) if has_bias else None
        out = torch.full((m, n), float("nan"), dtype=out_dtype)
        gemm(a, b, b_trans=bt, bias=bias, segments=seg, out=out)
        one = gemm(a, b, b_trans=bt, bias=bias, segments=seg, out_dtype=out_dtype, config=GemmConfig(64, 64, 4, 2))
        if not torch.equal(out, one):
            return f"split partials differ from the one-kernel tree (m={m}, n={n}, k={k}, P={seg})"
        ref = a.double() @ (b.double().T if bt else b.double())
        if bias is not None:
            ref = ref + bias.double()
        worst = max(worst, _rel(out, ref))
    # an explicit split launch takes the split past SPLIT_SEGMENTS_MAX_M (benchmarks/gpu_linear.py --sweep-mid): five
    # 64-row tiles, the last one partial
    a, b = torch.randn(SPLIT_SEGMENTS_MAX_M + 5, 128, generator=g), torch.randn(72, 128, generator=g)
    forced = gemm(a, b, b_trans=True, segments=4, out_dtype=torch.float32, split=SegmentSplitConfig())
    one = gemm(a, b, b_trans=True, segments=4, out_dtype=torch.float32, config=GemmConfig(64, 64, 4, 2))
    if not torch.equal(forced, one):
        return f"a forced split at M={a.shape[0]} differs from the one-kernel tree"
    return worst


def _attn_ref(q, k, v, lens, scale):
    from tests.references import causal_attention_float64
    return causal_attention_float64(q, k, v, lens, scale)


def _check_attention():
    import torch
    from rlalign.ops.triton_backend import attention as A
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for hq, hkv, d, lens in ((4, 2, 64, [1, 70, 130]), (3, 3, 48, [65, 2])):
        t = sum(lens)
        q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        scale = d ** -0.5
        ref = _attn_ref(q, k, v, lens, scale)
        worst = max(worst, _rel(A.varlen_forward(q, k, v, cu, scale, tile=(64, 4, 1))[0], ref))
        # the longest sequence through a paged cache (NaN outside its context), in chunks
        ps, n, s0 = 16, max(lens), sum(lens[:lens.index(max(lens))])
        pages = -(-n // ps)
        perm = torch.randperm(pages + 3, generator=g)[:pages]
        kc = torch.full((pages + 3, ps, hkv, d), float("nan"))
        vc = kc.clone()
        for p in range(n):
            kc[perm[p // ps], p % ps], vc[perm[p // ps], p % ps] = k[s0 + p], v[s0 + p]
        table = torch.cat([perm, torch.zeros(2, dtype=perm.dtype)]).to(torch.int32).unsqueeze(0)
        for a, b in ((0, n // 2), (n // 2, n // 2 + 1), (n // 2 + 1, n)):
            out = A.paged_forward(q[s0 + a:s0 + b], kc, vc, table, torch.tensor([b], dtype=torch.int32),
                                  torch.tensor([0, b - a], dtype=torch.int32), scale, tile=(64, 4, 1))
            worst = max(worst, _rel(out, ref[s0 + a:s0 + b]))
        # backward against float64 autograd
        qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
        r = _attn_ref(qd, kd, vd, lens, scale)
        go = torch.randn(r.shape, generator=g)
        r.backward(go.double())
        out, lse = A.varlen_forward(q, k, v, cu, scale, store_lse=True, tile=(64, 4, 1))
        grads = A.varlen_backward(q, k, v, out, lse, cu, go, scale, tile=(64, 4, 1))
        for got, want in zip(grads, (qd.grad, kd.grad, vd.grad)):
            worst = max(worst, _rel(got, want))
    return worst


def _shuffled_cache(k, v, lens, page_size, g):
    """Every sequence's K/V in randomly placed pages of a NaN-filled cache -> (k_cache, v_cache, table)."""
    import torch
    pages = [-(-n // page_size) for n in lens]
    total = sum(pages) + 3
    perm = torch.randperm(total, generator=g).tolist()
    kc = torch.full((total, page_size) + tuple(k.shape[1:]), float("nan"))
    vc = kc.clone()
    table = torch.zeros((len(lens), max(pages) + 1), dtype=torch.int32)
    start, used = 0, 0
    for s, n in enumerate(lens):
        ids = perm[used:used + pages[s]]
        used += pages[s]
        table[s, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for p in range(n):
            kc[ids[p // page_size], p % page_size] = k[start + p]
            vc[ids[p // page_size], p % page_size] = v[start + p]
        start += n
    return kc, vc, table


def _check_attention_splits():
    """Key splits of spec.ATTN_KV_SPLIT (the production value) across their boundaries: the packed
    forward (two tiles), one-shot and chunked paged prefill (chunks starting mid-split), batched and
    single-sequence decode, each through the per-tile and the split-program launch, give the packed
    forward's bits (the interpreter's row-wise dot, fp32), and all are accurate vs float64. Contexts
    just below / at / above multiples of the split, pages shuffled (NaN outside contexts)."""
    import torch
    from rlalign.contract.bits import bits_equal, describe_difference
    from rlalign.contract.spec import ATTN_KV_SPLIT as S
    from rlalign.ops import capturing_graph
    from rlalign.ops.triton_backend import attention as A
    g = torch.Generator().manual_seed(7)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    hq, hkv, d = 2, 1, 16   # the interpreter's cost is per program: one kv head (GQA 3/1 below)
    lens = [S + 1, 1, 2 * S + 1, 70]   # decoding 0, 1, 2 tokens before the end: contexts S-1..S+1, 2S-1..2S+1
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    cu = i32([0] + list(torch.tensor(lens).cumsum(0)))
    scale = d ** -0.5
    packed = A.varlen_forward(q, k, v, cu, scale, tile=(64, 4, 1))[0]
    worst = _rel(packed, _attn_ref(q, k, v, lens, scale))
    starts = [int(x) for x in cu[:-1]]

    def same(out, rows, what):
        if not bits_equal(out, packed[rows]):
            raise AssertionError(f"{what}: not bitwise equal to the packed forward: "
                                 f"{describe_difference(out, packed[rows])}")
    for page_size in (16, 64):   # page 64: batched decode only (the layout is shuffled at both sizes)
        kc, vc, table = _shuffled_cache(k, v, lens, page_size, g)
        for split_programs in (False, True):
            how = f"page {page_size}, split programs {split_programs}"
            for back in (0, 1, 2) if page_size == 16 else (1,):
                # every sequence decodes one token together, `back` tokens before its end
                ctx = [max(n - back, 1) for n in lens]
                rows = [st + c - 1 for st, c in zip(starts, ctx)]
                out = A.paged_forward(q[rows], kc, vc, table, i32(ctx), i32(list(range(len(lens) + 1))), scale,
                                      split_programs=split_programs)
                same(out, rows, f"batched decode {back} before the end ({how})")
            if page_size == 64:
                continue
            out = A.paged_forward(q, kc, vc, table, i32(lens), cu, scale, split_programs=split_programs)
            same(out, slice(0, t), f"one-shot paged prefill, the {A.PREFILL_TILE} tile ({how})")
            s, n = 2, lens[2]   # the 2S+1 sequence in chunks that start and end mid-split
            for a, b in ((0, 100), (100, S - 1), (S - 1, S + 3), (S + 3, 2 * S), (2 * S, n)):
                out = A.paged_forward(q[starts[s] + a:starts[s] + b], kc, vc, table[s:s + 1], i32([b]),
                                      i32([0, b - a]), scale, split_programs=split_programs)
                same(out, slice(starts[s] + a, starts[s] + b), f"chunk [{a}, {b}) ({how})")
            with capturing_graph(max_query_len=1):   # as in a decode graph: the split grid from the table width
                rows = [st + n - 1 for st, n in zip(starts, lens)]
                out = A.paged_forward(q[rows], kc, vc, table, i32(lens), i32(list(range(len(lens) + 1))), scale,
                                      split_programs=split_programs)
                same(out, rows, f"batched decode while capturing ({how})")
            for pos in (S - 1, S):   # one sequence alone, its rows on both sides of a split
                row = starts[2] + pos
                out = A.paged_forward(q[row:row + 1], kc, vc, table[2:3], i32([pos + 1]), i32([0, 1]), scale,
                                      split_programs=split_programs)
                same(out, [row], f"decode alone at position {pos} ({how})")
    # fewer programs than splits: program p walks splits p, p + P, ... (P = 1: one walks all 3; P = 2)
    kc, vc, table = _shuffled_cache(k, v, lens, 16, g)
    rows = [st + n - 1 for st, n in zip(starts, lens)]
    for progs in (1, 2):
        out = A.paged_forward(q[rows], kc, vc, table, i32(lens), i32(list(range(len(lens) + 1))), scale,
                              split_programs=True, progs_per_item=progs)
        same(out, rows, f"batched decode, {progs} programs per sequence")
        s = 2
        out = A.paged_forward(q[starts[s] + S - 3:starts[s] + 2 * S + 1], kc, vc, table[s:s + 1], i32([2 * S + 1]),
                              i32([0, S + 4]), scale, split_programs=True, progs_per_item=progs)
        same(out, slice(starts[s] + S - 3, starts[s] + 2 * S + 1), f"chunk [{S - 3}, {2 * S + 1}), {progs} programs")
    # a GQA group of 3 with padded head_dim 48 through the split programs
    q3, k3, v3 = (torch.randn(S + 2, h, 48, generator=g) for h in (3, 1, 1))
    cu3 = i32([0, S + 2])
    ref3 = A.varlen_forward(q3, k3, v3, cu3, 0.2, tile=(64, 4, 1))[0]
    kc, vc, table = _shuffled_cache(k3, v3, [S + 2], 16, g)
    for pos in (0, S - 1, S, S + 1):
        out = A.paged_forward(q3[pos:pos + 1], kc, vc, table, i32([pos + 1]), i32([0, 1]), 0.2, split_programs=True)
        if not bits_equal(out, ref3[pos:pos + 1]):
            raise AssertionError(f"G=3, D=48 decode at {pos}: {describe_difference(out, ref3[pos:pos + 1])}")
    worst = max(worst, _rel(ref3, _attn_ref(q3, k3, v3, [S + 2], 0.2)))
    return max(worst, _split_sweep(g))


def _split_sweep(g):
    """Seeded random shapes, degenerate ones included (context 1, G = 1 or 3, head_dim 2, pages of 1 and 3
    slots, 1..5 programs per item): a decode row through the split programs equals the per-item decode and
    the same row inside a prefill chunk, and is accurate vs float64."""
    import torch
    from rlalign.contract.bits import bits_equal, describe_difference
    from rlalign.contract.spec import ATTN_KV_SPLIT as S
    from rlalign.ops.triton_backend import attention as A
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    worst = 0.0
    for case in range(6):
        hkv, grp = [(1, 1), (1, 3), (2, 2), (1, 4)][case % 4]
        d = [2, 16, 40][case % 3]
        page = [1, 3, 16, 64][(case // 2) % 4]
        n = 1 if case == 0 else int(torch.randint(2, (2 if case % 2 else 1) * S + 40, (1,), generator=g))
        progs = 1 + case % 5
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (hkv * grp, hkv, hkv))
        kc, vc, table = _shuffled_cache(k, v, [n], page, g)
        pos = n - 1 if case % 2 else int(torch.randint(0, n, (1,), generator=g))
        a = max(pos - 2, 0)
        what = f"case {case}: n={n} pos={pos} G={grp} D={d} page={page} P={progs}"
        split = A.paged_forward(q[pos:pos + 1], kc, vc, table, i32([pos + 1]), i32([0, 1]), 0.3, split_programs=True,
                                progs_per_item=progs)
        item = A.paged_forward(q[pos:pos + 1], kc, vc, table, i32([pos + 1]), i32([0, 1]), 0.3, split_programs=False)
        chunk = A.paged_forward(q[a:pos + 1], kc, vc, table, i32([pos + 1]), i32([0, pos + 1 - a]), 0.3)[-1:]
        for other, name in ((item, "per-item decode"), (chunk, "prefill chunk")):
            if not bits_equal(split, other):
                raise AssertionError(f"{what}: split decode vs {name}: {describe_difference(split, other)}")
        worst = max(worst, _rel(split, _attn_ref(q, k, v, [n], 0.3)[pos:pos + 1]))
    return worst


def _check_logprob():
    import torch
    from rlalign.ops.triton_backend import logprob as L
    g = torch.Generator().manual_seed(2)
    L.GRAD_CHUNK = 256     # three backward vocab chunks (256, 256, 188): dh carried across them
    t, h, v = 70, 64, 700  # v: the last vocab tile is partial; t: the last token tile too
    hid, w = torch.randn(t, h, generator=g), torch.randn(v, h, generator=g) * 0.3
    tgt = torch.randint(0, v, (t,), generator=g)
    worst = 0.0
    for temp in (1.0, 0.7):
        lp, ent, lse, mu = L.forward_stats(hid, w, tgt, temp, True)
        hd, wd = hid.double().requires_grad_(), w.double().requires_grad_()
        logp = torch.log_softmax(hd @ wd.T / temp, -1)
        rlp = logp.gather(1, tgt[:, None]).squeeze(1)
        rent = -(logp.exp() * logp).sum(-1)
        worst = max(worst, float((lp.double() - rlp.detach()).abs().max()), float((ent.double() - rent.detach()).abs().max()))
        g_lp, g_ent = torch.randn(t, generator=g), torch.randn(t, generator=g)
        (rlp * g_lp.double() + rent * g_ent.double()).sum().backward()
        dh, dw = L.backward_grads(hid, w, tgt, lse, mu, temp, g_lp, g_ent, True, True)
        worst = max(worst, _rel(dh, hd.grad), _rel(dw, wd.grad))
        worst = max(worst, _rel(L.lm_logits(hid, w, temp, 8192), hd.detach() @ wd.detach().T / temp))
        lp2, ent2, _, _ = L.forward_stats(hid, w, tgt, temp, False)
        worst = max(worst, float((lp2.double() - rlp.detach()).abs().max()))
        assert ent2 is None
    return worst


def _check_logprob_last_tile():
    """V with a last vocab tile of one entry (257, 513), a whole last tile (256) and V = 1, with and
    without entropy: vs float64; the logprob the same with and without entropy (fp32: the interpreter
    mis-rounds bf16)."""
    import torch
    from rlalign.ops.triton_backend import logprob as L
    g = torch.Generator().manual_seed(5)
    worst = 0.0
    for v in (1, 2, 256, 257, 513):
        t, h = 5, 64
        hid, w = torch.randn(t, h, generator=g), torch.randn(v, h, generator=g) * 0.3
        tgt = torch.randint(0, v, (t,), generator=g)
        for temp in (1.0, 0.7):
            lp, ent, _, _ = L.forward_stats(hid, w, tgt, temp, True)
            lp_only, none, _, _ = L.forward_stats(hid, w, tgt, temp, False)
            if none is not None or not torch.equal(lp_only, lp):
                return f"V={v}: the logprob without entropy differs from the one with it"
            logp = torch.log_softmax(hid.double() @ w.double().T / temp, -1)
            rlp, rent = logp.gather(1, tgt[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)
            worst = max(worst, float((lp.double() - rlp).abs().max()), float((ent.double() - rent).abs().max()))
    return worst


def _check_elementwise():
    import torch
    from rlalign.ops.triton_backend import elementwise as E
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for rows, hdim in ((37, 100), (5, 1024)):
        x, w = torch.randn(rows, hdim, generator=g), torch.randn(hdim, generator=g)
        y, inv = E.rms_forward(x, w, 1e-6)
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        ref = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * wd
        worst = max(worst, _rel(y, ref))
        dy = torch.randn(rows, hdim, generator=g)
        ref.backward(dy.double())
        dx, dw = E.rms_backward(x, w, dy, inv)
        worst = max(worst, _rel(dx, xd.grad), _rel(dw, wd.grad))
        # the residual add in the same kernel: the stream and the normed rows of the add done first, raw bits
        r = torch.randn(rows, hdim, generator=g)
        y_res, _, stream = E.rms_forward(x, w, 1e-6, r)
        if not (torch.equal(stream, x + r) and torch.equal(y_res, E.rms_forward(x + r, w, 1e-6)[0])):
            worst = float("inf")
    t, heads, d = 9, 3, 64
    x = torch.randn(t, heads, d, generator=g)
    ang = torch.rand(t, d // 2, generator=g).double() * 10
    cos, sin = ang.cos().float(), ang.sin().float()
    xd = x.double().requires_grad_()
    c, s = cos.double()[:, None], sin.double()[:, None]
    ref = torch.cat([xd[..., :d // 2] * c - xd[..., d // 2:] * s, xd[..., d // 2:] * c + xd[..., :d // 2] * s], -1)
    worst = max(worst, _rel(E._rope_launch(x, cos, sin, 1.0), ref))
    dy = torch.randn(t, heads, d, generator=g)
    ref.backward(dy.double())
    worst = max(worst, _rel(E._rope_launch(dy, cos, sin, -1.0), xd.grad))
    gt, up = torch.randn(3001, generator=g), torch.randn(3001, generator=g)
    gd, ud = gt.double().requires_grad_(), up.double().requires_grad_()
    ref = gd / (1 + torch.exp(-gd)) * ud
    worst = max(worst, _rel(E.silu_mul(gt, up), ref))
    both = torch.randn(7, 2 * 1500, generator=g)   # gate/up as column views of one tensor: read in place, same bits
    if not torch.equal(E.silu_mul(both[:, :1500], both[:, 1500:]),
                       E.silu_mul(both[:, :1500].contiguous(), both[:, 1500:].contiguous())):
        worst = float("inf")
    dy = torch.randn(3001, generator=g)
    ref.backward(dy.double())
    dg, du = E._SiluMul.backward(type("Ctx", (), {"saved_tensors": (gt, up)})(), dy)
    worst = max(worst, _rel(dg, gd.grad), _rel(du, ud.grad))
    return worst


def _check_sample():
    import torch
    from rlalign.ops import static_decode
    from rlalign.ops.torch_backend import sample as reference
    from rlalign.ops.triton_backend import sample as S
    g = torch.Generator().manual_seed(4)
    rows, vocab = 6, 5000  # vocab: the last 2048-block is partial
    logits = torch.randn(rows, vocab, generator=g) * 3
    args = (torch.full((rows,), 1234), torch.arange(rows), torch.arange(rows) * 7,
            torch.tensor([0.9, 0.0, 1.0, 0.7, 0.9, 1.3]))
    # min-p reaches a backend as a tighter top-k (ops.sample applies reference.min_p_top_k before dispatching)
    z = logits / torch.where(args[3] == 0, 1.0, args[3]).unsqueeze(-1)
    min_p_k = reference.min_p_top_k(z, torch.tensor([0, 0, 50, 0, 3, 0]), torch.tensor([0.05, 0.0, 0.2, 0.01, 0.5, 0.3]))
    for top_k, top_p in ((torch.tensor([0, 0, 50, 0, 10, 0]), torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 1.0])),
                         (torch.zeros(rows, dtype=torch.int64), torch.ones(rows)),
                         (min_p_k, torch.tensor([1.0, 1.0, 0.9, 1.0, 0.8, 1.0]))):
        want = reference.sample(logits, *args, top_k, top_p)
        got = S.sample(logits, *args, top_k, top_p)
        with static_decode():   # the CUDA-graph form: every row's keep mask from a full sort, same tokens
            got_static = S.sample(logits, *args, top_k, top_p)
        for name, tokens in (("eager", got), ("static form", got_static)):
            if not torch.equal(tokens, want):
                return f"{name} tokens {tokens.tolist()} != torch backend {want.tolist()}"
    return 0.0


def _check_grouped():
    """MoE grouped GEMMs: idle experts, 1-row and multi-tile experts, ragged N/K, canonical segments;
    forward, dX and dW against float64 per expert (an unwritten row would hold stale memory and fail)."""
    import torch
    from rlalign.ops.triton_backend import grouped as G
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for counts, n, k, seg in (([0, 1, 70, 0, 130], 70, 96, 1), ([3, 0, 65], 40, 256, 8), ([2, 2], 33, 64, 2),
                              ([0, 0, 0], 16, 64, 1)):
        rows = sum(counts)
        e_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        x = torch.randn(rows, k, generator=g)
        ws = [torch.randn(n, k, generator=g) for _ in counts]
        off = G.expert_offsets(e_of_row, len(counts))
        out = G.grouped_rows(x, off, ws, segments=seg)
        if seg > 1:   # the loop-per-segment structure gives the same values (same tile: numpy's dot may not)
            flat = G.grouped_rows(x, off, ws, segments=seg, config=G.GroupedConfig(64, 32, 4, 2))
            nested = G.grouped_rows(x, off, ws, segments=seg, config=G.GroupedConfig(64, 32, 4, 2, nested=True))
            if rows and not torch.equal(nested, flat):
                return "nested segments differ from the flat loop"
        ref = torch.cat([x[e_of_row == e].double() @ w.double().T for e, w in enumerate(ws)]) if rows else None
        if rows:
            worst = max(worst, _rel(out, ref))
            gy = torch.randn(rows, n, generator=g)
            gx = G.grouped_rows(gy, off, ws, transpose_w=False)
            ref_gx = torch.cat([gy[e_of_row == e].double() @ w.double() for e, w in enumerate(ws)])
            worst = max(worst, _rel(gx, ref_gx))
            gw = G.grouped_weight_grad(gy, x, off, len(ws), torch.float32)
            ref_gw = torch.stack([gy[e_of_row == e].double().T @ x[e_of_row == e].double() for e in range(len(ws))])
            worst = max(worst, _rel(gw, ref_gw))
            if any(c == 0 for c in counts) and bool((gw[[i for i, c in enumerate(counts) if c == 0]] != 0).any()):
                return "an idle expert's weight gradient is not zero"
        elif out.shape != (0, n):
            return f"empty input gave {tuple(out.shape)}"
    # experts whose weights do not share one layout are refused by name (strict fails closed)
    from rlalign.contract.errors import ContractError
    try:
        G.grouped_rows(torch.randn(3, 64), torch.tensor([0, 1, 3]), [torch.randn(8, 64), torch.randn(64, 8).t()])
        return "mixed expert weight layouts were not refused"
    except ContractError as exc:
        if "moe_experts" not in str(exc):
            return f"refusal does not name the op: {exc}"
    return worst


def _check_grouped_stacked():
    """Stacked expert weights [E, N, K] -- contiguous, and a strided slice of a fused [E, 2N, K] tensor (Hugging
    Face's gate_up_proj) -- give the per-expert list's bits in forward and dX; through autograd a stacked weight
    is ONE input whose gradient is the [E, N, K] dW (zeros for an idle expert), equal to the list's dW_e; a
    misaligned expert step is refused naming the op."""
    import torch
    from rlalign.contract.errors import ContractError
    from rlalign.ops.triton_backend import grouped as G
    g = torch.Generator().manual_seed(5)
    counts, n, k = [0, 3, 70, 1], 40, 128
    rows = sum(counts)
    e_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    off = G.expert_offsets(e_of_row, len(counts))
    x = torch.randn(rows, k, generator=g)
    fused = torch.randn(len(counts), 2 * n, k, generator=g)
    for name, stacked in (("contiguous", fused[:, :n].contiguous()), ("strided", fused[:, n:])):
        ws = [w.contiguous() for w in stacked.unbind(0)]
        for seg in (1, 2):
            if not torch.equal(G.grouped_rows(x, off, stacked, segments=seg), G.grouped_rows(x, off, ws, segments=seg)):
                return f"{name} stacked forward (segments={seg}) differs from the per-expert list"
        gy = torch.randn(rows, n, generator=g)
        if not torch.equal(G.grouped_rows(gy, off, stacked, transpose_w=False),
                           G.grouped_rows(gy, off, ws, transpose_w=False)):
            return f"{name} stacked dX differs from the per-expert list"
        leaf = stacked.detach().clone().requires_grad_(True) if name == "contiguous" else None
        base = fused.detach().clone().requires_grad_(True)
        weight = leaf if leaf is not None else base[:, n:]
        xs = x.clone().requires_grad_(True)
        y = G.grouped_linear(xs, off, weight)
        edges = [fn for fn, _ in y.grad_fn.next_functions if fn is not None]
        if len(edges) != 2:     # x and the one stacked weight
            return f"{name}: the grouped linear has {len(edges)} differentiable inputs, want 2"
        y.backward(gy)
        got = leaf.grad if leaf is not None else base.grad[:, n:]
        if not torch.equal(got, G.grouped_weight_grad(gy, x, off, len(counts), torch.float32)):
            return f"{name}: the stacked weight's gradient is not the grouped dW"
        if leaf is None and bool((base.grad[:, :n] != 0).any()):
            return "the fused tensor's other half got a gradient"
        if bool((got[0] != 0).any()):
            return "an idle expert's stacked gradient slice is not zero"
    try:
        G.grouped_rows(x, off, torch.randn(len(counts), n, k + 1, generator=g)[:, :, 1:])
        return "a stacked weight with unaligned rows was not refused"
    except ContractError as exc:
        if "moe_experts" not in str(exc):
            return f"refusal does not name the op: {exc}"
    return 0.0


def _check_combine():
    """MoE combine: slots taken in expert order (ids in any slot order, k = 1 / 3 (padded) / 8), ragged H;
    fp32 forward equals the torch backend's bit for bit (both are separate multiplies and adds here),
    dy = g * w exactly, dw against float64."""
    import torch
    from rlalign.ops.torch_backend.moe import combine as torch_combine
    from rlalign.ops.triton_backend.combine import combine
    g = torch.Generator().manual_seed(5)
    worst = 0.0
    for tokens, k, h, n_experts in ((5, 8, 300, 16), (3, 3, 64, 7), (4, 1, 17, 2), (0, 2, 32, 4)):
        y = torch.randn(tokens, k, h, generator=g).requires_grad_()
        w = torch.rand(tokens, k, generator=g).requires_grad_()
        experts = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(tokens)]) if tokens \
            else torch.zeros(0, k, dtype=torch.int64)
        out = combine(y, w, experts)
        if not torch.equal(out, torch_combine(y, w, experts)):
            return f"forward differs from the torch backend (T={tokens}, k={k}, H={h})"
        if not tokens:
            continue
        order = torch.argsort(experts, dim=1)
        ref = (y.detach().double().gather(1, order.unsqueeze(-1).expand_as(y)) *
               w.detach().double().gather(1, order).unsqueeze(-1)).sum(1)
        worst = max(worst, _rel(out.detach(), ref))
        gout = torch.randn(tokens, h, generator=g)
        dy, dw = torch.autograd.grad(out, [y, w], gout)
        if not torch.equal(dy, gout.unsqueeze(1) * w.detach().unsqueeze(-1)):
            return "dy is not g * w"
        worst = max(worst, _rel(dw, (gout.double().unsqueeze(1) * y.detach().double()).sum(-1)))
    return worst


def _check_route():
    """MoE routing kernel: E = 2 / 8 / 128, k = 1 / 3 (padded) / 8, normalize on and off, ties (equal logits
    pick the lower expert); experts equal to the torch backend's, weights against float64 (the interpreter's
    exp is numpy's, not libdevice's: bits are the CUDA tier's), the router gradient the torch formulation's."""
    import torch
    from rlalign.ops.torch_backend.moe import route as torch_route
    from rlalign.ops.triton_backend.route import route
    g = torch.Generator().manual_seed(6)
    worst = 0.0
    for tokens, n_experts, k, normalize in ((7, 128, 8, True), (5, 8, 3, False), (3, 2, 1, True), (0, 16, 2, True)):
        logits = torch.randn(tokens, n_experts, generator=g)
        if tokens and n_experts > 5:
            logits[0, 3] = logits[0, 5] = logits[0].max() + 1.0      # a tie for the top: expert 3 first
        logits.requires_grad_()
        experts, weights = route(logits, k, normalize)
        ref_e, ref_w = torch_route(logits, k, normalize)
        if not torch.equal(experts, ref_e):
            return f"experts differ from the torch backend (E={n_experts}, k={k})"
        if tokens and n_experts > 5 and int(experts[0, 0]) != 3:
            return "a tie did not go to the lower expert index"
        if not tokens:
            continue
        p = torch.softmax(logits.detach().double(), -1).gather(1, experts)
        ref = p / p.sum(-1, keepdim=True) if normalize else p
        worst = max(worst, _rel(weights.detach(), ref))
        gw = torch.randn(tokens, k, generator=g)
        if not torch.equal(torch.autograd.grad(weights, logits, gw)[0], torch.autograd.grad(ref_w, logits, gw)[0]):
            return "the router gradient is not the torch formulation's"
    return worst


CHECKS = {"gemm": _check_gemm, "attention": _check_attention, "attention_splits": _check_attention_splits,
          "logprob": _check_logprob,
          "logprob_last_tile": _check_logprob_last_tile, "elementwise": _check_elementwise, "sample": _check_sample,
          "grouped": _check_grouped, "combine": _check_combine,
          "route": _check_route, "gemm_split_segments": _check_gemm_split_segments,
          "grouped_stacked": _check_grouped_stacked}


def _worker() -> None:
    _patch_interpreter()
    results = {}
    for name, fn in CHECKS.items():
        try:
            results[name] = fn()
        except Exception:  # report, go on with the other checks
            results[name] = "error: " + traceback.format_exc()
    print("RESULTS " + json.dumps(results))


# Shapes whose dispatcher-chosen GEMM config must fit in shared memory: the tiny test models (hidden
# 64..256, K 64..384, k_segments 8 so segments of 8..48 columns, i.e. one k-step), Qwen3-8B-sized
# layers, decode and prefill M, bf16 and fp32 (bf16x3) operands, every output mode.
GRID_M = (1, 64, 65, 600, 4096)
GRID_NK = ((64, 64), (256, 64), (96, 128), (384, 256), (256, 384), (1000, 256), (4096, 4096), (12288, 4096),
           (4096, 12288))
GRID_SEGMENTS = (1, 8)   # P = 2 and 4 take the same loop structure as 8


def _gemm_grid_variants():
    """One representative call per distinct compiled variant the dispatcher can choose for the grid:
    {(config, segments, dtype, out mode, TMA, one k-step): (m, n, k)}."""
    import torch
    from rlalign.ops.triton_backend.gemm import pick_config
    seen = {}
    for dtype in (torch.bfloat16, torch.float32):
        for call in ("linear", "fp32_out", "acc_in"):   # linear: the output has the operands' dtype
            out_mode = call if call != "linear" else ("bf16" if dtype == torch.bfloat16 else "fp32")
            for seg in GRID_SEGMENTS if call == "linear" else (1,):
                for m in GRID_M:
                    for n, k in GRID_NK:
                        if k % seg:
                            continue
                        cfg = pick_config(m, n, seg, dtype == torch.float32, 132, out_mode)
                        seg_k = k // seg
                        key = (cfg, seg, str(dtype), call, seg == 1 or seg_k % 64 == 0, seg_k <= 64)
                        seen.setdefault(key, (m, n, k))
    return seen


def _compile_gemm_grid(G) -> None:
    """Compile (sm_90a) every variant of :func:`_gemm_grid_variants` through the real launcher."""
    import torch
    for (cfg, seg, dtype, call, _, _), (m, n, k) in _gemm_grid_variants().items():
        dt = getattr(torch, dtype.split(".")[-1])
        x, w = torch.empty(m, k, dtype=dt), torch.empty(n, k, dtype=dt)
        if call == "acc_in":
            G.gemm(x, w.T.contiguous(), out=torch.zeros(m, n), acc_in=True)
        else:
            G.gemm(x, w, b_trans=True, segments=seg, out_dtype=dt if call == "linear" else torch.float32)


def folded_accumulators(ttir: str) -> list[str]:
    """The tt.dot ops of a TTIR whose accumulator is none of: a loop-carried value (scf.for iter_args), another
    dot's result (bf16x3 chains), a zero constant, a load (acc_in). Anything else is a value the source adds
    after the products (a bias, a tree partial) that Triton's combine pass moved into the accumulator."""
    carried = set(re.findall(r"(%[\w.#]+) = [^,)]+", ", ".join(re.findall(r"iter_args\(([^)]*)\)", ttir))))
    dots = re.findall(r"(%[\w.#]+) = tt\.dot (%[\w.#]+), (%[\w.#]+), (%[\w.#]+)", ttir)
    zeros = set(re.findall(r"(%[\w.#]+) = arith\.constant dense<0\.0+e\+00>", ttir))
    loads = set(re.findall(r"(%[\w.#]+) = tt\.(?:load|descriptor_load)", ttir))
    ok = carried | zeros | loads | {d[0] for d in dots}
    return [f"{res} = tt.dot {a}, {b}, {acc}" for res, a, b, acc in dots if acc not in ok]


def _sm90_worker() -> None:
    import torch

    from tests.sm90 import activate_fake_sm90, compile_only_launches, ptxas_report
    activate_fake_sm90()
    compiled = compile_only_launches()
    from rlalign.ops.triton_backend import attention as A, elementwise as E, gemm as G, logprob as L, sample as S

    bf = torch.bfloat16
    errors = []

    def attempt(what, fn):
        try:
            fn()
        except Exception:
            errors.append(f"{what}: {traceback.format_exc(limit=3)[-1500:]}")

    x, w = torch.empty(4096, 4096, dtype=bf), torch.empty(4096, 4096, dtype=bf)
    for m in (1, 4096):
        attempt(f"linear M={m}", lambda: G.gemm(x[:m], w, b_trans=True))
        attempt(f"linear P=8 M={m}", lambda: G.gemm(x[:m], w, b_trans=True, segments=8))
    wide = torch.empty(6144, 4096, dtype=bf)   # the 8B stacked q/k/v at a decode batch: gemm.DECODE_TILE
    attempt("linear M=244 (the decode tile)", lambda: G.gemm(x[:244], wide, b_trans=True))
    attempt("dW", lambda: G.gemm(x, x, a_trans=True))
    attempt("acc_in", lambda: G.gemm(x, w, out=torch.zeros(4096, 4096), acc_in=True))
    attempt("fp32 out", lambda: G.gemm(x, w, b_trans=True, out_dtype=torch.float32))
    q, k = torch.empty(4096, 32, 128, dtype=bf), torch.empty(4096, 8, 128, dtype=bf)
    cu = torch.tensor([0, 4096], dtype=torch.int32)
    attempt("attention varlen", lambda: A.varlen_forward(q, k, k, cu, 0.1, store_lse=True))
    cache, table = torch.empty(64, 64, 8, 128, dtype=bf), torch.zeros(1, 64, dtype=torch.int32)
    one, ctx = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    attempt("attention decode", lambda: A.paged_forward(q[:1], cache, cache, table, ctx, one, 0.1, split_programs=False))
    attempt("attention decode, split programs, merge kernel",
            lambda: A.paged_forward(q[:1], cache, cache, table, ctx, one, 0.1, split_programs=True,
                                    launch=A.DecodeLaunch(fused_merge=False)))
    attempt("attention decode, split programs, the default (fused merge)",
            lambda: A.paged_forward(q[:1], cache, cache, table, ctx, one, 0.1, split_programs=True))
    attempt("attention decode, streamed", lambda: A.paged_forward(q[:244], cache, cache, table.expand(244, -1),
                                                                  ctx.expand(244), torch.arange(245, dtype=torch.int32),
                                                                  0.1, stream=True))
    attempt("attention paged prefill", lambda: A.paged_forward(q[:600], cache, cache, table, torch.tensor([4000], dtype=torch.int32),
                                                               torch.tensor([0, 600], dtype=torch.int32), 0.1))
    attempt("attention backward", lambda: A.varlen_backward(q, k, k, q, torch.empty(4096, 32), cu, q, 0.1))
    # gpt-oss: the WINDOW / HAS_SINKS variants (the one-program-per-item launch: prefill and decode tiles), the
    # windowed backward
    sinks = torch.zeros(32)
    attempt("attention varlen, window + sinks",
            lambda: A.varlen_forward(q, k, k, cu, 0.1, store_lse=True, window=128, sinks=sinks))
    attempt("attention decode, window + sinks",
            lambda: A.paged_forward(q[:1], cache, cache, table, ctx, one, 0.1, window=128, sinks=sinks))
    attempt("attention backward, window",
            lambda: A.varlen_backward(q, k, k, q, torch.empty(4096, 32), cu, q, 0.1, window=128))
    # DeepSeek-V3's 192-wide heads (256 padded columns): the wide prefill tile and backward launch fit shared memory
    q192, k192 = torch.empty(4096, 32, 192, dtype=bf), torch.empty(4096, 8, 192, dtype=bf)
    attempt("attention varlen, head 192", lambda: A.varlen_forward(q192, k192, k192, cu, 0.1, store_lse=True))
    attempt("attention backward, head 192",
            lambda: A.varlen_backward(q192, k192, k192, q192, torch.empty(4096, 32), cu, q192, 0.1))
    # ... and its 128-wide V heads (MLA: K 192, V 128)
    v128 = torch.empty(4096, 8, 128, dtype=bf)
    attempt("attention varlen, K 192 / V 128", lambda: A.varlen_forward(q192, k192, v128, cu, 0.1, store_lse=True))
    attempt("attention backward, K 192 / V 128",
            lambda: A.varlen_backward(q192, k192, v128, q, torch.empty(4096, 32), cu, q, 0.1))
    cache192, cache128 = torch.empty(64, 64, 8, 192, dtype=bf), torch.empty(64, 64, 8, 128, dtype=bf)
    attempt("attention decode, K 192 / V 128",
            lambda: A.paged_forward(q192[:1], cache192, cache128, table, ctx, one, 0.1, split_programs=False))
    h, lm = torch.empty(256, 4096, dtype=bf), torch.empty(151936, 4096, dtype=bf)
    tgt, zeros = torch.zeros(256, dtype=torch.int64), torch.zeros(256)
    attempt("logprob forward", lambda: L.forward_stats(h, lm, tgt, 1.0, True))
    attempt("logprob backward", lambda: L.backward_grads(h, lm, tgt, zeros, zeros, 1.0, zeros, zeros, True, True))
    xe = torch.empty(64, 4096, dtype=bf)
    attempt("rms_norm", lambda: (E.rms_forward(xe, xe[0], 1e-6), E.rms_backward(xe, xe[0], xe, zeros[:64])))
    attempt("silu_mul", lambda: E._silu_fwd(xe, xe))
    attempt("rope", lambda: E._rope_launch(q[:4], torch.empty(4, 64), torch.empty(4, 64), 1.0))
    ints = torch.zeros(4, dtype=torch.int64)
    from rlalign.ops import _checks as chk

    def sample_compile():   # recorded as in a graph capture: the compile-only launch leaves the flags unwritten
        with chk.capturing_graph(sample_filtered=False):
            S.sample(torch.randn(4, 1000), ints, ints, ints, torch.ones(4), ints, torch.ones(4))
    attempt("sample", sample_compile)
    from rlalign.ops.triton_backend import grouped as GR
    rows, experts = torch.empty(32768, 2048, dtype=bf), [torch.empty(768, 2048, dtype=bf) for _ in range(4)]
    down = [torch.empty(2048, 768, dtype=bf) for _ in range(4)]
    off = torch.tensor([0, 100, 8000, 8001, 32768])
    attempt("moe grouped gate/up", lambda: GR.grouped_rows(rows, off, experts))
    attempt("moe grouped down P=8", lambda: GR.grouped_rows(rows[:, :768], off, down, segments=8))
    attempt("moe grouped dX", lambda: GR.grouped_rows(rows[:, :768], off, experts, transpose_w=False))
    attempt("moe grouped dW", lambda: GR.grouped_weight_grad(rows[:, :768], rows, off, 4, bf))
    attempt("moe grouped small", lambda: GR.grouped_rows(rows[:64], torch.tensor([0, 1, 2, 3, 64]), experts))
    # one k-step per segment (steps == 1): the calls where a folded loop would let Triton's combine pass move
    # an add into the dot's accumulator (gemm.KSTEP_UNSPECIALIZED); the bias path, the tree's adds, the split
    x64, w64, b64 = torch.empty(256, 64, dtype=bf), torch.empty(200, 64, dtype=bf), torch.empty(200, dtype=bf)
    attempt("linear K=64 bias", lambda: G.gemm(x64, w64, b_trans=True, bias=b64))
    attempt("linear K=64 bias M=1000", lambda: G.gemm(torch.empty(1000, 64, dtype=bf), w64, b_trans=True, bias=b64))
    x512, w512 = torch.empty(1000, 512, dtype=bf), torch.empty(200, 512, dtype=bf)
    for cfg in G.all_configs(8, False):
        attempt(f"linear P=8 K=512 {cfg}", lambda: G.gemm(x512, w512, b_trans=True, segments=8, bias=b64, config=cfg))
    attempt("linear P=8 K=512 split", lambda: G.gemm(x512[:100], w512, b_trans=True, segments=8, bias=b64))
    attempt("moe grouped K=64", lambda: GR.grouped_rows(rows[:64, :64], torch.tensor([0, 1, 2, 3, 64]),
                                                        [e[:, :64] for e in experts]))
    before = len(compiled)
    attempt("gemm shape grid", lambda: _compile_gemm_grid(G))
    grid_variants = len(compiled) - before
    kpart = []

    def compile_kpart(cfg):   # the --sweep-kpart candidates: what a --sweep-kpart run compiles
        G.gemm(x, w, b_trans=True, segments=8, config=cfg)
        ptx = compiled[-1].kernel.asm["ptx"]
        kpart.append({"config": repr(cfg), "ctas": cfg.ctas_per_sm, "warps": cfg.num_warps, "wgmma": "wgmma" in ptx,
                      "smem": compiled[-1].kernel.metadata.shared, "ptxas": ptxas_report(ptx)})
    # only the candidates with their own kernel (segment_stream_kernel): the others are gemm_kernel's loop per
    # segment at other tiles, and the H200 sweep (2026-12-02) compiled and ran every candidate (CI time)
    for cfg in (c for c in G.KPART_CANDIDATES if c.stream):
        attempt(f"kpart {cfg}", lambda: compile_kpart(cfg))
    variants = []
    for name, _, kwargs, kernel in compiled:
        ptx = kernel.asm["ptx"]
        variants.append({"kernel": name, "args": {k: str(v) for k, v in kwargs.items() if k.isupper()},
                         "stages": kwargs.get("num_stages"), "async_copy": "async_copy" in kernel.asm["ttgir"],
                         "smem": kernel.metadata.shared, "wgmma": "wgmma" in ptx, "has_dot": "mma" in ptx,
                         "mma_sync": "mma.sync.aligned.m16n8k16" in ptx,
                         # software-pipelined: some wgmma wait leaves a chain in flight
                         "pipelined": re.search(r"warp_group_dot_wait[^\n]*pendings = [1-9]",
                                                kernel.asm["ttgir"]) is not None,
                         "ptxas": ptxas_report(ptx) if name.startswith("attn_") else None,
                         "folded_accumulators": folded_accumulators(kernel.asm["ttir"])})
    print("RESULTS " + json.dumps({"errors": errors, "variants": variants, "grid_variants": grid_variants,
                                   "kpart": kpart, "decode_tile": dataclasses.asdict(G.DECODE_TILE)}))


# ---- pytest side --------------------------------------------------------------------------------------

def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spawn(flag: str, interpret: bool) -> subprocess.Popen:
    return spawn([os.path.abspath(__file__), flag], interpret)


def _results(proc: subprocess.Popen):
    # a hang guard, not a speed check: on CI each worker takes a few minutes, but a 2-core machine shared with
    # other suites took the interpreter worker past 900 s (2026-12-02), failing every check of the module
    return collect(proc, timeout=1800)


@pytest.fixture(scope="module")
def workers():
    """Both subprocesses, started together: (interpreter results, sm_90a compile results or a skip reason)."""
    pytest.importorskip("triton")
    import torch
    sm90 = None if torch.cuda.is_available() else _spawn("--sm90-worker", interpret=False)
    interp = _results(_spawn("--worker", interpret=True))
    compiled = _results(sm90) if sm90 is not None else (None, 0, "", "a CUDA device is here: tests/cuda compiles and runs these kernels for real")
    return interp, compiled


@pytest.fixture(scope="module")
def interpreter_results(workers):
    res, rc, out, err = workers[0]
    if res is None:
        pytest.fail(f"interpreter worker failed (rc {rc}):\n{out[-3000:]}\n{err[-3000:]}")
    return res


@pytest.fixture(scope="module")
def sm90(workers):
    res, rc, out, err = workers[1]
    if res is None:
        pytest.skip(f"sm_90a compile worker did not run: {err[-800:]}")
    return res


def test_kernels_compile_for_sm90(sm90):
    assert not sm90["errors"], "\n".join(sm90["errors"])
    assert len(sm90["variants"]) >= 15


def test_dot_kernels_use_wgmma(sm90):
    """Every kernel with a matrix product compiles to wgmma -- except the decode GEMM tiles of 16 / 32 rows
    (gemm.SMALL_M_TILES), which compile to mma.sync m16n8k16 and nothing else (docs/design/tile-shapes.md, rule 2: the H200 measured
    the two families' bits equal); those must be among the compiled variants (the grid's M = 1)."""
    small = [v for v in sm90["variants"] if v["kernel"] == "gemm_kernel" and int(v["args"].get("BM", 64)) < 64]
    missing = [v for v in sm90["variants"] if v["has_dot"] and not v["wgmma"] and v not in small]
    assert not missing, f"compiled with mma.sync instead of wgmma: {missing}"
    wrong = [v["args"] for v in small if v["wgmma"] or not v["mma_sync"]]
    assert small and not wrong, f"16/32-row GEMM tiles not on mma.sync m16n8k16 alone: {wrong or 'none compiled'}"


def test_unsegmented_gemm_configs_are_software_pipelined(sm90):
    """Every large-M config the dispatcher compiled for the plain bf16 GEMM (128-row tiles, P = 1: linear, dX,
    dW, fp32 out, acc_in) keeps a wgmma chain in flight across k-steps (a wait with pendings >= 1 in the TTGIR).
    The acc_in config with a flattened tile loop lost this (wait 0 only, fewer TMA loads in flight) and ran at
    0.34x cuBLAS on the H200 (2026-12-02). The 64-row configs of small M and the fp32 (bf16x3) ones wait for
    every chain; they are not what a training step's time is made of."""
    plain = [v for v in sm90["variants"] if v["kernel"] == "gemm_kernel" and v["args"].get("P") == "1"
             and v["args"].get("BM") == "128" and v["args"].get("SPLIT") == "False" and v["wgmma"]]
    assert any(v["args"].get("ACC_IN") == "True" for v in plain), "no acc_in variant was compiled"
    unpipelined = [v["args"] for v in plain if not v["pipelined"]]
    assert not unpipelined, f"plain GEMM configs whose k loop is not software-pipelined: {unpipelined}"


def test_the_decode_tile_compiles_pipelined(sm90):
    """gemm.DECODE_TILE (128x128, 5 stages, the 8B stacked q/k/v at 244 rows) fits the shared memory and keeps a
    wgmma chain in flight across k-steps."""
    want = sm90["decode_tile"]
    tile = [v for v in sm90["variants"] if v["kernel"] == "gemm_kernel" and v["args"].get("P") == "1"
            and v["args"].get("BM") == str(want["block_m"]) and v["args"].get("BN") == str(want["block_n"])
            and v["stages"] == want["num_stages"]]
    assert tile, "the decode tile was not compiled"
    assert all(v["pipelined"] and v["wgmma"] and v["smem"] <= SMEM_LIMIT for v in tile), tile


def test_the_logprob_merge_loop_is_pipelined(sm90):
    """lp_merge_kernel's fold over the vocab tiles keeps later tiles' loads in flight (async copies in the TTGIR):
    without it, one program at a decode batch waits a load latency per tile."""
    merges = [v for v in sm90["variants"] if v["kernel"] == "lp_merge_kernel"]
    assert merges, "lp_merge_kernel was not compiled"
    assert all(v["async_copy"] for v in merges), merges


def test_gemm_sums_keep_their_adds_after_the_products(sm90):
    """No GEMM kernel's dot starts from a value the source adds after the sum (the bias, a tree partial): with a
    one-iteration k loop folded away, Triton's combine pass rewrites dot(a, b, 0) + d into dot(a, b, d), which
    rounds differently (gemm.KSTEP_UNSPECIALIZED; found on the H200, 2026-12-02, as a one-ulp difference at K =
    64 with a bias). The one-k-step calls of the linear (P = 1 and P = 8, every tiled config, the split) and of
    the MoE grouped GEMM are compiled above; checked on every GEMM variant the worker compiled."""
    gemm_kernels = ("gemm_kernel", "segment_stream_kernel", "segment_partials_kernel", "merge_partials_kernel",
                    "grouped_rows_kernel", "grouped_reduce_kernel")
    checked = [v for v in sm90["variants"] if v["kernel"] in gemm_kernels]
    assert len(checked) >= 20, f"only {len(checked)} GEMM variants compiled"
    folded = [(v["kernel"], v["args"], v["folded_accumulators"]) for v in checked if v["folded_accumulators"]]
    assert not folded, f"dots whose accumulator is a value added after the products: {folded}"


def test_shared_memory_fits_sm90(sm90):
    over = [v for v in sm90["variants"] if v["smem"] > SMEM_LIMIT]
    assert not over, f"shared memory over {SMEM_LIMIT} B: {over}"


def test_attention_forward_keeps_the_wgmma_pipeline(sm90):
    """The bf16 attention forward kernels (prefill, paged prefill, decode per tile, per key split and
    streamed, the merge kernel or the fused merge) spill nothing and ptxas does not serialise their wgmma
    (C7514/C7515: a non-wgmma instruction reading or writing the accumulator while the MMA is in
    flight, e.g. a split merge placed after the P.V MMA)."""
    # (256 padded columns -- DeepSeek-V3's 192-wide heads -- spill about 1 KB on the wide tile: measured, not
    # checked here; test_shared_memory_fits_sm90 checks that they fit)
    reports = [v for v in sm90["variants"] if v["kernel"].startswith("attn_") and v["ptxas"] is not None
               and v["kernel"] != "attn_bwd_dkdv_kernel" and v["kernel"] != "attn_bwd_dq_kernel"
               and v["args"].get("DP") != "256"]
    if not reports:
        pytest.skip("Triton's ptxas could not be run")
    kinds = {(v["kernel"], v["args"].get("PARTIAL")) for v in reports}
    assert {("attn_fwd_kernel", "True"), ("attn_fwd_kernel", "False"), ("attn_merge_kernel", None)} <= kinds, kinds
    assert any(v["args"].get("FUSED_MERGE") == "True" for v in reports), "the fused-merge kernel was not compiled"
    assert any(v["kernel"] == "attn_stream_kernel" for v in reports), "the streamed decode kernel was not compiled"
    assert any(v["args"].get("WINDOW") == "True" and v["args"].get("HAS_SINKS") == "True" for v in reports), \
        "the window / sinks kernel was not compiled"
    bad = [(v["kernel"], v["args"], line.strip()) for v in reports for line in v["ptxas"].splitlines()
           if "C7514" in line or "C7515" in line or ("spill" in line and " 0 bytes spill stores" not in line)]
    assert not bad, f"attention kernels serialise wgmma or spill: {bad}"


def test_dispatched_gemm_configs_cover_the_shape_grid(sm90):
    """The shape grid (tiny models with one-k-step segments, fp32 operands, every output mode) was
    compiled: test_shared_memory_fits_sm90 then covers every config the dispatcher picks for it."""
    assert sm90["grid_variants"] >= 30, f"only {sm90['grid_variants']} grid variants compiled"


def test_kpart_candidates_fit_their_programs_per_sm(sm90):
    """Every gemm.KPART_CANDIDATES schedule of segment_stream_kernel compiles for sm_90a with wgmma, and ctas_per_sm
    of its programs fit one SM together: shared memory (+1 KiB reserved per block) within 228 KiB, registers
    within 64 K."""
    import re
    assert len(sm90["kpart"]) >= 2, sm90["kpart"]
    bad = []
    for v in sm90["kpart"]:
        used = re.search(r"Used (\d+) registers", v["ptxas"] or "")
        regs = int(used.group(1)) * 32 * v["warps"] * v["ctas"] if used else 0
        if not v["wgmma"] or (v["smem"] + 1024) * v["ctas"] > 233472 or regs > 65536:
            bad.append(f"{v['config']}: wgmma={v['wgmma']} smem={v['smem']} B x {v['ctas']}, registers {regs}")
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("name", list(CHECKS))
def test_kernel_under_interpreter(interpreter_results, name):
    result = interpreter_results[name]
    assert not isinstance(result, str), f"{name}: {result}"
    assert result <= TOL, f"{name}: worst relative error {result:.3g} vs float64 > {TOL}"


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
if __name__ == "__main__" and "--sm90-worker" in sys.argv:
    _sm90_worker()
