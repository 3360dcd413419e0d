"""GEMM census of the strict training step: every GEMM launch of one step, each distinct one timed against cuBLAS.

    python benchmarks/gemm_census.py --device cuda --layers 6 --out DIR      # the H200 census (<= ~150 s)
    python benchmarks/gemm_census.py --shape tiny --device cpu --json        # CPU smoke: the census only, no timing

1. Census: benchmarks/train_step.py's strict step (its model, batch and step, imported) runs once more inside
   ``rlalign.ops.gemm_census.collecting``: each launch of the strict GEMM (``gemm.gemm``: Triton ``gemm_kernel`` /
   ``segment_stream_kernel``, the decode-size split, the Gluon ``gemm_ws``) and of the fused log-prob's GEMM
   kernels (``lp_stats_kernel``, ``lp_grad_logits_kernel``) is recorded with its role (weight name; fwd / dX / dW /
   db, lm_stats / lm_grad_logits / lm_dX / lm_dW), M, N, K, stored layouts and strides, dtypes, k_segments, acc_in
   and the launch configuration the dispatcher chose. On the CPU the step's linear and fused log-prob run the
   Triton kernels under the interpreter (fp32; the other ops on the torch backend), so the census is the CUDA
   dispatcher's logic on CPU-sized shapes (fp32 candidate lists; the Gluon kernel is never picked there).
2. Rows: calls deduplicated by launch (entry, kernel, config, shape, strides, dtypes, options), with a count. On
   CUDA each row is timed in isolation through the entry the trainer called (``gemm`` with the same arguments, or
   ``logprob.launch_stats`` / ``launch_grad_logits``), and the cuBLAS equivalent of the same math in the same
   stored layout (``matmul`` of the same transposed views; ``addmm`` with a bias; ``out += matmul`` for acc_in; the
   bf16 ``[T, V]`` logits ``h @ W^T`` for the lp kernels, which fuse softmax statistics / dz on top). Both as CUDA
   graph replays over rotating input copies (benchmarks/gpu_linear.py's ``rotating``: >= 512 MiB, so L2 does not hold
   the operands): one replay runs every copy once; ms = replay / copies (kernel time, no host launch cost; a row
   whose capture fails is timed eagerly, cycling the copies, and its "timing" field says so). A row whose replay
   launches another config than the census recorded is reported as an error, not timed.
   Per row: count, ms each (ours, cuBLAS), total ms, TFLOP/s, ratio = cuBLAS ms / ours (< 1: slower than cuBLAS),
   share of the step's summed GEMM time (over the timed rows), and ms lost = count x (ours - cuBLAS). Rows print
   sorted by ms lost.
   Rows are timed largest (count x FLOPs) first; past ``--budget-s`` seconds since the start none is started.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

T0 = time.time()
# the ops the census routes to the Triton kernels on the CPU (under the interpreter)
GEMM_OPS = ("linear", "linear_group", "logprob_entropy")


def progress(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


# ---- census ------------------------------------------------------------------------------------------

def route_gemms_to_interpreter() -> None:
    """CPU: the step's linear and fused log-prob run the Triton backend's kernels under the interpreter (its
    package registers nothing without CUDA), every other op its torch backend (RLALIGN_TRITON_DISABLE). Must run
    before torch / triton are imported (TRITON_INTERPRET is read at import)."""
    os.environ["TRITON_INTERPRET"] = "1"
    from tests.ops.test_triton_interpret import _patch_interpreter
    _patch_interpreter()
    from rlalign.ops._dispatch import refresh_env
    from rlalign.ops._registry import IMPLEMENTATIONS, register
    from rlalign.ops.triton_backend import linear, logprob
    register("linear", "triton")(linear.linear)
    register("linear_group", "triton")(linear.linear_group)
    register("logprob_entropy", "triton")(logprob.logprob_entropy)
    others = sorted({op for op, backend in IMPLEMENTATIONS if backend == "torch"} - set(GEMM_OPS))
    os.environ["RLALIGN_BACKEND"] = "triton"
    os.environ["RLALIGN_TRITON_DISABLE"] = ",".join(others)
    refresh_env()


def step_args(args) -> argparse.Namespace:
    """benchmarks/train_step.py's arguments for the same workload (its defaults per shape)."""
    import train_step
    argv = [f"--shape={args.shape}", f"--device={args.device}", f"--dtype={args.dtype}", f"--seed={args.seed}",
            "--variants=strict"]
    argv += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("layers", "tokens", "mean_seq")
             if getattr(args, k) is not None]
    return train_step.parse_args(argv)


def collect(args):
    """-> (the calls of one strict step, train_step's args, its sequence lengths)."""
    import torch
    import train_step
    from rlalign.ops import gemm_census
    targs = step_args(args)
    lens = train_step.sequence_lengths(targs.tokens, targs.mean_seq, targs.seed)
    model, step = train_step._rlalign_step("strict", targs, lens)
    progress(f"model built: {targs.shape} x {targs.layers} layers, {sum(lens)} tokens in {len(lens)} sequences")
    if args.device == "cuda":
        step()                       # compiles every kernel outside the census
        torch.cuda.synchronize()
        progress("warm-up step done")
    with gemm_census.collecting(gemm_census.weight_names(model.named_parameters())) as census:
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    progress(f"census: {len(census.calls)} GEMM launches in one step")
    del model, step
    return census.calls, targs, lens


def role_label(call) -> tuple[str, int | None]:
    """(what, layer): 'self_attn.q_proj fwd', 3 from model.layers.3.self_attn.q_proj.weight; 'lm_head lm_dW', None."""
    name = call.weight.removesuffix(".weight").removesuffix(".bias")
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return f"{'.'.join(parts[3:])} {call.role}", int(parts[2])
    return f"{name or '?'} {call.role or '?'}", None


def dedupe(calls) -> list[dict]:
    """One row per distinct launch: its count and the roles (with their layers) it served."""
    groups: dict[tuple, list] = defaultdict(list)
    for c in calls:
        groups[c.shape_key()].append(c)
    rows = []
    for calls_of in groups.values():
        roles: dict[str, list] = defaultdict(list)
        for c in calls_of:
            what, layer = role_label(c)
            roles[what].append(layer)
        c = calls_of[0]
        rows.append({"roles": "; ".join(_role_text(w, ls) for w, ls in roles.items()), "count": len(calls_of),
                     "entry": c.entry, "kernel": c.kernel, "config": c.config, "m": c.m, "n": c.n, "k": c.k,
                     "a_trans": c.a_trans, "b_trans": c.b_trans, "a_strides": list(c.a_strides),
                     "b_strides": list(c.b_strides), "out_strides": list(c.out_strides), "dtype": c.dtype,
                     "out_dtype": c.out_dtype, "segments": c.segments, "acc_in": c.acc_in, "bias": c.bias,
                     "tma": c.tma, "options": dict(c.options), "gflop_each": c.flops / 1e9, "_call": c})
    rows.sort(key=lambda r: -r["count"] * r["gflop_each"])
    return rows


def _role_text(what: str, layers: list) -> str:
    known = sorted(x for x in layers if x is not None)
    if not known:
        return what if len(layers) == 1 else f"{what} x{len(layers)}"
    span = f"L{known[0]}" if len(set(known)) == 1 else f"L{known[0]}-{known[-1]}"
    return f"{what} {span}" + (f" x{len(layers)}" if len(layers) != len(set(known)) else "")


# ---- timing (CUDA) ---------------------------------------------------------------------------------------

def stored(rows: int, cols: int, row_stride: int, dtype, device, seed: int):
    """A [rows, cols] tensor with the given row stride (a view of a wider buffer when row_stride > cols)."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    buf = torch.randn((rows, max(row_stride, cols)), generator=gen, device=device, dtype=torch.float32)
    return buf.to(dtype)[:, :cols]


def gemm_operands(call, i: int, device):
    """(a, b, out, bias) laid out as the recorded call's (A [K, M] when a_trans, B [N, K] when b_trans)."""
    import torch
    dt, odt = getattr(torch, call.dtype), getattr(torch, call.out_dtype)
    a = stored(*((call.k, call.m) if call.a_trans else (call.m, call.k)), call.a_strides[0], dt, device, 2 * i)
    b = stored(*((call.n, call.k) if call.b_trans else (call.k, call.n)), call.b_strides[0], dt, device, 2 * i + 1)
    out = stored(call.m, call.n, call.out_strides[0], odt, device, 7) if call.acc_in else \
        torch.empty((call.m, max(call.out_strides[0], call.n)), dtype=odt, device=device)[:, :call.n]
    bias = torch.zeros(call.n, dtype=dt, device=device) if call.bias else None
    return a, b, out, bias


def gemm_pair(call):
    """(ours, cublas, cublas_form): callables on one operand set for a ``gemm`` launch."""
    import torch
    from rlalign.ops.triton_backend.gemm import gemm

    def ours(a, b, out, bias):
        gemm(a, b, a_trans=call.a_trans, b_trans=call.b_trans, out=out, bias=bias, segments=call.segments,
             acc_in=call.acc_in)

    def cublas(a, b, out, bias):
        lhs, rhs = (a.T if call.a_trans else a), (b.T if call.b_trans else b)
        if call.acc_in:
            out.add_(torch.matmul(lhs, rhs))
        elif bias is not None:
            torch.addmm(bias, lhs, rhs)
        else:
            torch.matmul(lhs, rhs)
    lhs, rhs = ("a.T" if call.a_trans else "a"), ("b.T" if call.b_trans else "b")
    form = (f"out += matmul({lhs}, {rhs})" if call.acc_in else
            f"addmm(bias, {lhs}, {rhs})" if call.bias else f"matmul({lhs}, {rhs})")
    if call.out_dtype != call.dtype and not call.acc_in:
        form += f" ({call.dtype} out: cuBLAS writes the operand dtype)"
    return ours, cublas, form


def lp_operands(call, i: int, device):
    """(h, w, scratch...) for an lp kernel launch: h [T, H], w [V, H], targets in range, the kernel's buffers."""
    import torch
    import triton
    from rlalign.ops.triton_backend.logprob import VOCAB_TILE
    dt = getattr(torch, call.dtype)
    t, v = call.m, call.n
    h = stored(t, call.k, call.a_strides[0], dt, device, 2 * i)
    w = stored(v, call.k, call.b_strides[0], dt, device, 2 * i + 1)
    tgt = torch.randint(0, v, (t,), device=device, generator=torch.Generator(device=device).manual_seed(i))
    if call.entry == "lp_stats":
        planes = 3 if dict(call.options)["with_entropy"] else 2
        return h, w, tgt, torch.empty((planes, triton.cdiv(v, VOCAB_TILE), t), dtype=torch.float32, device=device), \
            torch.empty(t, dtype=torch.float32, device=device)
    vec = [torch.rand(t, dtype=torch.float32, device=device) for _ in range(4)]   # lse, mu, g_lp, g_ent
    dz = torch.empty((t, max(call.out_strides[0], v)), dtype=dt, device=device)[:, :v]
    return (h, w, tgt, *vec, dz)


def lp_pair(call):
    import torch
    from rlalign.ops.triton_backend import logprob
    opts = dict(call.options)
    if call.entry == "lp_stats":
        def ours(h, w, tgt, stats, zt):
            logprob.launch_stats(h, w, tgt, stats, zt, opts["temperature"], opts["with_entropy"])
    else:
        def ours(h, w, tgt, lse, mu, g_lp, g_ent, dz):
            logprob.launch_grad_logits(h, w, tgt, lse, mu, g_lp, g_ent, dz, 0, opts["temperature"], opts["has_ent"])

    def cublas(h, w, *_):
        torch.matmul(h, w.T)
    return ours, cublas, "matmul(h, w.T) (bf16 [T, V] logits; ours also fuses the softmax statistics / dz)"


def check_launch(call, ours, one_set) -> str | None:
    """The replay's launch must be the census's (same entry, kernel and config): None, or what differs."""
    from rlalign.ops import gemm_census
    with gemm_census.collecting() as census:
        ours(*one_set)
    got = [(c.entry, c.kernel, c.config) for c in census.calls]
    want = [(call.entry, call.kernel, call.config)]
    return None if got == want else f"replay launched {got}, the step {want}"


def operand_bytes(call) -> int:
    """Bytes of one set's A and B (what the rotation must keep out of L2)."""
    a_rows = call.k if call.a_trans else call.m
    b_rows = call.n if call.b_trans else call.k
    size = 4 if call.dtype == "float32" else 2
    return size * (a_rows * call.a_strides[0] + b_rows * call.b_strides[0])


def time_row(row: dict, device) -> None:
    import torch
    from gpu_linear import rotating
    from rlalign.bench.cuda_timing import replay_ms_per_set
    call = row["_call"]
    lp = call.entry != "gemm"
    ours, cublas, form = lp_pair(call) if lp else gemm_pair(call)
    make = (lambda i: lp_operands(call, i, device)) if lp else (lambda i: gemm_operands(call, i, device))
    sets = rotating(make, operand_bytes(call))
    row.update(cublas_form=form, copies=len(sets))
    bad = check_launch(call, ours, sets[0])
    if bad:
        row["error"] = bad
        return
    try:
        row["ours_ms"], row["cublas_ms"] = replay_ms_per_set(ours, sets), replay_ms_per_set(cublas, sets)
        row["timing"] = "graph"
    except Exception as exc:  # noqa: BLE001 - said in the row: timed eagerly instead
        from gpu_linear import timed
        torch.cuda.synchronize()
        row["timing"] = f"eager (graph capture failed: {type(exc).__name__}: {str(exc)[:120]})"
        row["ours_ms"], row["cublas_ms"] = timed(ours, sets), timed(cublas, sets)
    del sets
    torch.cuda.empty_cache()


def finish_rows(rows: list[dict]) -> float:
    """Derived columns of the timed rows; -> the step's summed GEMM ms (ours, timed rows)."""
    timed = [r for r in rows if "ours_ms" in r]
    total = sum(r["count"] * r["ours_ms"] for r in timed)
    for r in timed:
        r["total_ms"] = r["count"] * r["ours_ms"]
        r["tflops"] = r["gflop_each"] / r["ours_ms"]
        r["cublas_tflops"] = r["gflop_each"] / r["cublas_ms"]
        r["ratio"] = r["cublas_ms"] / r["ours_ms"]
        r["share"] = r["total_ms"] / total if total else None
        r["ms_lost"] = r["count"] * (r["ours_ms"] - r["cublas_ms"])
    rows.sort(key=lambda r: (-r.get("ms_lost", float("-inf")), -r["count"] * r["gflop_each"]))
    return total


# ---- report ----------------------------------------------------------------------------------------------

# fields left out of the table's config text where they hold these (the JSON keeps the full repr)
_DEFAULT_FIELDS = re.compile(r", (group_m=8|flatten=False|reg_levels=4|nested=False|stream=False|ctas_per_sm=1|"
                             r"merge_block=1024|merge_warps=4|group_m=16)(?=[,)])")


def short_config(config: str) -> str:
    return _DEFAULT_FIELDS.sub("", config)


def layout(r: dict) -> str:
    return f"{'At' if r['a_trans'] else 'A'}{'Bt' if r['b_trans'] else 'B'}"


_DT = {"bfloat16": "bf16", "float32": "fp32"}


def table(rows: list[dict], total_ms: float | None) -> str:
    head = (f"{'ms lost':>8} {'count':>5} {'ms each':>8} {'cuBLAS':>8} {'total':>8} {'TFLOP/s':>7} {'ratio':>5} "
            f"{'share':>5}  {'M':>6} {'N':>6} {'K':>6} lay P acc out   kernel / config   roles")
    lines = [head]
    for r in rows:
        if "ours_ms" in r:
            nums = (f"{r['ms_lost']:8.3f} {r['count']:5d} {r['ours_ms']:8.3f} {r['cublas_ms']:8.3f} "
                    f"{r['total_ms']:8.2f} {r['tflops']:7.0f} {r['ratio']:5.2f} {100 * r['share']:4.1f}%")
        else:
            nums = f"{'-':>8} {r['count']:5d} {r.get('error', r.get('skipped', 'not timed'))[:52]:<52}"
        lines.append(f"{nums}  {r['m']:6d} {r['n']:6d} {r['k']:6d} {layout(r):>4} {r['segments']} "
                     f"{'y' if r['acc_in'] else 'n':>3} {_DT[r['out_dtype']]:>4}  {r['kernel']} "
                     f"{short_config(r['config'])}  [{r['roles']}]")
    calls = sum(r["count"] for r in rows)
    gflop = sum(r["count"] * r["gflop_each"] for r in rows)
    foot = f"{calls} launches, {gflop / 1e3:.1f} TFLOP in {len(rows)} distinct rows"
    if total_ms:
        timed = [r for r in rows if "ours_ms" in r]
        cub = sum(r["count"] * r["cublas_ms"] for r in timed)
        tf = sum(r["count"] * r["gflop_each"] for r in timed)
        foot += (f"; timed rows: ours {total_ms:.1f} ms ({tf / total_ms:.0f} TFLOP/s), cuBLAS {cub:.1f} ms "
                 f"({tf / cub:.0f} TFLOP/s), lost {total_ms - cub:.1f} ms")
    return "\n".join(lines + [foot])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("qwen3-8b", "tiny"), default="qwen3-8b")
    p.add_argument("--quick", action="store_true", help="= --shape tiny (a smoke run; on the CPU it never times)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (train_step's default: 6; 2 tiny)")
    p.add_argument("--tokens", type=int, default=None, help="packed tokens (train_step's default: 8192; 256 tiny)")
    p.add_argument("--mean-seq", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="default bfloat16 on CUDA, float32 on the CPU (the interpreter mis-rounds bf16)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=110.0,
                   help="start timing no new row past this many seconds since the start (default 110)")
    p.add_argument("--no-time", action="store_true", help="the census only (CUDA too)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object instead of a table")
    p.add_argument("--out", help="directory for gemm_census.json (default: $OUT, else none)")
    args = p.parse_args(argv)
    if args.quick:
        args.shape = "tiny"
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.device == "cpu" and args.dtype != "float32":
        p.error("--device cpu runs the Triton kernels under the interpreter: fp32 only (--dtype float32)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        route_gemms_to_interpreter()
    import torch
    calls, targs, lens = collect(args)
    rows = dedupe(calls)
    total_ms = None
    if args.device == "cuda" and not args.no_time:
        torch.cuda.empty_cache()
        for i, r in enumerate(rows):
            if time.time() - T0 > args.budget_s:
                r["skipped"] = f"not timed: past --budget-s {args.budget_s:g}"
                continue
            try:
                time_row(r, torch.device("cuda"))
            except Exception as exc:  # noqa: BLE001 - a benchmark reports the row and goes on
                r["error"] = repr(exc)[:200]
            progress(f"row {i + 1}/{len(rows)} {r['roles'][:60]}: ours {_ms(r, 'ours_ms')}, "
                     f"cuBLAS {_ms(r, 'cublas_ms')} {r.get('error', '')[:80]}")
        total_ms = finish_rows(rows)
    else:
        for r in rows:
            r["skipped"] = "census only (timing needs CUDA)" if args.device == "cpu" else "census only (--no-time)"
    for r in rows:
        del r["_call"]
    result = {"name": "gemm_census", "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter, fp32)",
              "shape": {"shape": targs.shape, "layers": targs.layers, "dtype": targs.dtype, "tokens": sum(lens),
                        "sequences": len(lens)},
              "launches": len(calls), "step_gemm_ms": total_ms, "seconds": round(time.time() - T0, 1),
              "calls": [_call_dict(c) for c in calls], "rows": rows}
    out_dir = args.out or os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        Path(out_dir, "gemm_census.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else table(rows, total_ms))
    return 0 if all("error" not in r for r in rows) else 1


def _ms(row: dict, key: str) -> str:
    return f"{row[key]:.4f} ms" if key in row else "-"


def _call_dict(c) -> dict:
    import dataclasses
    d = dataclasses.asdict(c)
    d["options"] = dict(c.options)
    return d


if __name__ == "__main__":
    raise SystemExit(main())
