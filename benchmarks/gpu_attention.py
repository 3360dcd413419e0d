"""Benchmark: strict Triton attention vs torch SDPA, same run (bf16, head_dim 128, causal).

Prefill: 4 (and 8) sequences x 4096 tokens packed (varlen), GQA 32 query / 8 kv heads (Qwen3-8B) and
MHA 32/32; baseline SDPA (flash backend when it accepts the call, else the default) on [B, H, 4096,
128]. TFLOP/s counts the causal half: 2 * B * Hq * S^2 * D.
Decode: 1, 8, 64 and 256 sequences, one query each, contexts of 4096 (and 1024) tokens, GQA 32/8; ours
reads a paged cache (page size 16 and 64, shuffled pages); baseline SDPA on a contiguous cache
[B, 8, L, 128] with enable_gqa (its flash backend is FlashAttention-2's forward, which splits the keys
for decode), and flash varlen decode (``aten._flash_attention_forward`` with cu_seqlens, one query per
sequence) where the build has it; ``base_ms`` is the faster. GB/s counts the K/V bytes (the floor).
Ours three ways: ``ours_ms`` the kernels as the op launches them (key splits over several programs when
the per-(sequence, kv head) grid is small: ``launch``), ``split_ms`` / ``item_ms`` each launch forced
(the same bits; the launch the op picks: attention.use_split_programs); ``op_ms`` the public op.
Training (info): varlen forward + backward vs SDPA forward + backward.

Columns: ``ratio`` = SDPA time / the strict Triton kernel's time (kernel only); ``op_ratio`` = SDPA
time / the public op's time (``ops.attention_varlen`` / ``ops.attention_paged``, as the models call
them: input checks, dispatch and the kernel) -- the figure a model sees.

    python benchmarks/gpu_attention.py [--out DIR] [--sweep-decode | --sweep-train]

``--sweep-decode``: only decode, candidate launch configs (attention.DecodeLaunch: stages, programs per SM,
merge warps/unroll, the fused merge, a register cap) of both launches as CUDA-graph replays at batch 1-256,
each output compared bit for bit with the per-item default (a candidate that differs is marked DIFFER and
never "fastest"); prints the fastest bit-equal config of each launch per batch vs SDPA/flash, the launch the
op picks and the split launch's fastest merge-kernel vs fused-merge candidate (bench_attention_sweep.csv /
.json). With ``--sweep-small-tiles``: only the per-item and streamed launches, with 16/32-row tiles (mma.sync)
beside the 64-row default (H200, 2026-12-03: 16 rows bit-equal but not faster, 32 rows not bit-equal).

``--sweep-train``: only training, candidate attention.BackwardLaunch configs (tiles, warps, stages, keys per
dK/dV program, heavy-first grids), forward + backward at 2 x 4,096, 8 x 4,096 and 1 x 32,768 tokens (32/8 heads)
vs SDPA flash forward + backward, each candidate's dq/dk/dv compared bit for bit with the default launch's and
its worst error vs a float64 reference on a ragged batch (a candidate with other bits counts only within
TRAIN_TOL); prints the fastest per shape (bench_attention_train_sweep.csv / .json).
benchmarks/attn_bwd_sm90_cpu.py compiles the same candidates for sm_90a without a GPU (registers, spills, wgmma).

Writes bench_attention.csv / .json to $OUT (or --out, default benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_linear import run_sweep, write  # noqa: E402

from rlalign.bench.args import positive_ints  # noqa: E402
from rlalign.bench.cuda_timing import bench_ms as _bench, graphed  # noqa: E402

D = 128


def _graph_fields(ours, bases, capture_context) -> dict:
    """graph_ours_ms / graph_base_ms / graph_ratio (the fastest baseline), or graph_error naming what could
    not be captured (the row keeps its eager timings)."""
    try:
        g_ours = _bench(graphed(ours, capture_context))
        g_base = min(_bench(graphed(b)) for b in bases)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on
        return {"graph_error": repr(exc)[:200]}
    return {"graph_ours_ms": round(g_ours, 4), "graph_base_ms": round(g_base, 4), "graph_ratio": round(g_base / g_ours, 3)}


def _sdpa(q, k, v, causal):
    """SDPA with the flash backend if it takes the call (GQA through enable_gqa), else the default."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gqa = q.shape[1] != k.shape[1]
    kwargs = {"is_causal": causal, "enable_gqa": gqa} if gqa else {"is_causal": causal}
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, **kwargs)
        backend = "flash"

        def run():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
    except Exception:
        backend = "default"

        def run():
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return run, backend


def op_fields(base_ms: float, op_ms: float) -> dict:
    """The through-the-public-op columns of a row: the op's time and SDPA time / op time."""
    return {"op_ms": round(op_ms, 4), "op_ratio": round(base_ms / op_ms, 3)}


def prefill(batch: int, seq: int, hq: int, hkv: int) -> dict:
    from rlalign import ops
    from rlalign.ops.triton_backend import attention as A
    t = batch * seq
    q = torch.randn(t, hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, t + 1, seq, device="cuda", dtype=torch.int32)
    ours = _bench(lambda: A.varlen_forward(q, k, v, cu, D ** -0.5))
    with torch.no_grad():
        op = _bench(lambda: ops.attention_varlen(q, k, v, cu))
    qs, ks, vs = (x.view(batch, seq, -1, D).transpose(1, 2).contiguous() for x in (q, k, v))
    run, backend = _sdpa(qs, ks, vs, True)
    base = _bench(run)
    flops = 2.0 * batch * hq * seq * seq * D
    return {"kind": "prefill", "batch": batch, "seq": seq, "hq": hq, "hkv": hkv, "baseline": f"sdpa-{backend}",
            "ours_ms": round(ours, 4), "base_ms": round(base, 4), "ours_tflops": round(flops / ours / 1e9, 1),
            "base_tflops": round(flops / base / 1e9, 1), "ratio": round(base / ours, 3), "target": 0.8,
            **op_fields(base, op)}


def _flash_varlen_decode(q, kk, vv):
    """FlashAttention-2 varlen forward, one query per sequence (q [B, Hq, D], kk/vv [B, Hkv, L, D]), or
    None when this torch build does not take the call."""
    batch, hkv, ctx, d = kk.shape
    k_flat = kk.transpose(1, 2).reshape(batch * ctx, hkv, d).contiguous()
    v_flat = vv.transpose(1, 2).reshape(batch * ctx, hkv, d).contiguous()
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    cu_k = cu_q * ctx

    def run():
        return torch.ops.aten._flash_attention_forward(q, k_flat, v_flat, cu_q, cu_k, 1, ctx, 0.0, False, False,
                                                       scale=d ** -0.5)[0]
    try:
        run()
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return None
    return run


def decode(batch: int, ctx: int, hq: int, hkv: int, page: int) -> dict:
    from rlalign import ops
    from rlalign.ops.triton_backend import attention as A
    q = torch.randn(batch, hq, D, device="cuda", dtype=torch.bfloat16)
    pages_per_seq = -(-ctx // page)
    n_pages = batch * pages_per_seq + 7
    kc = torch.randn(n_pages, page, hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(n_pages, device="cuda")[:batch * pages_per_seq].view(batch, pages_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    scale = D ** -0.5
    ours = _bench(lambda: A.paged_forward(q, kc, vc, table, seq_lens, cu, scale))
    split = _bench(lambda: A.paged_forward(q, kc, vc, table, seq_lens, cu, scale, split_programs=True))
    item = _bench(lambda: A.paged_forward(q, kc, vc, table, seq_lens, cu, scale, split_programs=False, stream=False))
    streamed = _bench(lambda: A.paged_forward(q, kc, vc, table, seq_lens, cu, scale, stream=True))
    chosen = _op_launch(A, batch, hq, hkv, table.shape[1] * page, q)
    op = _bench(lambda: ops.attention_paged(q, kc, vc, table, seq_lens, cu))
    kk = torch.randn(batch, hkv, ctx, D, device="cuda", dtype=torch.bfloat16)
    vv = torch.randn_like(kk)
    run, backend = _sdpa(q.view(batch, hq, 1, D), kk, vv, False)
    sdpa = _bench(run)
    flash_run = _flash_varlen_decode(q, kk, vv)
    flash = _bench(flash_run) if flash_run is not None else None
    base = min(sdpa, flash) if flash is not None else sdpa
    # the same calls replayed from CUDA graphs, as the engine runs decode (no host launch cost in the time)
    graph = _graph_fields(lambda: ops.attention_paged(q, kc, vc, table, seq_lens, cu),
                          [r for r in (run, flash_run) if r is not None], lambda: ops.capturing_graph(max_query_len=1))
    # the three launches as graph replays (same bits; which one the engine should pick at this batch)
    for launch in ("split", "item", "stream"):
        try:
            graph[f"graph_{launch}_ms"] = round(_bench(graphed(
                lambda: A.paged_forward(q, kc, vc, table, seq_lens, cu, scale, split_programs=launch == "split",
                                        stream=launch == "stream"))), 4)
        except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on
            graph[f"graph_{launch}_error"] = repr(exc)[:200]
    nbytes = 2.0 * batch * ctx * hkv * D * 2
    return {"kind": "decode", "batch": batch, "seq": ctx, "hq": hq, "hkv": hkv, "page": page,
            "baseline": f"sdpa-{backend}" + ("" if flash is None else "|flash-varlen"),
            "launch": chosen, "ours_ms": round(ours, 4), "split_ms": round(split, 4),
            "item_ms": round(item, 4), "stream_ms": round(streamed, 4), "sdpa_ms": round(sdpa, 4),
            "flash_varlen_ms": None if flash is None else round(flash, 4), "base_ms": round(base, 4),
            "ours_gbs": round(nbytes / ours / 1e6, 0), "base_gbs": round(nbytes / base / 1e6, 0),
            "ratio": round(base / ours, 3), "split_ratio": round(base / split, 3), "item_ratio": round(base / item, 3),
            "stream_ratio": round(base / streamed, 3),
            "target": 0.9 if batch >= 256 else 0.8, **op_fields(base, op), **graph}


def _op_launch(A, batch: int, hq: int, hkv: int, table_keys: int, q) -> str:
    """The launch the op picks for a decode step of ``batch`` sequences (attention.decode_launch: shapes only)."""
    return A.decode_launch(1, batch, batch, hq, hkv, D, table_keys, max(q.numel(), batch * table_keys * hkv * D),
                           A.device_sms(q))


# --sweep-decode: candidate DecodeLaunch configs of both launches, timed as CUDA-graph replays of a decode step
# (32/8 heads, 4,096 context, page 16) and checked bit for bit against the per-item default.
SWEEP_BATCHES = (1, 8, 16, 32, 64, 256)
SWEEP_CTX, SWEEP_HQ, SWEEP_HKV, SWEEP_PAGE = 4096, 32, 8, 16
SWEEP_DEVICE = "cuda"   # the CPU smoke test of the sweep (interpreter) sets "cpu"


SMALL_TILES = False   # --sweep-small-tiles


def small_tile_candidates(A) -> list[tuple[str, object]]:
    """--sweep-small-tiles: the per-item and streamed defaults, then 16- and 32-row tiles on 1 / 2 warps. A decode
    item holds one token's G query heads (4 rows of the 64-row tile at 32/8 heads); Triton issues mma.sync for
    16/32 rows, which benchmarks/mma_bits_probe.py found bit-equal to wgmma on these products (2026-12-03) -- whether the
    whole kernel keeps the bits (its row reductions too) is what the sweep's bit check answers."""
    from dataclasses import replace
    item, stream = A.ITEM_DECODE, A.STREAM_DECODE
    cands = [("item", item), ("stream", stream)]
    cands += [("item", replace(item, tile=tile)) for tile in ((16, 1, 2), (16, 1, 3), (32, 2, 2))]
    cands += [("stream", replace(stream, tile=(16, 1, 2), programs_per_sm=p)) for p in (4, 8)]
    cands += [("stream", replace(stream, tile=(32, 2, 2), programs_per_sm=4))]
    return cands


def sweep_candidates(A) -> list[tuple[str, object]]:
    """(launch kind, DecodeLaunch): the defaults first, then one change at a time (few: compiles count)."""
    from dataclasses import replace
    if SMALL_TILES:
        return small_tile_candidates(A)
    split, item = A.SPLIT_DECODE, A.ITEM_DECODE
    bm, warps, stages = A.DECODE_TILE
    cands = [("split", split), ("item", item)]
    # stages: 2 or 3 only -- at 4 and more the sm_90a PTX is the 3-stage one (the pipeliner's depth is capped by
    # the page-table load -> K/V load chain; ptxas: 112 / 80 KiB of shared memory for the split / item kernel)
    cands += [("split", replace(split, tile=(bm, warps, s))) for s in (2, 3) if s != split.tile[2]]
    cands += [("split", replace(split, programs_per_sm=p)) for p in (8, 16) if p != split.programs_per_sm]
    cands += [("split", replace(split, merge_warps=w, merge_unroll=u)) for w, u in ((4, 8), (8, 16))
              if (w, u) != (split.merge_warps, split.merge_unroll)]
    # the fused merge (no merge kernel: each item's last program folds its partials), then with more splits'
    # partials loaded per step (16 splits at 4,096 context: 2 round trips, not 4), and 4 rows at a time (one
    # token's 4 heads, the rows that hold a query) with all 16 splits' loads in one round trip (ptxas: 248
    # registers, no spills, as the default fused kernel)
    fused = replace(split, fused_merge=True)
    cands += [("split", fused), ("split", replace(fused, merge_unroll=8)),
              ("split", replace(fused, fold_rows=4, merge_unroll=16))]
    # 3 programs per SM (sm_90a, ptxas -v: 248-252 registers / 112 KiB for the split kernel today, 2 per SM):
    # 1 stage (48 KiB of shared memory) and a 168-register cap (spills 168 / 180 B: two- / one-kernel merge)
    # (and 6 programs per SM: two full waves of 3, e.g. batch 16: 6 programs per item, not 4)
    three = dict(tile=(bm, warps, 1), max_registers=168)
    cands += [("split", replace(split, **three)), ("split", replace(fused, **three)),
              ("split", replace(fused, programs_per_sm=6, **three))]
    cands += [("item", replace(item, tile=(bm, warps, s))) for s in (2, 3) if s != item.tile[2]]
    # the streamed launch (whole items in one pipelined loop per program): 1 or 2 programs per SM (sm_90a: 255
    # registers, 107 KiB of shared memory at 3 stages -- two fit), and 2 stages
    stream = A.STREAM_DECODE
    cands += [("stream", stream)] + [("stream", replace(stream, programs_per_sm=p)) for p in (1, 2)
                                     if p != stream.programs_per_sm]
    cands += [("stream", replace(stream, tile=(bm, warps, 2)))]
    return cands


def sweep_decode() -> list[dict]:
    """Rows {batch, launch, config, graph_ms, vs_default, bits} per candidate and batch, plus SDPA/flash."""
    from rlalign.bench.cuda_timing import bench_ms, graphed
    from rlalign.contract.bits import bits_equal, describe_difference
    from rlalign.ops.triton_backend import attention as A
    rows = []
    scale = D ** -0.5
    for batch in SWEEP_BATCHES:
        q = torch.randn(batch, SWEEP_HQ, D, device=SWEEP_DEVICE, dtype=torch.bfloat16)
        pages = -(-SWEEP_CTX // SWEEP_PAGE)
        kc = torch.randn(batch * pages + 7, SWEEP_PAGE, SWEEP_HKV, D, device=SWEEP_DEVICE, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.randperm(kc.shape[0], device=SWEEP_DEVICE)[:batch * pages].view(batch, pages).to(torch.int32)
        seq_lens = torch.full((batch,), SWEEP_CTX, device=SWEEP_DEVICE, dtype=torch.int32)
        cu = torch.arange(batch + 1, device=SWEEP_DEVICE, dtype=torch.int32)

        def call(kind, launch):
            return A.paged_forward(q, kc, vc, table, seq_lens, cu, scale, split_programs=kind == "split",
                                   stream=kind == "stream", launch=launch)
        ref = call("item", A.ITEM_DECODE)
        default_ms = {}
        for kind, launch in sweep_candidates(A):
            row = {"kind": "sweep-decode", "batch": batch, "launch": kind, "config": repr(launch)}
            try:
                out = call(kind, launch)
                row["bits"] = "equal" if bits_equal(out, ref) else "DIFFER " + describe_difference(out, ref)
                ms = bench_ms(graphed(lambda: call(kind, launch)), warmup=10, rep=30)
                row["graph_ms"] = round(ms, 4)
                default_ms.setdefault(kind, ms)
                row["vs_default"] = round(default_ms[kind] / ms, 3)
            except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on
                row["error"] = repr(exc)[:200]
            rows.append(row)
        kk = torch.randn(batch, SWEEP_HKV, SWEEP_CTX, D, device=SWEEP_DEVICE, dtype=torch.bfloat16)
        run, backend = _sdpa(q.view(batch, SWEEP_HQ, 1, D), kk, torch.randn_like(kk), False)
        bases = [run] + [f for f in (_flash_varlen_decode(q, kk, torch.randn_like(kk)),) if f is not None]
        base = min(bench_ms(graphed(b), warmup=10, rep=30) for b in bases)
        rows.append({"kind": "sweep-decode", "batch": batch, "launch": "baseline", "config": f"sdpa-{backend}/flash",
                     "graph_ms": round(base, 4), "op_launch": _op_launch(A, batch, SWEEP_HQ, SWEEP_HKV, SWEEP_CTX, q)})
    return rows


def print_sweep(rows: list[dict]) -> None:
    """Per batch: each candidate's graph time, speed vs its launch's default, bits; then the best bit-equal
    candidate of each launch vs the baseline and the launch the op picks, and the split launch's fastest
    bit-equal candidate with the merge kernel and with the fused merge."""
    print(f"{'B':>4} {'launch':>6} {'graph ms':>9} {'vs dflt':>7} {'bits':>6}  config")
    for r in rows:
        if r["launch"] == "baseline":
            continue
        print(f"{r['batch']:>4} {r['launch']:>6} {r.get('graph_ms', '-'):>9} {r.get('vs_default', '-'):>7} "
              f"{r.get('bits', 'ERROR')[:6]:>6}  {r['config']}" + (f"  {r['error']}" if "error" in r else "")
              + (f"  {r['bits']}" if r.get("bits", "equal") != "equal" else ""))
    print(f"{'B':>4} {'base ms':>8} {'best split':>10} {'best item':>9} {'best stream':>11} {'ratio split':>11} "
          f"{'ratio item':>10} {'ratio stream':>12} op picks")
    for base in (r for r in rows if r["launch"] == "baseline"):
        best = {}
        for r in rows:
            if r["batch"] == base["batch"] and r.get("bits") == "equal" and "graph_ms" in r:
                if r["launch"] not in best or r["graph_ms"] < best[r["launch"]]["graph_ms"]:
                    best[r["launch"]] = r
        ms = {k: best[k]["graph_ms"] if k in best else float("nan") for k in ("split", "item", "stream")}
        print(f"{base['batch']:>4} {base['graph_ms']:>8} {ms['split']:>10} {ms['item']:>9} {ms['stream']:>11} "
              f"{base['graph_ms'] / ms['split']:>11.3f} {base['graph_ms'] / ms['item']:>10.3f} "
              f"{base['graph_ms'] / ms['stream']:>12.3f} {base['op_launch']}")
        for k, r in best.items():
            print(f"       fastest bit-equal {k}: {r['config']}")
        merges = {}   # the split launch's two merges: the fastest bit-equal candidate of each
        for r in rows:
            if r["batch"] == base["batch"] and r["launch"] == "split" and r.get("bits") == "equal" and "graph_ms" in r:
                merge = "fused merge" if "fused_merge=True" in r["config"] else "merge kernel"
                merges[merge] = min(merges.get(merge, float("inf")), r["graph_ms"])
        if len(merges) == 2:
            print(f"       split, fastest with the merge kernel {merges['merge kernel']} ms / fused merge "
                  f"{merges['fused merge']} ms: {base['graph_ms'] / merges['merge kernel']:.3f} / "
                  f"{base['graph_ms'] / merges['fused merge']:.3f} of the baseline")


def training(batch: int, seq: int, hq: int, hkv: int) -> dict:
    from rlalign import ops
    t = batch * seq
    q = torch.randn(t, hq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.arange(0, t + 1, seq, device="cuda", dtype=torch.int32)
    go = torch.randn(t, hq, D, device="cuda", dtype=torch.bfloat16)

    def ours():
        ops.attention_varlen(q, k, v, cu).backward(go)
    qs, ks, vs = (x.detach().view(batch, seq, -1, D).transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    gos = go.view(batch, seq, hq, D).transpose(1, 2)
    run, backend = _sdpa(qs, ks, vs, True)

    def base():
        run().backward(gos)
    t_ours, t_base = _bench(ours), _bench(base)
    flops = 2.0 * batch * hq * seq * seq * D * 3.5   # forward + backward (2.5x forward)
    return {"kind": "train fwd+bwd", "batch": batch, "seq": seq, "hq": hq, "hkv": hkv,
            "baseline": f"sdpa-{backend}", "ours_ms": round(t_ours, 4), "base_ms": round(t_base, 4),
            "ours_tflops": round(flops / t_ours / 1e9, 1), "base_tflops": round(flops / t_base / 1e9, 1),
            "ratio": round(t_base / t_ours, 3), "target": None}


# --sweep-train: candidate BackwardLaunch configs, forward + backward at the training shapes (32/8 heads, d 128)
# vs SDPA flash forward + backward; every candidate's dq/dk/dv compared with the default launch's.
TRAIN_SHAPES = ((2, 4096), (8, 4096), (1, 32768))       # (sequences, tokens each)
TRAIN_HQ, TRAIN_HKV = 32, 8
TRAIN_ACC_LENS = (1, 100, 700, 1500)                    # the float64-reference check's ragged batch
TRAIN_TOL = 2e-2                                        # tests/cuda's bf16 backward tolerance vs float64
TRAIN_DTYPE = torch.bfloat16                            # the CPU smoke test (interpreter) sets float32


def train_candidates(A) -> list[tuple[str, object]]:
    """(label, BackwardLaunch): the default first, the launch it replaced, then one change at a time (few: compiles
    count; benchmarks/attn_bwd_sm90_cpu.py --all compiles the same list for sm_90a on a CPU)."""
    from dataclasses import replace
    d = A.BWD_LAUNCH
    cands = [("default", d), ("previous default", A.BackwardLaunch()),
             ("light-first", replace(d, heavy_first=False)),
             ("dq 64x4w", replace(d, dq_tile=(64, 4, 2))),
             ("dkdv 64k", replace(d, dkdv_keys=64)),
             ("dkdv 3stg", replace(d, dkdv_stages=3)),
             ("dq 128 keys", replace(d, dq_keys=128))]
    # not listed (benchmarks/attn_bwd_sm90_cpu.py, 2026-12-02): dK/dV at 128 query rows per step spills 408 B, and
    # 4 warps with 128 keys spill 2,000 B and serialise the wgmma pipeline (C7511); a fused one-kernel backward
    # (2026-12-02) ran at 0.39-0.42x SDPA and was removed
    return cands


def _train_inputs(batch: int, seq_or_lens, seed: int):
    lens = list(seq_or_lens) if isinstance(seq_or_lens, (tuple, list)) else [seq_or_lens] * batch
    t = sum(lens)
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, go = (torch.randn(t, h, D, generator=g).to(SWEEP_DEVICE, TRAIN_DTYPE)
                   for h in (TRAIN_HQ, TRAIN_HKV, TRAIN_HKV, TRAIN_HQ))
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(SWEEP_DEVICE)
    return lens, q, k, v, go, cu


def _grads(A, q, k, v, go, cu, launch):
    scale = D ** -0.5
    out, lse = A.varlen_forward(q, k, v, cu, scale, store_lse=True)
    return A.varlen_backward(q, k, v, out, lse, cu, go, scale, launch=launch)


def _compare(got, ref) -> str:
    from rlalign.contract.bits import bits_equal, describe_difference
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        if not bits_equal(a, b):
            return f"DIFFER {name}: {describe_difference(a, b)}"
    return "equal"


def _f64_errors(A, launches) -> dict:
    """Worst relative error (max |got - ref| / max |ref| over dq, dk, dv) of each launch vs the float64
    autograd reference on a ragged batch (TRAIN_ACC_LENS)."""
    from tests.references import causal_attention_float64
    lens, q, k, v, go, cu = _train_inputs(0, TRAIN_ACC_LENS, 7)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    causal_attention_float64(qd, kd, vd, lens, D ** -0.5).backward(go.double())
    errs = {}
    for label, launch in launches:
        try:
            got = _grads(A, q, k, v, go, cu, launch)
            errs[label] = max(float((a.double() - r).abs().max() / r.abs().max()) for a, r in
                              zip(got, (qd.grad, kd.grad, vd.grad)))
        except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on
            errs[label] = repr(exc)[:200]
    return errs


def sweep_train() -> list[dict]:
    """Rows {shape, config, ms (forward + backward), vs_default, vs_sdpa, bits, f64_err} per candidate and shape,
    plus the SDPA flash baseline. Plain timing with synchronisation (the backward's host sync for the longest
    sequence is memoised per batch, but the op path is not graph-captured in training)."""
    from rlalign.bench.cuda_timing import bench_ms
    from rlalign.ops.triton_backend import attention as A
    cands = train_candidates(A)
    errs = _f64_errors(A, cands)
    rows = []
    for batch, seq in TRAIN_SHAPES:
        lens, q, k, v, go, cu = _train_inputs(batch, seq, 11)
        ref = _grads(A, q, k, v, go, cu, A.BWD_LAUNCH)
        default_ms = None
        for label, launch in cands:
            row = {"kind": "sweep-train", "batch": batch, "seq": seq, "label": label, "config": repr(launch),
                   "f64_err": errs[label]}
            try:
                row["bits"] = _compare(_grads(A, q, k, v, go, cu, launch), ref)
                ms = bench_ms(lambda: _grads(A, q, k, v, go, cu, launch), warmup=10, rep=60)
                row["ms"] = round(ms, 4)
                default_ms = default_ms or ms
                row["vs_default"] = round(default_ms / ms, 3)
            except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on
                row["error"] = repr(exc)[:200]
            rows.append(row)
        base = _sdpa_train_ms(q, k, v, go, batch, seq)
        rows.append({"kind": "sweep-train", "batch": batch, "seq": seq, "label": "baseline", "config": base[1],
                     "ms": round(base[0], 4)})
        for r in rows[-len(cands) - 1:-1]:
            if "ms" in r:
                r["vs_sdpa"] = round(base[0] / r["ms"], 3)
        del q, k, v, go, ref
    return rows


def _sdpa_train_ms(q, k, v, go, batch: int, seq: int) -> tuple[float, str]:
    """SDPA (flash if it takes the call) forward + backward on [batch, heads, seq, D] copies of the packed inputs."""
    from rlalign.bench.cuda_timing import bench_ms
    qs, ks, vs = (x.view(batch, seq, -1, D).transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    gos = go.view(batch, seq, -1, D).transpose(1, 2)
    run, backend = _sdpa(qs, ks, vs, True)
    return bench_ms(lambda: torch.autograd.grad(run(), (qs, ks, vs), gos), warmup=10, rep=60), f"sdpa-{backend}"


def print_train(rows: list[dict]) -> None:
    """Per shape: each candidate's forward + backward time, speed vs the default and vs SDPA, bits vs the
    default and worst error vs float64; then the fastest candidate within tolerance per shape."""
    print(f"{'shape':>9} {'label':>16} {'ms':>8} {'vs dflt':>7} {'vs sdpa':>7} {'f64 err':>8} bits")
    for r in rows:
        err = r.get("f64_err")
        err = f"{err:.2e}" if isinstance(err, float) else ("-" if err is None else "ERROR")
        print(f"{str(r['batch']) + 'x' + str(r['seq']):>9} {r['label']:>16} {r.get('ms', '-'):>8} "
              f"{r.get('vs_default', '-'):>7} {r.get('vs_sdpa', '-'):>7} {err:>8} "
              f"{r.get('bits', r['config'] if r['label'] == 'baseline' else 'ERROR')}"
              + (f"  {r['error']}" if "error" in r else ""))
    for shape in dict.fromkeys((r["batch"], r["seq"]) for r in rows):
        ok = [r for r in rows if (r["batch"], r["seq"]) == shape and "ms" in r and r["label"] != "baseline"
              and (r.get("bits") == "equal" or (isinstance(r.get("f64_err"), float) and r["f64_err"] <= TRAIN_TOL))]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            how = "bit-equal" if best["bits"] == "equal" else f"within {TRAIN_TOL} of float64, other bits"
            print(f"{shape[0]}x{shape[1]}: fastest {best['label']} ({how}) {best['ms']} ms, "
                  f"{best.get('vs_sdpa', '-')} of SDPA: {best['config']}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="strict attention vs SDPA flash (H200)")
    ap.add_argument("--out")
    ap.add_argument("--sweep-decode", action="store_true",
                    help="only the decode launch sweep: candidate DecodeLaunch configs of the split and per-item "
                         "launches as graph replays at batch " + "/".join(map(str, SWEEP_BATCHES)) +
                         ", each checked bitwise against the per-item default")
    ap.add_argument("--sweep-train", action="store_true",
                    help="only the training backward sweep: candidate BackwardLaunch configs, forward + backward at "
                         + ", ".join(f"{b}x{s}" for b, s in TRAIN_SHAPES) + " tokens vs SDPA flash, gradients "
                         "checked against the default's bits and a float64 reference")
    ap.add_argument("--sweep-small-tiles", action="store_true",
                    help="with --sweep-decode: only the per-item and streamed launches, with 16/32-row tiles "
                         "(mma.sync) beside the 64-row default")
    ap.add_argument("--sweep-batches", help="the decode sweep's batches, comma-separated (e.g. 462: the "
                                            "0.6b-ctx512 rollout's mean running sequences)")
    ap.add_argument("--sweep-shape", metavar="CTX,HQ,HKV",
                    help=f"the decode sweep's context and heads (default {SWEEP_CTX},{SWEEP_HQ},{SWEEP_HKV}; "
                         "the 0.6B shape: 512,16,8)")
    return ap


def main() -> int:
    args = parser().parse_args()
    global SWEEP_BATCHES, SWEEP_CTX, SWEEP_HQ, SWEEP_HKV, SMALL_TILES
    if args.sweep_small_tiles and not args.sweep_decode:
        print("gpu_attention: --sweep-small-tiles only applies to --sweep-decode")
        return 2
    SMALL_TILES = args.sweep_small_tiles
    if args.sweep_batches:
        if (batches := positive_ints(args.sweep_batches)) is None:
            print(f"gpu_attention: --sweep-batches {args.sweep_batches!r}: comma-separated batch sizes, each >= 1")
            return 2
        SWEEP_BATCHES = batches
    if args.sweep_shape:
        shape = positive_ints(args.sweep_shape, 3)
        if shape is None or shape[1] % shape[2]:
            print(f"gpu_attention: --sweep-shape {args.sweep_shape!r}: CTX,HQ,HKV, each >= 1, HQ a multiple of HKV")
            return 2
        SWEEP_CTX, SWEEP_HQ, SWEEP_HKV = shape
    if not torch.cuda.is_available():
        print("gpu_attention: no CUDA device")
        return 1
    import rlalign.ops.triton_backend  # noqa: F401
    if args.sweep_train:
        return run_sweep(args.out, "attention_train_sweep", sweep_train, print_train)
    if args.sweep_decode:
        return run_sweep(args.out, "attention_sweep", sweep_decode, print_sweep)
    plan = [(prefill, (4, 4096, 32, 8)), (prefill, (4, 4096, 32, 32)), (prefill, (1, 4096, 32, 8)),
            (prefill, (8, 4096, 32, 8)),
            (decode, (1, 4096, 32, 8, 16)), (decode, (8, 4096, 32, 8, 16)), (decode, (64, 4096, 32, 8, 16)),
            (decode, (256, 4096, 32, 8, 16)), (decode, (64, 4096, 32, 8, 64)), (decode, (64, 1024, 32, 8, 64)),
            (training, (2, 4096, 32, 8))]
    rows, t0 = [], time.time()
    for fn, a in plan:
        try:
            row = fn(*a)
        except Exception as exc:
            traceback.print_exc()
            row = {"kind": fn.__name__, "args": str(a), "error": repr(exc)[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    write(args.out, "attention", rows, t0)
    print(f"{'kind':>14} {'B':>3} {'seq':>5} {'Hq/Hkv':>6} {'ours ms':>8} {'base ms':>8} {'ratio':>6} {'op ratio':>8} "
          f"target  baseline")
    for r in rows:
        if "error" in r:
            print(f"{r['kind']:>14} ERROR {r['error'][:80]}")
            continue
        print(f"{r['kind']:>14} {r['batch']:>3} {r['seq']:>5} {str(r['hq']) + '/' + str(r['hkv']):>6} "
              f"{r['ours_ms']:>8} {r['base_ms']:>8} {r['ratio']:>6} {r.get('op_ratio', '-'):>8} {str(r['target']):>6}  "
              f"{r['baseline']}" + (f"  launch={r['launch']} split={r['split_ratio']} item={r['item_ratio']}"
                                    f" stream={r['stream_ratio']} graph={r.get('graph_ratio', '-')} graph ms: split "
                                    f"{r.get('graph_split_ms', '-')} item {r.get('graph_item_ms', '-')} stream "
                                    f"{r.get('graph_stream_ms', '-')} base {r.get('graph_base_ms', '-')}"
                                    if r["kind"] == "decode" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
