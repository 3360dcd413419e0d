"""The deterministic collectives (all-gather + fixed-tree merge) vs the library's own all-reduce, at a step's sizes.

    python benchmarks/collectives.py --out DIR                     # every GPU of the host (NCCL), group sizes 2, 4, 8
    python benchmarks/collectives.py --out DIR --ranks 2,4         # groups of 2 and 4 GPUs only
    python benchmarks/collectives.py --out DIR --smoke             # CPU + gloo, tiny sizes (the CI test runs this)

What a strict step moves (rlalign/distributed, docs/distributed.md):

- **TP activations**: every row-parallel merge (o_proj, down_proj forward; the column-parallel dX backward)
  all-gathers each rank's fp32 partial [tokens, hidden] and adds them by the fixed tree in rank order
  (``collectives.merge_ranks``), then rounds once to the model dtype. The native profile instead
  all-reduces the rounded output with the library in the model dtype. Rows ``tp_merge``: the fixed merge +
  the rounding (to bf16 or fp32) vs ``library_all_reduce`` (NCCL's; gloo's with --smoke) of the same
  [tokens, hidden] in that dtype, tokens in 1..8192 (decode to a training micro-batch), hidden 4096
  (Qwen3-8B).
- **DP gradients**: ``all_reduce_gradients_`` sums flat fp32 buckets of at most 2^28 elements with
  ``collectives.all_reduce_fixed`` (all-to-all of chunks, the tree on each rank's chunk, all-gather). Rows ``dp_all_reduce_fixed`` vs
  ``library_all_reduce`` (fp32), and its first half ``dp_reduce_scatter_fixed`` (all-to-all + tree) vs
  ``library_reduce_scatter`` (the strict code uses no library reduce-scatter: the all-to-all + tree is its
  deterministic replacement), buckets of 2^20 .. 2^28 fp32 elements.

``collectives.json`` is rewritten after each group size (``"complete": false`` until the end). Each row: median
and min seconds over ``--iters`` timed calls (after ``--warmup``; every call starts after a
barrier and ends with a device sync, rank 0's clock), the bytes of the logical result, algorithm bandwidth
(result bytes / median) and ``ratio`` = fixed / library time. Every fixed result is also checked: equal on
every rank to the tree merge of the inputs computed locally, and for the all-reduces the same bits on every
rank (``fixed_equals_reference``; the exit status is 1 if any row fails it); ``library_differs`` counts the
elements where the library's sum differs from the fixed tree's (information: the library adds in its own order,
and in the bf16 rows it adds values already rounded to bf16, the native layers' rounding point). A row the backend cannot run records its error. Timings are the machine's, never asserted. NVLink
multicast stays off (NCCL_NVLS_ENABLE=0); the JSON records the NCCL environment and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlalign.bench.args import positive_ints  # noqa: E402
from rlalign.distributed.collectives import all_reduce_fixed, gather_ranks, merge_ranks, tree_reduce  # noqa: E402
from rlalign.distributed.launch import Group, spawn  # noqa: E402

TP_TOKENS = (1, 8, 64, 512, 2048, 4096, 8192)
DP_BUCKETS = (2 ** 20, 2 ** 24, 2 ** 26, 2 ** 28)
SMOKE = dict(tokens=(1, 5), hidden=64, buckets=(1000, 4099), iters=2, warmup=1)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for collectives.json")
    p.add_argument("--ranks", default=None, help="group sizes, e.g. 2,4,8 (default: powers of two up to the GPUs)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", default=",".join(map(str, TP_TOKENS)))
    p.add_argument("--buckets", default=",".join(map(str, DP_BUCKETS)), help="DP bucket sizes in fp32 elements")
    p.add_argument("--dtypes", default="bfloat16,float32", help="model dtypes of the TP rows")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="CPU + gloo, tiny sizes, 2 and 4 processes")
    args = p.parse_args(argv)
    for name in ("tokens", "buckets"):
        values = positive_ints(getattr(args, name))
        if values is None:
            p.error(f"--{name} {getattr(args, name)!r}: comma-separated counts, each >= 1")
        setattr(args, name, values)
    args.dtypes = tuple(getattr(torch, d) for d in args.dtypes.split(","))
    if args.smoke:
        args.tokens, args.hidden, args.buckets = SMOKE["tokens"], SMOKE["hidden"], SMOKE["buckets"]
        args.iters, args.warmup = SMOKE["iters"], SMOKE["warmup"]
    available = 4 if args.smoke else torch.cuda.device_count()
    sizes = ((positive_ints(args.ranks) or ()) if args.ranks else tuple(n for n in (2, 4, 8) if n <= available))
    if not sizes or min(sizes) < 2 or max(sizes) > available:
        p.error(f"--ranks {args.ranks or ''}: group sizes must be 2..{available} (the GPUs here; --smoke: up to 4)")
    args.sizes = tuple(sorted(set(sizes)))
    return args


# ---- the operations timed -------------------------------------------------------------------------------

def tp_merge(partial: torch.Tensor, group: Group, dtype) -> torch.Tensor:
    """A row-parallel layer's merge: the fixed tree over every rank's fp32 partial, one rounding."""
    return merge_ranks(partial, group).to(dtype)


def library_all_reduce(t: torch.Tensor, group: Group) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out, group=group.pg)
    return out


def fixed_reduce_scatter(flat: torch.Tensor, group: Group) -> torch.Tensor:
    """all_reduce_fixed's first half: chunk r of every rank to rank r (all-to-all), the tree on it."""
    chunk = flat.numel() // group.size
    received = torch.empty_like(flat)
    dist.all_to_all_single(received, flat, group=group.pg)
    return tree_reduce(list(received.view(group.size, chunk).unbind(0)))


def library_reduce_scatter(flat: torch.Tensor, group: Group) -> torch.Tensor:
    out = flat.new_empty(flat.numel() // group.size)
    # reduce_scatter_single where torch has it (newer; reduce_scatter_tensor is deprecated there)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, flat, group=group.pg)
    return out


# ---- timing and checks ----------------------------------------------------------------------------------

def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, group: Group, device, warmup: int, iters: int) -> dict:
    """Median / min seconds of ``fn()`` over ``iters`` calls, each started after a barrier (rank 0's clock)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        dist.barrier(group=group.pg)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times)}


def same_on_every_rank(t: torch.Tensor, group: Group) -> bool:
    """Whether every rank holds ``t``'s bits (compared as bytes: -0.0 vs 0.0 and NaN payloads count)."""
    bits = t.contiguous().view(torch.uint8)   # gloo gathers uint8, not int16
    return all(torch.equal(bits, other) for other in gather_ranks(bits, group))


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return int((a.contiguous().view(view) != b.contiguous().view(view)).sum())


def rank_input(shape, group: Group, device, seed: int) -> torch.Tensor:
    """Rank r's fp32 input: seeded by (seed, r), so every run and every backend sees the same values."""
    gen = torch.Generator(device=device).manual_seed(seed * 1009 + group.rank)   # on the GPU: fast at 2^28
    return torch.randn(shape, generator=gen, device=device)


def run_row(rows: list, group: Group, device, args, kind: str, size: dict, nbytes: int, fixed, reference,
            library, library_name: str, library_dtype, replicated: bool = True) -> None:
    """Time the fixed operation and the library's; check the fixed result (rank 0 records the row): equal to
    ``reference()`` on this rank, and with ``replicated`` the same bits on every rank."""
    row = {"ranks": group.size, "kind": kind, **size, "result_bytes": nbytes}
    try:
        out = fixed()
        equal = bits_differ(out, reference()) == 0
        flags = gather_ranks(torch.tensor([int(equal)], dtype=torch.int32, device=device), group)
        row["fixed_equals_reference"] = all(int(f) for f in flags) and (not replicated or same_on_every_rank(out, group))
        row["fixed"] = timed(fixed, group, device, args.warmup, args.iters)
        row["fixed"]["algbw_gb_s"] = nbytes / row["fixed"]["median_s"] / 1e9
    except Exception as exc:  # noqa: BLE001 -- a row that cannot run says why, the others still run
        row["fixed"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        lib = library()
        if "error" not in row["fixed"]:
            row["library_differs"] = bits_differ(lib, out.to(library_dtype))
        row[library_name] = timed(library, group, device, args.warmup, args.iters)
        row[library_name]["algbw_gb_s"] = nbytes / row[library_name]["median_s"] / 1e9
    except Exception as exc:  # noqa: BLE001
        row[library_name] = {"error": f"{type(exc).__name__}: {exc}"}
    if "median_s" in row["fixed"] and "median_s" in row[library_name]:
        row["ratio"] = row["fixed"]["median_s"] / row[library_name]["median_s"]
    if group.rank == 0:
        rows.append(row)


def tp_rows(rows: list, group: Group, device, args) -> None:
    for dtype in args.dtypes:
        for tokens in args.tokens:
            partial = rank_input((tokens, args.hidden), group, device, seed=tokens)
            rounded = partial.to(dtype)   # the native path all-reduces the rounded output in the model dtype
            run_row(rows, group, device, args, "tp_merge", {"tokens": tokens, "hidden": args.hidden,
                                                             "dtype": str(dtype).removeprefix("torch.")},
                    tokens * args.hidden * rounded.element_size(),
                    fixed=lambda: tp_merge(partial, group, dtype),
                    reference=lambda: tree_reduce([rank_input((tokens, args.hidden), Group(None, r, group.size),
                                                              device, seed=tokens) for r in range(group.size)]).to(dtype),
                    library=lambda: library_all_reduce(rounded, group), library_name="library_all_reduce",
                    library_dtype=dtype)
            del partial, rounded


def dp_rows(rows: list, group: Group, device, args) -> None:
    for n in args.buckets:
        n -= n % group.size   # whole chunks (all_reduce_fixed pads otherwise; the library needs them)
        flat = rank_input((n,), group, device, seed=n)

        def every_rank():
            return [rank_input((n,), Group(None, r, group.size), device, seed=n) for r in range(group.size)]

        size = {"elements": n, "dtype": "float32"}
        run_row(rows, group, device, args, "dp_all_reduce_fixed", size, n * 4,
                fixed=lambda: all_reduce_fixed(flat, group), reference=lambda: tree_reduce(every_rank()),
                library=lambda: library_all_reduce(flat, group), library_name="library_all_reduce",
                library_dtype=torch.float32)
        chunk = n // group.size
        run_row(rows, group, device, args, "dp_reduce_scatter_fixed", size, chunk * 4,
                fixed=lambda: fixed_reduce_scatter(flat, group),
                reference=lambda: tree_reduce([x[group.rank * chunk:(group.rank + 1) * chunk] for x in every_rank()]),
                library=lambda: library_reduce_scatter(flat, group), library_name="library_reduce_scatter",
                library_dtype=torch.float32, replicated=False)
        del flat
        if device.type == "cuda":
            torch.cuda.empty_cache()


def worker(world: Group, args) -> list | None:
    device = torch.device("cpu") if args.smoke else torch.device("cuda", world.rank)
    rows: list = []
    for size in args.sizes:   # every rank creates every group, in the same order
        pg = world.pg if size == world.size else dist.new_group(list(range(size)))
        if world.rank < size:
            group = Group(pg, world.rank, size)
            tp_rows(rows, group, device, args)
            dp_rows(rows, group, device, args)
        if world.rank == 0:
            write_doc(args, rows, complete=False)   # what is done so far survives a run cut short
        dist.barrier()
    return rows if world.rank == 0 else None


def environment(args) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "smoke": args.smoke,
           "backend": "gloo" if args.smoke else "nccl", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL", "NVSHMEM"))}}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def write_doc(args, rows: list, complete: bool) -> None:
    doc = {"environment": environment(args), "iters": args.iters, "warmup": args.warmup, "group_sizes": args.sizes,
           "wall_s": time.time() - args.started, "complete": complete, "rows": rows}
    out = Path(args.out)
    (out / "collectives.json.tmp").write_text(json.dumps(doc, indent=1))
    (out / "collectives.json.tmp").replace(out / "collectives.json")


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.started = time.time()
    rows = spawn(worker, max(args.sizes), args, backend="gloo" if args.smoke else "nccl")[0]
    write_doc(args, rows, complete=True)
    for r in rows:
        what = f"tokens {r['tokens']} {r['dtype']}" if r["kind"] == "tp_merge" else f"{r['elements']} fp32"
        lib = "library_all_reduce" if "library_all_reduce" in r else "library_reduce_scatter"
        fixed, other = r["fixed"].get("median_s"), r[lib].get("median_s")
        print(f"ranks {r['ranks']} {r['kind']:<24} {what:<22} fixed {_ms(fixed)}  {lib:<22} {_ms(other)}  "
              f"ratio {r.get('ratio', float('nan')):.2f}  checked {r.get('fixed_equals_reference')}")
    print(f"wrote {Path(args.out) / 'collectives.json'}")
    return 0 if all(r.get("fixed_equals_reference") for r in rows) else 1


def _ms(seconds) -> str:
    return f"{seconds * 1e3:9.3f} ms" if seconds is not None else "    error   "


if __name__ == "__main__":
    sys.exit(main())
