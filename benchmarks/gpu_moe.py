"""Benchmark: the MoE experts' FFN, strict grouped GEMMs vs the vendor paths, Qwen3-30B-A3B shapes (H200).

One MoE layer's experts as ``rlalign.models.moe`` calls them (stacked weights: gate/up [E, I, H], down [E, H, I];
``--lists`` adds rows with per-expert lists, the layout before 2026-12-01): hidden 2048, 128 experts, top-8,
moe_intermediate 768, bf16, T = 4,096 / 8,192 / 16,384 tokens routed by a random router (top-8 of
softmax over random logits: a realistic, uneven load). Through the public op
``ops.moe_experts(x, experts, gate, up, down, down_segments=4)`` (spec.MOE_K_SEGMENTS) (strict: the dispatch kernel
+ one gather + three grouped GEMMs + silu_mul + unpermute) against, in the same run and with the same routing:

* ``loop``: the same op in the native profile -- per expert, three cuBLAS GEMMs (F.linear), the
  vendor path a stock Qwen3-MoE module runs (it reads the expert counts on the host);
* ``grouped_mm``: torch's grouped GEMM (``torch._grouped_mm``, CUTLASS) on stacked weights with the
  same sort / silu / unpermute around it (where this torch build has it);

``vendor`` = the faster of the two; ``ratio`` = vendor time / strict time (>= 0.8 is the
target). Forward, and forward + backward (``--backward``). Also each grouped GEMM alone vs
``torch._grouped_mm`` on the same rows (kernel rows) and TFLOP/s (2 * rows * N * K per projection).
Each ffn row also profiles one strict call: ``strict_kernel_ms`` (its GPU kernel time), ``gpu_busy`` (that over
``strict_ms``: well below 1 means the call waits for host work), ``strict_kernels`` (GPU kernels launched by the
call: the dispatch kernel's 3, the gathers, the grouped GEMMs, silu_mul, checks; ``grouped_mm_kernels`` the same
for the vendor path) and ``kernel_families``.

    python benchmarks/gpu_moe.py [--out DIR] [--tokens 4096,8192,16384] [--backward] [--sweep] [--lists]

Writes bench_moe.json (+ .csv) to $OUT (or --out, default benchmarks/).
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

from rlalign.bench.args import positive_ints

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_linear import write  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768


def timed(fn) -> float:
    """Median ms (rlalign.bench.cuda_timing.bench_ms, shorter windows: the MoE rows are many)."""
    from rlalign.bench.cuda_timing import bench_ms
    return bench_ms(fn, warmup=10, rep=60)


def make_layer(seed: int = 0, stacked: bool = True):
    """gate, up [E, I, H] and down [E, H, I]: stacked tensors, the layout the models hold (since 2026-12-01) and pass
    to ops.moe_experts; ``stacked=False``: lists of per-expert tensors (the older layout, 3E autograd inputs)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def w(*shape, scale):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)
    gate = w(EXPERTS, INTER, HIDDEN, scale=HIDDEN ** -0.5)
    up = w(EXPERTS, INTER, HIDDEN, scale=HIDDEN ** -0.5)
    down = w(EXPERTS, HIDDEN, INTER, scale=INTER ** -0.5)
    if not stacked:
        return list(gate.unbind(0)), list(up.unbind(0)), list(down.unbind(0))
    return gate, up, down


def routing(tokens: int, seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
    return torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1).indices


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_mm_ffn(stacked, x, experts):
    """The vendor grouped GEMM path: sort rows by expert, torch._grouped_mm x3, silu, unpermute."""
    gate_t, up_t, down_t = stacked            # [E, K, N] views (column-major per expert)
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    rows = x.unsqueeze(1).expand(tokens, k, x.shape[1]).reshape(-1, x.shape[1]).index_select(0, order)
    offs = torch.cumsum(torch.bincount(flat, minlength=EXPERTS), 0).to(torch.int32)
    act = F.silu(torch._grouped_mm(rows, gate_t, offs=offs)) * torch._grouped_mm(rows, up_t, offs=offs)
    out = torch._grouped_mm(act, down_t, offs=offs)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return out.index_select(0, inverse).view(tokens, k, -1)


def stack_for_grouped_mm(gate, up, down):
    # torch._grouped_mm wants B as [E, K, N]; the transposed view of the stacked [E, N, K] weights
    return tuple((ws if isinstance(ws, torch.Tensor) else torch.stack(ws)).transpose(1, 2) for ws in (gate, up, down))


def ffn_case(tokens: int, backward: bool, stacked: bool = True) -> dict:
    from rlalign import ops
    from rlalign.contract import spec
    gate, up, down = make_layer(stacked=stacked)
    experts = routing(tokens)
    x = (torch.randn(tokens, HIDDEN, device="cuda") * 0.5).to(torch.bfloat16)
    row = {"kind": "ffn", "tokens": tokens, "rows": tokens * TOP_K, "backward": backward,
           "layout": "stacked" if stacked else "per-expert lists"}
    flops = 2.0 * tokens * TOP_K * 3 * HIDDEN * INTER * (3 if backward else 1)
    params = [gate, up, down] if stacked else [*gate, *up, *down]
    if backward:
        for p in params:
            p.requires_grad_()
        x.requires_grad_()
        grad = torch.randn(tokens, TOP_K, HIDDEN, device="cuda").to(torch.bfloat16)

    def one(fn, wrt):
        out = fn()
        if backward:
            torch.autograd.grad(out, [x, *wrt], grad, allow_unused=True)

    def run(fn, wrt=params):
        if not backward:
            with torch.no_grad():
                return timed(fn)
        return timed(lambda: one(fn, wrt))

    def run_once(fn, wrt=params):
        if not backward:
            with torch.no_grad():
                return one(fn, wrt)
        return one(fn, wrt)

    t_strict = run(lambda: ops.moe_experts(x, experts, gate, up, down, down_segments=spec.MOE_K_SEGMENTS))
    t_loop = run(lambda: ops.moe_experts(x, experts, gate, up, down, down_segments=spec.MOE_K_SEGMENTS,
                                         profile="native"))
    row.update(strict_ms=round(t_strict, 3), loop_ms=round(t_loop, 3))
    vendor = t_loop
    if grouped_mm_available():
        try:
            vendor_w = stack_for_grouped_mm(gate, up, down)
            if backward:   # (the strict rows' gradients stay those of gate, up and down)
                vendor_w = [w.detach().requires_grad_() for w in vendor_w]
            t_gmm = run(lambda: grouped_mm_ffn(vendor_w, x, experts), vendor_w)
            row["grouped_mm_ms"] = round(t_gmm, 3)
            vendor = min(vendor, t_gmm)
        except Exception as exc:  # report and go on
            row["grouped_mm_error"] = repr(exc)[:300]
    row.update(vendor_ms=round(vendor, 3), ratio=round(vendor / t_strict, 3),
               strict_tflops=round(flops / t_strict / 1e9, 1), vendor_tflops=round(flops / vendor / 1e9, 1))
    # the GPU kernel time of one strict call against its timed duration: near 1, the GPU is busy; well below,
    # the call waits for its host work (launches, autograd) -- what limits it, measured
    from rlalign.bench.kernel_profile import profile_breakdown
    kp = profile_breakdown(lambda: run_once(lambda: ops.moe_experts(x, experts, gate, up, down,
                                                                    down_segments=spec.MOE_K_SEGMENTS)), "cuda")
    row.update(strict_kernel_ms=kp["kernel_ms"], gpu_busy=round(kp["kernel_ms"] / t_strict, 3),
               strict_kernels=kp["kernel_calls"], kernel_families={k: v["ms"] for k, v in kp["families"].items()})
    if "grouped_mm_ms" in row:   # the vendor path's launches, for comparison
        row["grouped_mm_kernels"] = profile_breakdown(
            lambda: run_once(lambda: grouped_mm_ffn(vendor_w, x, experts), vendor_w), "cuda")["kernel_calls"]
    return row


def route_combine_case(tokens: int) -> dict:
    """Router logits + top-k routing + the combine (the parts a fused router/combine kernel would replace)
    against the whole strict sparse block, forward, through the public ops: what fusing them could save."""
    from rlalign import ops
    from rlalign.contract import spec
    gate, up, down = make_layer()
    g = torch.Generator(device="cuda").manual_seed(3)
    router = (torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g) * HIDDEN ** -0.5).to(torch.bfloat16)
    x = (torch.randn(tokens, HIDDEN, device="cuda") * 0.5).to(torch.bfloat16)

    def route():
        experts, weights = ops.moe_route(ops.router_logits(x, router), TOP_K, normalize=True)
        return experts, weights
    experts, weights = route()
    y = ops.moe_experts(x, experts, gate, up, down, down_segments=spec.MOE_K_SEGMENTS)

    def block():
        e, w = route()
        return ops.moe_combine(ops.moe_experts(x, e, gate, up, down, down_segments=spec.MOE_K_SEGMENTS), w, e)
    with torch.no_grad():
        t_route = timed(route)
        t_combine = timed(lambda: ops.moe_combine(y, weights, experts))
        t_block = timed(block)
    return {"kind": "route_combine", "tokens": tokens, "route_ms": round(t_route, 4), "combine_ms": round(t_combine, 4),
            "block_ms": round(t_block, 4), "route_combine_frac": round((t_route + t_combine) / t_block, 3)}


def kernel_cases(tokens: int) -> list[dict]:
    """Each grouped GEMM of the strict path alone vs torch._grouped_mm on the same sorted rows (the row-tile
    tables built once outside the timing, as ops.moe_experts' dispatch builds them once per layer; before
    2026-12-02 these rows rebuilt them in every timed call: ~18 small torch launches each)."""
    from rlalign.ops.triton_backend import grouped as G
    gate, up, down = make_layer()
    flat = routing(tokens).reshape(-1)
    order = torch.sort(flat, stable=True).indices
    e_of_row = flat.index_select(0, order)
    offsets = G.expert_offsets(e_of_row, EXPERTS)
    tables: dict = {}   # row-tile tables by tile height, built once (by the first, untimed call): kernel time only
    rows_n = flat.numel()
    out = []
    for name, ws, k, seg in (("gate/up", gate, HIDDEN, 1), ("down P=4", down, INTER, 4), ("down P=8", down, INTER, 8),
                             ("down P=1", down, INTER, 1)):
        x = (torch.randn(rows_n, k, device="cuda") * 0.5).to(torch.bfloat16)
        n = ws[0].shape[0]
        t = timed(lambda: G.grouped_rows(x, offsets, ws, segments=seg, slot_cache=tables))
        row = {"kind": "kernel", "tokens": tokens, "proj": name, "rows": rows_n, "N": n, "K": k,
               "strict_ms": round(t, 4), "strict_tflops": round(2.0 * rows_n * n * k / t / 1e9, 1)}
        if grouped_mm_available():
            try:
                b = ws.transpose(1, 2)
                offs = offsets[1:].to(torch.int32)
                tg = timed(lambda: torch._grouped_mm(x, b, offs=offs))
                row.update(grouped_mm_ms=round(tg, 4), ratio=round(tg / t, 3))
            except Exception as exc:
                row["grouped_mm_error"] = repr(exc)[:300]
        if seg == 1 and name == "gate/up":
            row["no_tma_ms"] = round(timed(lambda: G.grouped_rows(x, offsets, ws, segments=seg, use_tma=False,
                                                                    slot_cache=tables)), 4)
        out.append(row)
    return out


ROWS_SWEEP = ((64, 64, 4, 5), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 4, 3), (64, 128, 4, 4),
              (128, 128, 4, 3))
REDUCE_SWEEP = ((64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 4, 3),
                (128, 64, 4, 4), (128, 128, 4, 3))


def vendor_time(layouts, offs, row) -> float | None:
    """torch._grouped_mm's time on the first operand layout it accepts (layouts prepared outside the timing)."""
    errors = []
    for a, b in layouts:
        try:
            return timed(lambda: torch._grouped_mm(a, b, offs=offs))
        except Exception as exc:
            errors.append(repr(exc)[:120])
    row["grouped_mm_error"] = " | ".join(errors)
    return None


def backward_cases(tokens: int, sweep: bool) -> list[dict]:
    """The backward's kernels alone (dX: grouped rows against W_e untransposed; dW: the grouped reduction)
    vs torch._grouped_mm on the same sorted rows; with ``sweep``, every dW tile shape."""
    from rlalign.ops.triton_backend import grouped as G
    gate, up, down = make_layer()
    flat = routing(tokens).reshape(-1)
    e_of_row = torch.sort(flat, stable=True).values
    offsets = G.expert_offsets(e_of_row, EXPERTS)
    tables: dict = {}   # row-tile tables by tile height, built once (by the first, untimed call): kernel time only
    offs32 = offsets[1:].to(torch.int32)
    rows_n = flat.numel()
    out = []
    for name, ws in (("gate", gate), ("down", down)):
        n, k = ws[0].shape                      # forward: [R, K] -> [R, N]
        g = (torch.randn(rows_n, n, device="cuda") * 0.5).to(torch.bfloat16)
        x = (torch.randn(rows_n, k, device="cuda") * 0.5).to(torch.bfloat16)
        stacked = ws                             # [E, N, K]: dX = G @ W_e
        t = timed(lambda: G.grouped_rows(g, offsets, ws, transpose_w=False, slot_cache=tables))
        row = {"kind": "dX", "tokens": tokens, "proj": name, "config": "default", "strict_ms": round(t, 4)}
        tg = vendor_time([(g, stacked), (g, stacked.transpose(1, 2).contiguous().transpose(1, 2))], offs32, row)
        if tg:
            row.update(grouped_mm_ms=round(tg, 4), ratio=round(tg / t, 3))
        out.append(row)
        for shape in (ROWS_SWEEP if sweep else ()):
            cfg = G.GroupedConfig(*shape)
            t = timed(lambda: G.grouped_rows(g, offsets, ws, transpose_w=False, config=cfg, slot_cache=tables))
            out.append({"kind": "dX", "tokens": tokens, "proj": name, "config": "{}x{}/w{}/s{}".format(*shape),
                        "strict_ms": round(t, 4)})
        configs = [None] + ([G.GroupedConfig(*c) for c in REDUCE_SWEEP] if sweep else [])
        for cfg in configs:
            label = "default" if cfg is None else f"{cfg.block_m}x{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}"
            try:
                t = timed(lambda: G.grouped_weight_grad(g, x, offsets, EXPERTS, torch.bfloat16, config=cfg))
                row = {"kind": "dW", "tokens": tokens, "proj": name, "config": label, "strict_ms": round(t, 4),
                       "strict_tflops": round(2.0 * rows_n * n * k / t / 1e9, 1)}
            except Exception as exc:
                row = {"kind": "dW", "tokens": tokens, "proj": name, "config": label, "error": repr(exc)[:200]}
            # no vendor dW row: torch._grouped_mm's 2-D x 2-D form (the reduction grouped) asserts on the
            # device when a group's row count is not a multiple of 8, which kills the process (H200, torch 2.11)
            out.append(row)
    return out


SWEEP = {1: ROWS_SWEEP,
         4: ((128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (128, 128, 8, 3, True), (128, 64, 8, 4, True),
             (64, 64, 4, 4, True), (64, 128, 4, 4, True)),
         8: ((128, 64, 8, 4), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 8, 3), (64, 32, 4, 6))}


def sweep_cases(tokens: int) -> list[dict]:
    """Tile shapes of the grouped GEMM at one load (every tile gives the same bits: which is fastest)."""
    from rlalign.ops.triton_backend import grouped as G
    gate, up, down = make_layer()
    flat = routing(tokens).reshape(-1)
    e_of_row = torch.sort(flat, stable=True).values
    offsets = G.expert_offsets(e_of_row, EXPERTS)
    tables: dict = {}   # row-tile tables by tile height, built once (by the first, untimed call): kernel time only
    out = []
    for name, ws, k, seg in (("gate/up", gate, HIDDEN, 1), ("down P=4", down, INTER, 4)):
        x = (torch.randn(flat.numel(), k, device="cuda") * 0.5).to(torch.bfloat16)
        for shape in SWEEP[seg]:
            cfg = G.GroupedConfig(*shape)
            bm, bn, warps, stages = shape[:4]
            try:
                t = timed(lambda: G.grouped_rows(x, offsets, ws, segments=seg, config=cfg, slot_cache=tables))
                row = {"kind": "sweep", "tokens": tokens, "proj": name, "config": f"{bm}x{bn}/w{warps}/s{stages}" + ("/nested" if cfg.nested else ""),
                       "strict_ms": round(t, 4), "strict_tflops": round(2.0 * flat.numel() * ws[0].shape[0] * k / t / 1e9, 1)}
            except Exception as exc:
                row = {"kind": "sweep", "tokens": tokens, "proj": name, "config": f"{bm}x{bn}/w{warps}/s{stages}",
                       "error": repr(exc)[:200]}
            out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description="MoE experts: strict grouped GEMMs vs vendor (H200)")
    ap.add_argument("--out")
    ap.add_argument("--tokens", default="4096,8192,16384")
    ap.add_argument("--backward", action="store_true", help="also time forward + backward")
    ap.add_argument("--sweep", action="store_true", help="also time every tile shape of the grouped GEMM")
    ap.add_argument("--lists", action="store_true",
                    help="also time the experts passed as per-expert lists (the layout before stacked experts)")
    args = ap.parse_args()
    token_counts = positive_ints(args.tokens)
    if token_counts is None:
        ap.error(f"--tokens {args.tokens!r}: comma-separated token counts, each >= 1")
    if not torch.cuda.is_available():
        print("gpu_moe: no CUDA device")
        return 1
    import rlalign.ops.triton_backend  # noqa: F401
    t0, rows = time.time(), []
    for tokens in token_counts:
        for fn in [lambda: [ffn_case(tokens, False)], lambda: kernel_cases(tokens), lambda: [route_combine_case(tokens)]] + \
                  ([lambda: [ffn_case(tokens, True)], lambda: backward_cases(tokens, args.sweep)]
                   if args.backward else []) + \
                  ([lambda: [ffn_case(tokens, False, stacked=False)]] +
                   ([lambda: [ffn_case(tokens, True, stacked=False)]] if args.backward else []) if args.lists else []) + \
                  ([lambda: sweep_cases(tokens)] if args.sweep else []):
            try:
                new = fn()
            except Exception as exc:  # report and go on
                traceback.print_exc()
                new = [{"tokens": tokens, "error": repr(exc)[:300]}]
            for r in new:
                rows.append(r)
                print(json.dumps(r), flush=True)
            torch.cuda.empty_cache()
    write(args.out, "moe", rows, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
