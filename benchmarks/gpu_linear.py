"""Benchmark: strict Triton linear vs cuBLAS (torch.matmul), bf16, Qwen3-8B shapes, same run.

For each (N x K) in 4096x4096, 12288x4096, 4096x12288, 151936x4096 and M in 1..16384:
median time (triton.testing.do_bench, which also flushes L2 between runs) of the strict GEMM kernel
as ``ops.linear`` launches it (``gemm`` with the dispatcher's config; columns strict_*, ratio), of
``ops.linear(x, W)`` end to end (op_ms, op_ratio: adds the op's input validation, whose NaN/inf
check synchronises with the host) and ``torch.matmul(x, W.T)`` (cuBLAS), each over a
rotation of input copies larger than L2; TFLOP/s, GB/s (bytes = W + x + y, the decode floor) and
the ratio strict/cuBLAS speed. For M <= 512 also both replayed from a CUDA graph, as the rollout engine
runs decode (graph_strict_ms, graph_cublas_ms, graph_ratio; no host launch cost), and ``ops.linear`` captured
as the engine captures it (graph_op_ms, graph_op_ratio: the op's checks recorded into the graph). Also: the canonical K partition (k_segments=8: o_proj, down_proj)
and a tile-config sweep at M=4096 (every config gives the same bits; this says which is fastest).

Model layers (``--set layers``; rows with ``"kind": "layer"``): each linear of a Qwen3-8B layer
called as the model calls it -- ``ops.linear(x, W, k_segments=8)`` for o_proj and down_proj, plain
for q/k/v/gate/up -- against ``F.linear(x, W)`` (what a stock model calls), the same rotation of
inputs; ``op_vs_flinear`` = F.linear time / ops.linear time (> 1: ours faster). These, not the
kernel-only ``ratio``, are the figures a model sees.

    python benchmarks/gpu_linear.py [--out DIR] [--set all|kernel|layers] [--quick] [--sweep-small] [--sweep-mid]
                               [--sweep-kpart] [--sweep-ws [--ws-candidates I,J,...|none] [--ws-small] ...]

``--sweep-ws --ws-small``: the Triton kernel's decode tiles (gemm.SMALL_M_TILES + TRITON_SMALL_EXTRA: 16/32-row
mma.sync tiles and 128/256-column k-steps) beside the dispatcher's, e.g. ``--ws-candidates none --ws-small --ws-shapes
8b-plain,8b-stacked,lm-head,0.6b-stacked --ws-m 1,8,24,32,48,64`` (how gemm.SMALL_M_TILES was chosen).

``--sweep-small``: only the decode-size K-partition split (M 1-64, k_segments 8, the 8B and 0.6B o_proj /
down_proj shapes): candidate launches (gemm.SegmentSplitConfig: block N, warps, stages, the tree kernel's
block) as CUDA-graph replays vs cuBLAS, each output compared bit for bit with the default's; prints the
SEGMENT_SPLIT_TABLE lines to paste (only candidates bit-equal in every case; bench_linear_sweep_small.*).

``--sweep-mid``: only the K partition at decode batches past SPLIT_SEGMENTS_MAX_M (M 80-1,024, the rollout's running
sequences; same shapes): the dispatcher's one-kernel tree vs the split into per-segment partials forced with
``gemm(split=...)`` (a few launches), bits checked against the dispatcher's; prints per M which is faster and the
SPLIT_SEGMENTS_MAX_M / SEGMENT_SPLIT_TABLE change (bench_linear_sweep_mid.*).

``--sweep-kpart``: only the large-M canonical K partition (k_segments 8, M 1024 / 4096 / 16384, the 8B o_proj and
down_proj shapes, which are also the column-parallel dX shapes): every gemm.KPART_CANDIDATES schedule as CUDA-graph
replays vs cuBLAS, refused (not timed) unless its output is bit-equal to the default's; then the P = 1 dX / dW
GEMMs of the trainer's backward as the dispatcher launches them; prints a table and the winning config as the
one-line change to gemm.py (bench_linear_sweep_kpart.*). Bounded in time: 5 candidates (one compile each,
~10-20 s; both shapes share it) x 6 timed cases, then the P = 1 rows (2 more compiles) until 110 s have passed.

``--sweep-ws``: only the warp-specialized Gluon K-partition kernel (gemm_ws.py): gemm_ws.WS_CANDIDATES vs the
default and cuBLAS at M 462 / 1,024 / 4,096 / 16,384 on the 8B o_proj and down_proj (k_segments 8), graph replays,
refused unless bit-equal to the default (the first differing index and values are printed); a table and the one-line
change (bench_linear_sweep_ws.*). Bounded in time (<= 90 s): later cases are skipped past 75 s (the
candidates in WS_CANDIDATES order, one compile each); a launch that hangs ends the run naming it.
``--ws-candidates 0,1,2,3`` times only those WS_CANDIDATES indices (e.g. the default and the previous default);
``--ws-shapes 8b,0.6b,8b-plain,0.6b-plain`` picks the layers (``-plain``: the P = 1 q/k/v/gate projections, against
the Triton kernel; ``-stacked``: q/k/v and gate/up as the one launch of ops.linear_group), ``--ws-m 244,462`` the
row counts (at M <= 256 the K partition's baseline is the dispatcher's
per-segment split). ``--ws-shapes 8b-p4 --ws-deep-ring``: an experiment -- the 8B K-partition layers at P = 4 with
gemm_ws.DEEP_RING_WS's 160 KiB rings beside the default's 96 KiB (does ring depth limit the kernel?).
No CPU smoke: Gluon has no interpreter (the CPU compile of tests/ops/test_gemm_ws_compile.py stands in for it).

Writes bench_linear.csv / bench_linear.json to $OUT (or --out, default benchmarks/).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import sys
import time
import traceback

import torch

from rlalign.bench.args import positive_ints

SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288), (151936, 4096))
M_VALUES = (1, 16, 64, 256, 1024, 4096, 16384)
SEGMENT_SHAPES = ((4096, 4096), (4096, 12288))
SEGMENT_M = (1, 64, 80, 256, 4096, 16384)   # 80: the 8B headline run's decode batch
# a Qwen3-8B decoder layer's linears as rlalign.models calls them: (name, N, K, k_segments)
MODEL_LAYERS = (("q_proj", 4096, 4096, None), ("k_proj", 1024, 4096, None), ("o_proj", 4096, 4096, 8),
                ("gate_proj", 12288, 4096, None), ("down_proj", 4096, 12288, 8))
ROTATE_BYTES = 512 << 20   # each input set rotates through copies totalling at least this


def env_info() -> dict:
    import triton
    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds")}


def out_dir(arg: str | None) -> str:
    path = arg or os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(path, exist_ok=True)
    return path


def write(out_arg: str | None, name: str, rows: list[dict], started: float) -> None:
    """bench_<name>.csv and .json (rows + GPU/versions/date and the run's seconds) under --out / $OUT."""
    env = {**env_info(), "seconds": round(time.time() - started, 1)}
    path_dir = out_dir(out_arg)
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in rows[0], k)) if rows else []
    with open(os.path.join(path_dir, f"bench_{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(path_dir, f"bench_{name}.json"), "w") as f:
        json.dump({"env": env, "bench": name, "rows": rows}, f, indent=1, default=str)


def run_sweep(out_arg: str | None, name: str, sweep, show) -> int:
    """A sweep mode's whole run: ``sweep()`` -> rows, written as bench_<name>.* and printed by ``show``."""
    t0 = time.time()
    rows = sweep()
    write(out_arg, name, rows, t0)
    show(rows)
    print(f"sweep: {time.time() - t0:.0f} s")
    return 0


def rotating(make, nbytes: int):
    """A list of independent copies of a tensor, enough to exceed ROTATE_BYTES (at least 1)."""
    copies = max(1, min(16, -(-ROTATE_BYTES // max(nbytes, 1))))
    return [make(i) for i in range(copies)]


def timed(fn, sets) -> float:
    """Median ms of fn(*set) cycling through the input sets."""
    import triton
    state = {"i": 0}

    def call():
        fn(*sets[state["i"] % len(sets)])
        state["i"] += 1
    call()
    torch.cuda.synchronize()
    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")


# decode-sized calls are also timed as CUDA graph replays, as the rollout engine runs them: their eager time
# is mostly the launcher's host work (two launches, TMA descriptors and the partials buffer for the split path)
GRAPH_MAX_M = 512


def graph_op_fields(op, sets, cublas_ms: float) -> dict:
    """graph_op_ms / graph_op_ratio: ``op`` (ops.linear) captured as the rollout engine captures its decode step --
    inside ops.capturing_graph, where the op's checks are recorded into the graph instead of synchronising -- one
    replay per rotation of the input sets; or graph_op_error naming what could not be captured."""
    from rlalign import ops
    from rlalign.bench.cuda_timing import bench_ms, graphed
    try:
        g_op = bench_ms(graphed(lambda: [op(x, w) for x, w in sets], capture_context=ops.capturing_graph)) / len(sets)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on
        return {"graph_op_error": repr(exc)[:200]}
    return {"graph_op_ms": round(g_op, 4), "graph_op_ratio": round(cublas_ms / g_op, 3)}


def graph_fields(strict, sets) -> dict:
    """graph_strict_ms / graph_cublas_ms / graph_ratio: one replay runs every input set once (the rotation that
    keeps W out of L2), divided by the number of sets; or graph_error naming what could not be captured."""
    from rlalign.bench.cuda_timing import bench_ms, graphed
    try:
        g_strict = bench_ms(graphed(lambda: [strict(x, w) for x, w in sets])) / len(sets)
        g_cublas = bench_ms(graphed(lambda: [torch.matmul(x, w.T) for x, w in sets])) / len(sets)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on
        return {"graph_error": repr(exc)[:200]}
    return {"graph_strict_ms": round(g_strict, 4), "graph_cublas_ms": round(g_cublas, 4),
            "graph_ratio": round(g_cublas / g_strict, 3)}


def case(m: int, n: int, k: int, segments: int | None = None, config=None) -> dict:
    from rlalign import ops
    from rlalign.ops.triton_backend.gemm import gemm, pick_config
    from rlalign.ops.triton_backend._common import device_sms
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    w_sets = rotating(lambda i: torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16), n * k * 2)
    x_sets = [torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16) for _ in range(len(w_sets))]
    sets = list(zip(x_sets, w_sets))
    row = {"M": m, "N": n, "K": k, "k_segments": segments or 1}
    from rlalign.ops.triton_backend.gemm import SPLIT_SEGMENTS_MAX_M, segment_split_config
    cfg = config or pick_config(m, n, segments or 1, False, device_sms(x_sets[0]))
    split = config is None and (segments or 1) > 1 and m <= SPLIT_SEGMENTS_MAX_M
    # the kernel as the op launches it (same choice: decode-sized M on a K partition runs as per-segment
    # partials + the tree kernel), without the op's input validation
    strict = lambda x, w: gemm(x, w, b_trans=True, segments=segments or 1, config=config)  # noqa: E731
    row["config"] = split_label(segment_split_config(m)) if split else tile_label(cfg, segments or 1)
    t_strict = timed(strict, sets)
    t_cublas = timed(lambda x, w: torch.matmul(x, w.T), sets)
    if m <= GRAPH_MAX_M:
        row.update(graph_fields(strict, sets))
    if config is None:
        # the public op end to end: + validation (its NaN/inf check syncs with the host) + dispatch
        op = lambda x, w: ops.linear(x, w, k_segments=segments)  # noqa: E731
        t_op = timed(op, sets)
        row.update(op_ms=round(t_op, 4), op_ratio=round(t_cublas / t_op, 3))
        if m <= GRAPH_MAX_M and "graph_cublas_ms" in row:
            row.update(graph_op_fields(op, sets, row["graph_cublas_ms"]))
    flops = 2.0 * m * n * k
    nbytes = 2.0 * (n * k + m * k + m * n)
    row.update(strict_ms=round(t_strict, 4), cublas_ms=round(t_cublas, 4),
               strict_tflops=round(flops / t_strict / 1e9, 1), cublas_tflops=round(flops / t_cublas / 1e9, 1),
               strict_gbs=round(nbytes / t_strict / 1e6, 0), cublas_gbs=round(nbytes / t_cublas / 1e6, 0),
               ratio=round(t_cublas / t_strict, 3))
    del w_sets, x_sets, sets
    torch.cuda.empty_cache()
    return row


def split_label(cfg) -> str:
    """A SegmentSplitConfig as the tables print it: "split 64x64/w4/s4 + tree/1024w4"."""
    return (f"split 64x{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}" + (f"/g{cfg.group_m}" if cfg.group_m != 8 else "")
            + f" + tree/{cfg.merge_block}w{cfg.merge_warps}")


def _graph_ms(fn, sets) -> float:
    """ms per input set of one CUDA-graph replay running ``fn(*set)`` on every set (the sweeps' one timer)."""
    from rlalign.bench.cuda_timing import replay_ms_per_set
    return replay_ms_per_set(fn, sets, warmup=10, rep=50)


def print_progress(t0: float, layer: str, m: int, row: dict, width: int) -> None:
    """One sweep case as it finishes: elapsed seconds, layer, M, launch, ratio, bits (or the error, cut to width)."""
    print(f"[{time.time() - t0:5.0f} s] {layer} M={m} {row['label']}: {row.get('ratio', '-')} "
          f"{row.get('bits', row.get('error', ''))[:width]}", flush=True)


def time_if_bit_equal(row: dict, run, sets, ref, base_ms: float, ms_of) -> None:
    """The sweeps' one rule: ``run(x, w)`` on the first and last input sets must give ``ref``'s raw bits, else the
    candidate is refused (row["bits"] says where it differs) and not timed; a bit-equal one gets graph_ms =
    ``ms_of(run, sets)`` and ratio = base_ms / graph_ms (> 1: faster than the baseline). Errors are reported."""
    from rlalign.contract.bits import bits_equal, describe_difference
    try:
        outs = [run(x, w) for x, w in (sets[0], sets[-1])]
        bad = [describe_difference(o, r) for o, r in zip(outs, ref) if not bits_equal(o, r)]
        row["bits"] = "DIFFER " + bad[0] if bad else "equal"
        if not bad:
            ms = ms_of(run, sets)
            row.update(graph_ms=round(ms, 5), ratio=round(base_ms / ms, 3))
    except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on
        row["error"] = repr(exc)[:200]


# --sweep-small: the decode-size split (k_segments 8, M <= 64) on the 8B / 0.6B o_proj and down_proj shapes,
# candidate SegmentSplitConfigs as CUDA-graph replays (the rotation of W copies inside one replay), each
# output compared bit for bit with the default's.
SMALL_SHAPES = (("8B o_proj", 4096, 4096), ("8B down_proj", 4096, 12288), ("0.6B o_proj", 1024, 2048),
                ("0.6B down_proj", 1024, 3072))
SMALL_M = (1, 8, 16, 32, 64)
SWEEP_DEVICE = "cuda"   # the CPU smoke test of the sweep (interpreter) sets "cpu"


def small_candidates():
    """The table's default first, then one change at a time (BLOCK_M stays 64; few: compiles count)."""
    from dataclasses import replace
    from rlalign.ops.triton_backend.gemm import SegmentSplitConfig
    base = SegmentSplitConfig()
    cands = [base, replace(base, block_n=32), replace(base, block_n=128), replace(base, num_stages=3),
             replace(base, num_stages=6), replace(base, block_n=128, num_warps=8), replace(base, merge_block=256)]
    return list(dict.fromkeys(cands))


def sweep_small() -> list[dict]:
    from rlalign.ops.triton_backend.gemm import gemm
    rows = []
    cands = small_candidates()
    for name, n, k in SMALL_SHAPES:
        g = torch.Generator(device=SWEEP_DEVICE).manual_seed(n + k)
        w_sets = rotating(lambda i: torch.randn(n, k, device=SWEEP_DEVICE, generator=g).to(torch.bfloat16), n * k * 2)
        for m in SMALL_M:
            sets = [(torch.randn(m, k, device=SWEEP_DEVICE, generator=g).to(torch.bfloat16), w) for w in w_sets]
            ref = [gemm(x, w, b_trans=True, segments=8, split=cands[0]) for x, w in (sets[0], sets[-1])]
            base = _graph_ms(lambda x, w: torch.matmul(x, w.T), sets)
            for cfg in cands:
                row = {"kind": "sweep-small", "layer": name, "M": m, "N": n, "K": k, "config": repr(cfg),
                       "label": split_label(cfg), "cublas_ms": round(base, 5)}
                time_if_bit_equal(row, lambda x, w: gemm(x, w, b_trans=True, segments=8, split=cfg), sets, ref, base,
                                  _graph_ms)
                rows.append(row)
        del w_sets
        torch.cuda.empty_cache()
    return rows


def print_cases(rows: list[dict], refused_title: str) -> set[str]:
    """The decode sweeps' table (one line per case: ratio = cuBLAS / ours, graph ms, bits, launch; where it
    differs or failed) and one line naming the refused launches; returns their configs (never picked)."""
    print(f"{'M':>5} {'layer':>15} {'ratio':>6} {'ms':>8} {'bits':>6}  launch")
    for r in rows:
        print(f"{r['M']:>5} {r['layer']:>15} {r.get('ratio', '-'):>6} {r.get('graph_ms', '-'):>8} "
              f"{r.get('bits', 'ERROR')[:6]:>6}  {r['label']}" + (f"  {r.get('error', '')}{r.get('bits', '')[6:]}"
                                                                   if r.get("bits") != "equal" else ""))
    refused = {r["config"] for r in rows if r.get("bits") != "equal"}
    print(f"{refused_title}: " + (", ".join(sorted({r["label"] for r in rows if r["config"] in refused})) or "none"))
    return refused


def print_small(rows: list[dict]) -> None:
    """Each case's candidates (ratio = cuBLAS / ours, bits); then per M the candidate with the best geometric-mean
    ratio over the shapes among those bit-equal in EVERY case, as SEGMENT_SPLIT_TABLE lines to paste."""
    disqualified = print_cases(rows, "candidates that differ from the default or failed (never picked)")
    print("SEGMENT_SPLIT_TABLE (rlalign/ops/triton_backend/gemm.py), geometric-mean ratio over the shapes:")
    for m in SMALL_M:
        score = {}
        for r in rows:
            if r["M"] == m and r["config"] not in disqualified:
                score.setdefault(r["config"], []).append(r["ratio"])
        full = {c: v for c, v in score.items() if len(v) == len(SMALL_SHAPES)}
        if not full:
            print(f"    # M <= {m}: no candidate passed everywhere")
            continue
        gm = {c: float(torch.tensor(v).log().mean().exp()) for c, v in full.items()}
        best = max(gm, key=gm.get)
        print(f"    ({m}, {best}),   # {gm[best]:.3f} (default {gm.get(repr(small_candidates()[0]), float('nan')):.3f})")


# --sweep-mid: the K partition at decode batches past SPLIT_SEGMENTS_MAX_M (the rollout's 80-1,024 running
# sequences): the one-kernel tree the dispatcher launches there (a few output tiles per SM, each walking its 8
# segments with a pipeline drain per segment) against the split into per-segment partials + the tree kernel (P-fold
# more programs), forced with gemm(split=...). Same bits by construction; checked here.
MID_M = (80, 128, 256, 462, 512, 1024)   # 80: the 8B headline's decode batch; 462: 0.6b-ctx512's mean decode rows


def mid_candidates():
    """SEGMENT_SPLIT_TABLE's largest-M launch first, then wider tiles (the table's M <= 32 one among them)."""
    from dataclasses import replace
    from rlalign.ops.triton_backend.gemm import SEGMENT_SPLIT_TABLE
    base = SEGMENT_SPLIT_TABLE[-1][1]
    cands = [base, replace(base, block_n=128), replace(base, block_n=128, num_warps=8), replace(base, num_stages=4),
             SEGMENT_SPLIT_TABLE[0][1]]
    return list(dict.fromkeys(cands))


def sweep_mid() -> list[dict]:
    from rlalign.ops.triton_backend.gemm import gemm
    rows, t0 = [], time.time()
    cands = mid_candidates()
    for name, n, k in SMALL_SHAPES:
        g = torch.Generator(device=SWEEP_DEVICE).manual_seed(n + k)
        w_sets = rotating(lambda i: torch.randn(n, k, device=SWEEP_DEVICE, generator=g).to(torch.bfloat16), n * k * 2)
        for m in MID_M:
            sets = [(torch.randn(m, k, device=SWEEP_DEVICE, generator=g).to(torch.bfloat16), w) for w in w_sets[:8]]
            ref = [gemm(x, w, b_trans=True, segments=8) for x, w in (sets[0], sets[-1])]   # the dispatcher's launch
            base = _graph_ms(lambda x, w: torch.matmul(x, w.T), sets)
            tree = _graph_ms(lambda x, w: gemm(x, w, b_trans=True, segments=8), sets)
            common = {"kind": "sweep-mid", "layer": name, "M": m, "N": n, "K": k, "cublas_ms": round(base, 5)}
            rows.append(dict(common, config="dispatcher", label="one-kernel tree (dispatcher)", bits="equal",
                             graph_ms=round(tree, 5), ratio=round(base / tree, 3)))
            for cfg in cands:
                row = dict(common, config=repr(cfg), label=split_label(cfg))
                time_if_bit_equal(row, lambda x, w: gemm(x, w, b_trans=True, segments=8, split=cfg), sets, ref, base,
                                  _graph_ms)
                rows.append(row)
            print(f"[{time.time() - t0:5.0f} s] {name} M={m}: tree {rows[-len(cands) - 1]['ratio']}, split best "
                  f"{max((r.get('ratio', 0) for r in rows[-len(cands):]), default='-')}", flush=True)
            del sets
        del w_sets
        if SWEEP_DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_mid(rows: list[dict]) -> None:
    """Each case (ratio = cuBLAS / ours, graph replays); then per M the geometric mean over the shapes of the
    dispatcher's one-kernel tree and of the best split launch bit-equal everywhere, and the SPLIT_SEGMENTS_MAX_M
    / SEGMENT_SPLIT_TABLE lines that take the split up to the largest M where it wins on the geometric mean."""
    refused = print_cases(rows, "split launches refused (bits differ from the dispatcher's, or failed)")
    lines, wins_to = [], None
    for m in MID_M:
        score = {}
        for r in rows:
            if r["M"] == m and r["config"] not in refused and "ratio" in r:
                score.setdefault(r["config"], []).append(r["ratio"])
        full = {c: float(torch.tensor(v).log().mean().exp()) for c, v in score.items() if len(v) == len(SMALL_SHAPES)}
        tree = full.pop("dispatcher", float("nan"))
        if not full:
            print(f"M = {m}: no split launch passed on every shape (tree {tree:.3f})")
            continue
        best = max(full, key=full.get)
        print(f"M = {m}: one-kernel tree {tree:.3f}, best split {full[best]:.3f}  {best}")
        if full[best] > tree and (wins_to is None or wins_to == MID_M[MID_M.index(m) - 1]):
            wins_to = m
            lines.append(f"    ({m}, {best}),   # {full[best]:.3f} (one-kernel tree {tree:.3f})")
    if wins_to is None:
        print("the split wins at no M above SPLIT_SEGMENTS_MAX_M on the geometric mean: no change")
    else:
        print(f"CHANGE (gemm.py): SPLIT_SEGMENTS_MAX_M = {wins_to}, and append to SEGMENT_SPLIT_TABLE:")
        print("\n".join(lines))


# --sweep-kpart: the large-M K partition (k_segments 8) schedules of gemm.KPART_CANDIDATES on the 8B o_proj
# (4096x4096, K 4096) and down_proj (4096x12288) shapes, which are also the shapes of the column-parallel dX
# with the canonical N partition (q/k/v/gate/up backward, distributed.layers: the same b_trans kernel); the
# P = 1 backward GEMMs the trainer runs (row-parallel dX, dW) as the dispatcher launches them, for reference.
KPART_SHAPES = (("o_proj", 4096, 4096), ("down_proj", 4096, 12288))
KPART_M = (1024, 4096, 16384)
# (name, N, K): dX = dY [M, N] @ W [N, K] (P = 1, B not transposed); dW = dY^T @ X [M, K] (A transposed)
KPART_BACKWARD = (("o_proj dX", 4096, 4096, "dx"), ("down_proj dX", 4096, 12288, "dx"),
                  ("o_proj dW", 4096, 4096, "dw"), ("down_proj dW", 4096, 12288, "dw"))

KPART_BACKWARD_AFTER_S = 110   # the reference rows are skipped past this many seconds (the sweep within ~150 s)


def kpart_label(cfg) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}/rl{cfg.reg_levels}"
            + ("/stream" if cfg.stream else "/nested" if cfg.nested else "/flat")
            + (f"/x{cfg.ctas_per_sm}" if cfg.ctas_per_sm != 1 else ""))


def sweep_kpart() -> list[dict]:
    from rlalign.ops.triton_backend.gemm import KPART_CANDIDATES, gemm
    rows, t0 = [], time.time()
    for name, n, k in KPART_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w_sets = rotating(lambda i: torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16), n * k * 2)
        for m in KPART_M:
            sets = [(torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16), w) for w in w_sets[:4]]
            ref = [gemm(x, w, b_trans=True, segments=8, config=KPART_CANDIDATES[0]) for x, w in (sets[0], sets[-1])]
            base = _graph_ms(lambda x, w: torch.matmul(x, w.T), sets)
            for cfg in KPART_CANDIDATES:
                row = {"kind": "sweep-kpart", "layer": name, "M": m, "N": n, "K": k, "config": repr(cfg),
                       "label": kpart_label(cfg), "cublas_ms": round(base, 4)}
                time_if_bit_equal(row, lambda x, w: gemm(x, w, b_trans=True, segments=8, config=cfg), sets, ref,
                                  base, _graph_ms)
                rows.append(row)
                print_progress(t0, name, m, row, 80)
            del sets
        del w_sets
        torch.cuda.empty_cache()
    for name, n, k, kind in KPART_BACKWARD:   # as the trainer launches them (the dispatcher's config)
        for m in KPART_M:
            if time.time() - t0 > KPART_BACKWARD_AFTER_S:   # keep the whole sweep within its time bound
                print(f"[{time.time() - t0:5.0f} s] {name} M={m}: skipped (past {KPART_BACKWARD_AFTER_S} s)", flush=True)
                continue
            g = torch.Generator(device="cuda").manual_seed(m + n + k)
            dy = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
            if kind == "dx":
                w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
                ours, cublas = (lambda: gemm(dy, w)), (lambda: torch.matmul(dy, w))
            else:
                x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                ours, cublas = (lambda: gemm(dy, x, a_trans=True)), (lambda: torch.matmul(dy.T, x))
            base, ms = _graph_ms(cublas, [()]), _graph_ms(ours, [()])
            rows.append({"kind": "kpart-backward", "layer": name, "M": m, "N": n, "K": k, "label": "dispatcher (P = 1)",
                         "cublas_ms": round(base, 4), "graph_ms": round(ms, 4), "ratio": round(base / ms, 3)})
            print(f"[{time.time() - t0:5.0f} s] {name} M={m}: {rows[-1]['ratio']}", flush=True)
    return rows


def print_kpart(rows: list[dict]) -> None:
    """Per shape and M each candidate's ratio (cuBLAS / ours, graph replays) and bits; then, per shape, the
    candidate with the best geometric-mean ratio over M among those bit-equal to the default EVERYWHERE, as the
    one-line change to make in gemm.py (_SEG_LARGE's first entry serves every large-M K partition)."""
    print(f"{'layer':>14} {'M':>6} {'ratio':>6} {'ms':>8} {'bits':>6}  config")
    for r in rows:
        print(f"{r['layer']:>14} {r['M']:>6} {r.get('ratio', '-'):>6} {r.get('graph_ms', '-'):>8} "
              f"{r.get('bits', 'ERROR' if 'error' in r else '-')[:6]:>6}  {r['label']}"
              + (f"  {r.get('error', '')}{r.get('bits', '')[6:]}" if r.get("bits", "equal") != "equal" or "error" in r else ""))
    sweep = [r for r in rows if r["kind"] == "sweep-kpart"]
    refused = {r["config"] for r in sweep if r.get("bits") != "equal"}
    print("refused (bits differ from the default, or failed): " + (", ".join(
        sorted({r["label"] for r in sweep if r["config"] in refused})) or "none"))
    overall = {}
    for name, _, _ in KPART_SHAPES:
        score = {}
        for r in sweep:
            if r["layer"] == name and r["config"] not in refused:
                score.setdefault(r["config"], []).append(r["ratio"])
                overall.setdefault(r["config"], []).append(r["ratio"])
        full = {c: v for c, v in score.items() if len(v) == len(KPART_M)}
        if not full:
            print(f"{name}: no candidate passed at every M")
            continue
        gm = {c: float(torch.tensor(v).log().mean().exp()) for c, v in full.items()}
        best = max(gm, key=gm.get)
        print(f"{name}: best {best} (geometric mean {gm[best]:.3f} over M; default {gm.get(sweep[0]['config'], float('nan')):.3f})")
    full = {c: v for c, v in overall.items() if len(v) == len(KPART_M) * len(KPART_SHAPES)}
    if full:
        gm = {c: float(torch.tensor(v).log().mean().exp()) for c, v in full.items()}
        best = max(gm, key=gm.get)
        print(f"ONE-LINE CHANGE (gemm.py): _SEG_LARGE = ({best}, GemmConfig(128, 64, 8, 4))   "
              f"# {gm[best]:.3f} over both shapes and M (default {gm.get(sweep[0]['config'], float('nan')):.3f})")


# --sweep-ws: the warp-specialized Gluon K-partition kernel (gemm_ws.WS_CANDIDATES) vs the default kernel and
# cuBLAS at the rollout's decode batches (462, 1,024) and training M (4,096, 16,384) on the 8B o_proj and down_proj
# (k_segments 8), CUDA-graph replays; a candidate is refused (not timed) unless bit-equal to the default. A launch
# that does not finish within WS_WATCHDOG_S (a pipeline deadlock) ends the run naming the case.
# (layer, N, K, P): the K-partition layers (P = 8), and with "-plain" the P = 1 layers of the same model (q_proj,
# k_proj = v_proj, gate_proj = up_proj), which the dispatcher runs on the Triton kernel
WS_SHAPES = {"8b": (("o_proj", 4096, 4096, 8), ("down_proj", 4096, 12288, 8)),
             "0.6b": (("0.6b o_proj", 1024, 2048, 8), ("0.6b down_proj", 1024, 3072, 8)),
             "8b-plain": (("q_proj", 4096, 4096, 1), ("kv_proj", 1024, 4096, 1), ("gate_proj", 12288, 4096, 1)),
             "0.6b-plain": (("0.6b q_proj", 2048, 1024, 1), ("0.6b kv_proj", 1024, 1024, 1),
                            ("0.6b gate_proj", 3072, 1024, 1)),
             # the stacked projections ops.linear_group runs as one launch (q/k/v, gate/up)
             "8b-stacked": (("qkv_proj", 6144, 4096, 1), ("gate_up_proj", 24576, 4096, 1)),
             "0.6b-stacked": (("0.6b qkv_proj", 4096, 1024, 1), ("0.6b gate_up_proj", 6144, 1024, 1)),
             # an experiment (gemm_ws.DEEP_RING_WS): the 8B K-partition layers at P = 4 -- not the contract's P = 8 --
             # where one fp32 tree level leaves room for a 160 KiB ring
             "8b-p4": (("o_proj P4", 4096, 4096, 4), ("down_proj P4", 4096, 12288, 4)),
             "lm-head": (("lm_head", 151936, 4096, 1), ("0.6b lm_head", 151936, 1024, 1))}
WS_M = (462, 1024, 4096, 16384)
WS_STOP_AFTER_S = 75       # later cases are skipped (the sweep within ~90 s with the compiles)
WS_WATCHDOG_S = 60.0       # includes the first call's compile (a few seconds)


# --ws-triton: the Triton kernel's own tiles as candidates beside the Gluon ones (gemm(config=...): the same bits as
# the dispatcher's tile by the rules of docs/design/tile-shapes.md, checked here like every candidate); the
# decode-row P = 1 projections are compute-bound at 244-462 rows, where the tile decides the waves and the L2 traffic
TRITON_PLAIN_CANDIDATES = (dict(block_m=128, block_n=128, num_warps=8, num_stages=3, flatten=True),
                           dict(block_m=128, block_n=128, num_warps=8, num_stages=5, flatten=True),
                           dict(block_m=128, block_n=128, num_warps=8, num_stages=4),
                           dict(block_m=128, block_n=128, num_warps=8, num_stages=4, flatten=True, group_m=1),
                           dict(block_m=128, block_n=256, num_warps=8, num_stages=3, flatten=True),
                           dict(block_m=64, block_n=256, num_warps=4, num_stages=4, flatten=True),
                           dict(block_m=64, block_n=128, num_warps=4, num_stages=6, flatten=True),
                           dict(block_m=64, block_n=128, num_warps=4, num_stages=4, flatten=True, ctas_per_sm=2))


# --ws-small: decode-size (M <= 64) tiles of the Triton kernel for the P = 1 projections, which stream W with few
# programs (N / BN of them): gemm.SMALL_M_TILES (the dispatcher's) and these runners-up of its sweep (2026-12-03) --
# wider k-steps (GemmConfig.block_k: the same k16 chunks in fewer loop iterations) and 16 / 32-row tiles, on which
# Triton issues mma.sync instead of wgmma; each candidate is refused unless bit-equal to the dispatcher's tile
TRITON_SMALL_EXTRA = (dict(block_m=32, block_n=32, num_warps=4, num_stages=3, flatten=True, block_k=256, ctas_per_sm=2),
                      dict(block_m=64, block_n=64, num_warps=4, num_stages=3, flatten=True, block_k=256))


def small_candidates_ws() -> tuple:
    """--ws-small's Triton tiles: every gemm.SMALL_M_TILES tile (once: two bands share one), then TRITON_SMALL_EXTRA."""
    from rlalign.ops.triton_backend.gemm import SMALL_M_TILES, GemmConfig
    tiles = [tile for _, band in SMALL_M_TILES for tile in band] + [GemmConfig(**kw) for kw in TRITON_SMALL_EXTRA]
    return tuple(dict.fromkeys(tiles))


def tile_label(cfg, segments: int = 1) -> str:
    """A Triton GemmConfig as the tables print it: "16x32/w4/s4/flat/k256/2cta" (fields at their defaults left out)."""
    return (f"{cfg.block_m}x{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}" + ("/flat" if cfg.flatten else "")
            + (f"/k{cfg.block_k}" if cfg.block_k != 64 else "") + (f"/g{cfg.group_m}" if cfg.group_m != 8 else "")
            + (f"/{cfg.ctas_per_sm}cta" if cfg.ctas_per_sm != 1 else "")
            + (f"/rl{cfg.reg_levels}" if segments > 1 else "") + ("/nested" if cfg.nested else "")
            + ("/stream" if cfg.stream else ""))


def ws_label(cfg) -> str:
    if not hasattr(cfg, "release"):   # a Triton GemmConfig
        return "triton " + tile_label(cfg)
    return (f"gluon {cfg.block_m}x{cfg.block_n}/s{cfg.stages}" + (f"/k{cfg.block_k}" if cfg.block_k != 64 else "")
            + (f"/g{cfg.group_m}" if cfg.group_m != 8 else "") + (f"/{cfg.release}" if cfg.release != "cta" else "")
            + ("/out_alias" if cfg.out_alias else "") + ("/level2_global" if cfg.level2_global else ""))


def ws_candidates(only: str | None) -> tuple:
    """gemm_ws.WS_CANDIDATES, or the ones at the comma-separated indices ``only`` (an unknown index: SystemExit)."""
    from rlalign.ops.triton_backend.gemm_ws import WS_CANDIDATES
    if only is None:
        return WS_CANDIDATES
    if only == "none":
        return ()
    try:
        return tuple(WS_CANDIDATES[int(i)] for i in only.split(","))
    except (ValueError, IndexError):
        raise SystemExit(f"--ws-candidates {only!r}: comma-separated indices of gemm_ws.WS_CANDIDATES "
                         f"(0..{len(WS_CANDIDATES) - 1}), or none") from None


def _watched(what: str, fn):
    from rlalign.bench.cuda_timing import watched
    return watched(what, fn, WS_WATCHDOG_S)


def sweep_ws(candidates: tuple, shapes: tuple = ("8b",), ms: tuple = WS_M,
             stop_after_s: float = WS_STOP_AFTER_S) -> list[dict]:
    """``shapes``: keys of WS_SHAPES; ``ms``: the row counts (at M <= 256 the baseline row is the dispatcher's
    decode-size split, gemm.SPLIT_SEGMENTS_MAX_M); cases left after ``stop_after_s`` seconds are skipped."""
    from rlalign.ops.triton_backend.gemm import gemm
    from rlalign.ops.triton_backend.gemm_ws import triton_kernel_only
    rows, t0 = [], time.time()
    for name, n, k, p in (shape for key in shapes for shape in WS_SHAPES[key]):
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w_sets = rotating(lambda i: torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16), n * k * 2)[:4]
        for m in ms:
            if time.time() - t0 > stop_after_s:
                print(f"[{time.time() - t0:5.0f} s] {name} M={m}: skipped (past {stop_after_s} s)", flush=True)
                continue
            sets = [(torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16), w) for w in w_sets]
            with triton_kernel_only():   # the reference and the baseline: the Triton kernel, not the Gluon default
                ref = [gemm(x, w, b_trans=True, segments=p) for x, w in (sets[0], sets[-1])]
                default_ms = _graph_ms(lambda x, w: gemm(x, w, b_trans=True, segments=p), sets)
            base = _graph_ms(lambda x, w: torch.matmul(x, w.T), sets)
            rows.append({"kind": "sweep-ws", "layer": name, "M": m, "N": n, "K": k, "P": p, "config": "default",
                         "label": "Triton kernel", "cublas_ms": round(base, 4), "graph_ms": round(default_ms, 4),
                         "ratio": round(base / default_ms, 3), "bits": "equal", "vs_default": 1.0})
            for cfg in candidates:
                row = {"kind": "sweep-ws", "layer": name, "M": m, "N": n, "K": k, "P": p, "config": repr(cfg),
                       "label": ws_label(cfg), "cublas_ms": round(base, 4)}

                def run(x, w, cfg=cfg, p=p):
                    if hasattr(cfg, "release"):
                        return gemm(x, w, b_trans=True, segments=p, ws=cfg)
                    with triton_kernel_only():
                        return gemm(x, w, b_trans=True, segments=p, config=cfg)
                try:
                    _watched(f"{name} M={m} {cfg}", lambda: run(*sets[0]))
                except Exception:  # noqa: BLE001 - time_if_bit_equal records the error
                    pass
                time_if_bit_equal(row, run, sets, ref, base, _graph_ms)
                if "graph_ms" in row:
                    row["vs_default"] = round(default_ms / row["graph_ms"], 3)
                rows.append(row)
                print_progress(t0, name, m, row, 160)
            del sets
        del w_sets
        torch.cuda.empty_cache()
    return rows


def print_ws(rows: list[dict]) -> None:
    """One line per (shape, M, launch): ratio = cuBLAS / ours and vs_default = default / ours (graph replays),
    bits; the refused candidates; and the one-line change when a candidate bit-equal everywhere beats the
    default's geometric mean over every case."""
    print(f"{'layer':>10} {'M':>6} {'ratio':>6} {'vs_def':>6} {'ms':>8} {'bits':>6}  launch")
    for r in rows:
        print(f"{r['layer']:>10} {r['M']:>6} {r.get('ratio', '-'):>6} {r.get('vs_default', '-'):>6} "
              f"{r.get('graph_ms', '-'):>8} {r.get('bits', 'ERROR' if 'error' in r else '-')[:6]:>6}  {r['label']}"
              + (f"  {r.get('error', '')}{r.get('bits', '')[6:]}" if r.get("bits", "equal") != "equal" or "error" in r
                 else ""))
    refused = {r["config"] for r in rows if r.get("bits") != "equal"}
    print("refused (bits differ from the default, or failed): " + (", ".join(
        sorted({r["label"] for r in rows if r["config"] in refused})) or "none"))
    cases = {(r["layer"], r["M"]) for r in rows}
    score = {}
    for r in rows:
        if r["config"] not in refused:
            score.setdefault(r["config"], []).append(r["ratio"])
    gm = {c: float(torch.tensor(v).log().mean().exp()) for c, v in score.items() if len(v) == len(cases)}
    best = max((c for c in gm if c != "default"), key=gm.get, default=None)
    from rlalign.ops.triton_backend.gemm_ws import DEFAULT_WS
    current = repr(DEFAULT_WS)
    triton_gm = gm.get("default", float("nan"))   # the "default" rows are the Triton kernel's
    if best is not None and best.startswith("GemmConfig"):
        print(f"FASTEST: the Triton kernel's tile {best} (cuBLAS/ours {gm[best]:.3f}, geometric mean, {len(cases)} "
              f"cases; gemm.pick_config decides which tile a call gets, not DEFAULT_WS)")
    elif best is None:
        print("ONE-LINE CHANGE: none (no Gluon candidate bit-equal in every case)")
    elif best == current or gm[best] <= gm.get(current, 0.0):
        print(f"ONE-LINE CHANGE: none (DEFAULT_WS is the fastest bit-equal launch: {gm.get(current, float('nan')):.3f}; "
              f"Triton kernel {triton_gm:.3f}, geometric mean of cuBLAS/ours over {len(cases)} cases)")
    else:
        print(f"ONE-LINE CHANGE: gemm_ws.py DEFAULT_WS = {best}   # cuBLAS/ours {gm[best]:.3f} vs DEFAULT_WS "
              f"{gm.get(current, float('nan')):.3f}, Triton kernel {triton_gm:.3f} (geometric mean, {len(cases)} cases)")


def layer_row(layer: str, m: int, n: int, k: int, segments: int | None, op_ms: float, flinear_ms: float) -> dict:
    """One ``--set layers`` row: ops.linear as the model calls it vs F.linear (times in ms)."""
    return {"kind": "layer", "layer": layer, "M": m, "N": n, "K": k, "k_segments": segments or 1,
            "op_ms": round(op_ms, 4), "flinear_ms": round(flinear_ms, 4),
            "op_vs_flinear": round(flinear_ms / op_ms, 3)}


def layer_case(layer: str, m: int, n: int, k: int, segments: int | None) -> dict:
    import torch.nn.functional as F
    from rlalign import ops
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    w_sets = rotating(lambda i: torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16), n * k * 2)
    x_sets = [torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16) for _ in range(len(w_sets))]
    sets = list(zip(x_sets, w_sets))
    t_op = timed(lambda x, w: ops.linear(x, w, k_segments=segments), sets)
    t_flinear = timed(lambda x, w: F.linear(x, w), sets)
    del w_sets, x_sets, sets
    torch.cuda.empty_cache()
    return layer_row(layer, m, n, k, segments, t_op, t_flinear)


def target(row: dict) -> float | None:
    """The speed target (cuBLAS time / ours) for this row: >= 0.95 at M >= 4,096, >= 0.90 at M >= 1,024 and at decode
    rows M <= 64 (None where none is set)."""
    if row.get("sweep") or row["k_segments"] != 1 or row.get("kind") == "layer":
        return None
    if row["M"] >= 4096:
        return 0.95
    if row["M"] >= 1024 or row["M"] <= 64:
        return 0.90
    return None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="strict linear vs cuBLAS on Qwen3-8B shapes (H200)")
    ap.add_argument("--out")
    ap.add_argument("--set", default="all", choices=("all", "kernel", "layers", "segsweep", "segments"),
                    help="kernel: the strict kernel and the op per shape (+ k_segments=8), no tile sweep; "
                         "layers: a Qwen3-8B layer's linears through ops.linear vs F.linear; all: both + the sweep; "
                         "segsweep: only the canonical-partition (k_segments=8) tile/structure sweep")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    ap.add_argument("--sweep-small", action="store_true",
                    help="only the decode-size K-partition split: candidate SegmentSplitConfigs at M in "
                         + "/".join(map(str, SMALL_M)) + " on the 8B/0.6B o_proj/down_proj shapes, graph replays, "
                         "each checked bitwise against the default")
    ap.add_argument("--sweep-mid", action="store_true",
                    help="only the K partition at decode batches M in " + "/".join(map(str, MID_M)) + ": the "
                         "dispatcher's one-kernel tree vs the forced split into per-segment partials (bits checked), "
                         "graph replays vs cuBLAS on the 8B/0.6B o_proj/down_proj shapes")
    ap.add_argument("--sweep-kpart", action="store_true",
                    help="only the large-M K partition: gemm.KPART_CANDIDATES at M in " + "/".join(map(str, KPART_M))
                         + " on the 8B o_proj/down_proj shapes (= the column-parallel dX shapes), graph replays vs "
                         "cuBLAS, each refused unless bit-equal to the default; + the P = 1 dX/dW the trainer runs")
    ap.add_argument("--sweep-ws", action="store_true",
                    help="only the warp-specialized Gluon kernel: gemm_ws.WS_CANDIDATES at M in "
                         + "/".join(map(str, WS_M)) + " on the 8B o_proj/down_proj (k_segments 8; --ws-shapes for "
                         "others) vs the Triton kernel and cuBLAS, graph replays, each refused unless bit-equal")
    ap.add_argument("--ws-candidates", metavar="I,J,...",
                    help="with --sweep-ws: only these indices of gemm_ws.WS_CANDIDATES (default: all)")
    ap.add_argument("--ws-deep-ring", action="store_true",
                    help="with --sweep-ws: also gemm_ws.DEEP_RING_WS (160 KiB rings; with --ws-shapes 8b-p4 only: they "
                         "do not fit beside P = 8's two tree levels)")
    ap.add_argument("--ws-triton", action="store_true",
                    help="with --sweep-ws: also the Triton kernel's tiles TRITON_PLAIN_CANDIDATES (P = 1 shapes)")
    ap.add_argument("--ws-small", action="store_true",
                    help="with --sweep-ws: also the Triton kernel's decode-size tiles gemm.SMALL_M_TILES + TRITON_SMALL_EXTRA (P = 1 "
                         "shapes, M <= 64: wider k-steps, 16/32-row mma.sync tiles)")
    ap.add_argument("--ws-stop-after", type=float, default=None, metavar="S",
                    help=f"with --sweep-ws: skip the cases left after S seconds (default {WS_STOP_AFTER_S})")
    ap.add_argument("--ws-shapes", default="8b", metavar="S,...",
                    help="with --sweep-ws: model shapes, comma-separated from " + "/".join(WS_SHAPES) + " (default 8b)")
    ap.add_argument("--ws-m", metavar="M,...",
                    help="with --sweep-ws: row counts (default " + ",".join(map(str, WS_M)) + ")")
    return ap


def main() -> int:
    args = parser().parse_args()
    if (args.ws_candidates is not None or args.ws_m is not None or args.ws_shapes != "8b" or args.ws_triton
            or args.ws_deep_ring or args.ws_small or args.ws_stop_after is not None) and not args.sweep_ws:
        print("gpu_linear: --ws-candidates / --ws-shapes / --ws-m / --ws-triton / --ws-small / --ws-deep-ring / "
              "--ws-stop-after only apply to --sweep-ws")
        return 2
    if args.ws_stop_after is not None and not args.ws_stop_after > 0:
        print(f"gpu_linear: --ws-stop-after {args.ws_stop_after}: seconds, > 0")
        return 2
    shapes = tuple(args.ws_shapes.split(","))
    if not set(shapes) <= set(WS_SHAPES):
        print(f"gpu_linear: --ws-shapes {args.ws_shapes!r}: choose from {', '.join(WS_SHAPES)}")
        return 2
    if args.ws_deep_ring and set(shapes) != {"8b-p4"}:
        print("gpu_linear: --ws-deep-ring needs --ws-shapes 8b-p4 (its rings do not fit beside P = 8's two levels)")
        return 2
    ws_m = WS_M if args.ws_m is None else positive_ints(args.ws_m)
    if ws_m is None:
        print(f"gpu_linear: --ws-m {args.ws_m!r}: comma-separated row counts, each >= 1")
        return 2
    if not torch.cuda.is_available():
        print("gpu_linear: no CUDA device")
        return 1
    import rlalign.ops.triton_backend  # noqa: F401  (fail loudly if the backend cannot load)
    from rlalign.ops.triton_backend.gemm import GemmConfig
    if args.sweep_small:
        return run_sweep(args.out, "linear_sweep_small", sweep_small, print_small)
    if args.sweep_ws:
        candidates = ws_candidates(args.ws_candidates)
        if args.ws_triton:
            candidates += tuple(GemmConfig(**kw) for kw in TRITON_PLAIN_CANDIDATES)
        if args.ws_small:
            candidates += small_candidates_ws()
        if args.ws_deep_ring:
            from rlalign.ops.triton_backend.gemm_ws import DEEP_RING_WS
            candidates += DEEP_RING_WS
        stop = args.ws_stop_after or WS_STOP_AFTER_S
        return run_sweep(args.out, "linear_sweep_ws", lambda: sweep_ws(candidates, shapes, ws_m, stop), print_ws)
    if args.sweep_kpart:
        return run_sweep(args.out, "linear_sweep_kpart", sweep_kpart, print_kpart)
    if args.sweep_mid:
        return run_sweep(args.out, "linear_sweep_mid", sweep_mid, print_mid)
    rows = []
    plan = [(m, n, k, None, None, False) for (n, k) in SHAPES for m in M_VALUES]
    plan += [(m, n, k, 8, None, False) for (n, k) in SEGMENT_SHAPES for m in SEGMENT_M]
    layers = [(name, m, n, k, seg) for (name, n, k, seg) in MODEL_LAYERS for m in M_VALUES]
    sweep = [GemmConfig(128, 256, 8, 3, flatten=True), GemmConfig(128, 256, 8, 3, flatten=False),
             GemmConfig(128, 256, 8, 4, flatten=True), GemmConfig(128, 128, 8, 4, flatten=True),
             GemmConfig(128, 128, 8, 3, flatten=False)]
    plan += [(4096, n, k, None, c, True) for (n, k) in ((4096, 4096), (12288, 4096)) for c in sweep]
    seg_sweep = [GemmConfig(128, 64, 8, 4), GemmConfig(128, 64, 8, 3), GemmConfig(128, 64, 8, 6),
                 GemmConfig(128, 128, 8, 4, reg_levels=1), GemmConfig(64, 64, 4, 5),
               GemmConfig(128, 64, 8, 4, nested=True), GemmConfig(128, 128, 8, 3, nested=True),
               GemmConfig(128, 128, 8, 4, reg_levels=1, nested=True), GemmConfig(64, 64, 4, 5, nested=True),
               GemmConfig(128, 128, 8, 3, reg_levels=1, nested=True), GemmConfig(128, 128, 8, 5, reg_levels=1, nested=True),
               GemmConfig(128, 128, 8, 4, reg_levels=0, nested=True), GemmConfig(128, 256, 8, 3, reg_levels=0, nested=True),
               GemmConfig(128, 256, 8, 3, reg_levels=1, nested=True), GemmConfig(128, 128, 4, 4, reg_levels=0, nested=True)]
    plan += [(4096, 4096, 12288, 8, c, True) for c in seg_sweep]
    plan += [(4096, 4096, 4096, 8, c, True) for c in seg_sweep if c.nested]
    if args.set == "segsweep":
        plan, layers = [p for p in plan if p[3] == 8], []
    if args.set == "segments":   # the K-partition shapes as the op launches them, no sweep
        plan, layers = [p for p in plan if p[3] == 8 and not p[5]], []
    if args.set == "kernel":   # per-shape kernel + op rows, no sweep, no model layers
        plan, layers = [p for p in plan if not p[5]], []
    elif args.set == "layers":
        plan = []
    if args.quick:
        plan, layers = plan[:4], layers[:4]
    t0 = time.time()
    for name, m, n, k, seg in layers:
        try:
            row = layer_case(name, m, n, k, seg)
        except Exception as exc:  # report and go on
            row = {"kind": "layer", "layer": name, "M": m, "N": n, "K": k, "k_segments": seg or 1,
                   "error": repr(exc)[:300]}
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
    for m, n, k, seg, cfg, is_sweep in plan:
        try:
            row = case(m, n, k, seg, cfg)
        except Exception as exc:  # report and go on
            row = {"M": m, "N": n, "K": k, "k_segments": seg or 1, "error": repr(exc)[:300]}
            traceback.print_exc()
        row["kind"], row["sweep"] = "shape", is_sweep
        row["target"] = target(row) if "error" not in row else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(args.out, "linear", rows, t0)
    print(f"{'M':>6} {'N':>7} {'K':>6} {'seg':>3} {'config':>22} {'strict TF':>9} {'cuBLAS TF':>9} {'ratio':>6} "
          f"{'op ratio':>8} {'graph':>6} {'graph op':>8} target")
    for r in rows:
        if "error" in r:
            print(f"{r['M']:>6} {r['N']:>7} {r['K']:>6} {r['k_segments']:>3} ERROR {r['error'][:60]}")
            continue
        if r["kind"] == "layer":
            print(f"{r['M']:>6} {r['N']:>7} {r['K']:>6} {r['k_segments']:>3} {r['layer']:>22} "
                  f"ops.linear {r['op_ms']} ms, F.linear {r['flinear_ms']} ms -> {r['op_vs_flinear']}")
            continue
        print(f"{r['M']:>6} {r['N']:>7} {r['K']:>6} {r['k_segments']:>3} {r['config']:>22} "
              f"{r['strict_tflops']:>9} {r['cublas_tflops']:>9} {r['ratio']:>6} {r.get('op_ratio', '-'):>8} "
              f"{r.get('graph_ratio', '-'):>6} {r.get('graph_op_ratio', '-'):>8} "
              f"{'sweep' if r['sweep'] else (r['target'] or '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
