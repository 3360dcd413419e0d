"""Benchmark: the compiled CPU kernels vs the torch formulation they replace, same run, same bits.

Shapes of the embedded default model's decode step (512 sequences, hidden 128, 4/2 heads of 32,
intermediate 384, contexts of 8-48 keys), one sequence (the few-rows GEMM) and a training step's packed
attention backward. For each case: the
median of 7 timings (each a loop of calls) of the compiled path and of the formulation, their ratio,
and whether their outputs have the same bits (they must: the script exits 1 otherwise).

    python benchmarks/cpu_kernels.py [--json] [--out FILE]

Prints a table (or one JSON object) with machine, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rlalign.contract.bits import bits_equal  # noqa: E402
from rlalign.ops.torch_backend.attention import compiled as attention_compiled, formula as attention_formula  # noqa: E402
from rlalign.ops.torch_backend.attention import compiled_backward  # noqa: E402
from rlalign.ops.torch_backend.attention.backward import varlen_backward  # noqa: E402
from rlalign.ops.torch_backend import clib, elementwise, linear, norm, primitives  # noqa: E402


def _time(fn, calls: int) -> float:
    fn()
    samples = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def _decode_attention_case(gen):
    s, hkv, g, d, ps = 512, 2, 2, 32, 16
    ctx = torch.randint(8, 49, (s,), generator=gen)
    pages_per = 4
    table = torch.randperm(s * pages_per, generator=gen).view(s, pages_per).int()
    kc = torch.randn(s * pages_per, ps, hkv, d, generator=gen)
    vc = torch.randn(s * pages_per, ps, hkv, d, generator=gen)
    q = torch.randn(s, hkv * g, d, generator=gen)
    cu = torch.arange(s + 1, dtype=torch.int32)
    return q, kc, vc, table, ctx.int(), cu, d ** -0.5


def _varlen_backward_case(gen):
    """A training step's packed batch of the default run: 256 sequences of 6-15 tokens, 4/2 heads of 32."""
    lens = torch.randint(6, 16, (256,), generator=gen).tolist()
    t, hq, hkv, d = sum(lens), 4, 2, 32
    q, dout, out = (torch.randn(t, hq, d, generator=gen) for _ in range(3))
    k, v = (torch.randn(t, hkv, d, generator=gen) for _ in range(2))
    lse = torch.randn(t, hq, generator=gen) + 3.0
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, out, lse, cu, dout, d ** -0.5


def _grads(result) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in result[:3]])


def cases(gen):
    x, x_mlp = torch.randn(512, 128, generator=gen), torch.randn(512, 384, generator=gen)
    w_o, w_down, w_up = torch.randn(128, 128, generator=gen), torch.randn(128, 384, generator=gen), \
        torch.randn(384, 128, generator=gen)
    x1 = torch.randn(1, 128, generator=gen)
    w_n = torch.randn(128, generator=gen)
    q = torch.randn(512, 4, 32, generator=gen)
    cos, sin = torch.randn(512, 16, generator=gen), torch.randn(512, 16, generator=gen)
    gate, up = torch.randn(512, 384, generator=gen), torch.randn(512, 384, generator=gen)
    paged = _decode_attention_case(gen)
    partials = torch.randn(8, 512, 128, generator=gen)
    bwd = _varlen_backward_case(gen)
    return [
        ("attention varlen backward, 256 seqs of 6-15 tokens",
         lambda: _grads(varlen_backward(*bwd, bucket_route=compiled_backward.bucket_compiled)),
         lambda: _grads(varlen_backward(*bwd)), 10),
        ("attention_paged decode, 512 seqs x 4 heads, ctx 8-48", lambda: attention_compiled.paged_compiled(*paged),
         lambda: attention_formula.paged_formula(*paged), 20),
        ("linear o_proj 512x128 -> 128, 8 K segments", lambda: linear.linear_fp32(x, w_o, 8),
         lambda: linear._blocks(x, w_o, 8), 50),
        ("linear down_proj 512x384 -> 128, 8 K segments", lambda: linear.linear_fp32(x_mlp, w_down, 8),
         lambda: linear._blocks(x_mlp, w_down, 8), 30),
        ("linear 1 row 128 -> 384 (few-rows GEMM)", lambda: linear.linear_fp32(x1, w_up, None),
         lambda: linear._blocks(x1, w_up, 1), 200),
        ("rms_norm 512 x 128", lambda: norm.compiled_rms_norm(x, w_n, 1e-6),
         lambda: norm.rms_norm_formula(x, w_n, 1e-6),
         200),
        ("rope 512 x 4 x 32", lambda: elementwise.rope(q, cos, sin), lambda: elementwise.rope_formula(q, cos, sin),
         200),
        ("silu_mul 512 x 384", lambda: elementwise.silu_mul(gate, up), lambda: elementwise.silu_mul_formula(gate, up),
         200),
        ("tree_merge 8 x 512 x 128", lambda: primitives.tree_merge_compiled(partials),
         lambda: primitives.tree_merge(list(partials.unbind(0))), 100),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the JSON to this file")
    args = p.parse_args()
    if clib.library() is None:
        print("the CPU kernels could not be built here (no C compiler?)", file=sys.stderr)
        return 1
    rows, ok = [], True
    with torch.no_grad():
        for name, compiled, formula, calls in cases(torch.Generator().manual_seed(0)):
            a, b = compiled(), formula()
            same = bits_equal(a, b)
            ok &= same
            tc, tf = _time(compiled, calls), _time(formula, calls)
            rows.append({"case": name, "compiled_us": round(tc * 1e6, 1), "formulation_us": round(tf * 1e6, 1),
                         "speedup": round(tf / tc, 2), "same_bits": same})
    result = {"name": "cpu_kernels", "rows": rows,
              "environment": {"torch": torch.__version__, "python": platform.python_version(),
                              "threads": torch.get_num_threads(), "machine": platform.machine(),
                              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                              "date": datetime.date.today().isoformat()}}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'case':<56}{'compiled us':>13}{'formulation us':>16}{'speedup':>9}  same bits")
        for r in rows:
            print(f"{r['case']:<56}{r['compiled_us']:>13}{r['formulation_us']:>16}{r['speedup']:>9}  {r['same_bits']}")
        print("environment: " + ", ".join(f"{k} {v}" for k, v in result["environment"].items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
