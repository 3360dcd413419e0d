"""Peak extra memory and time: strict fused logprob_entropy vs the naive materialising log-prob (CPU).

    python benchmarks/logprob_memory.py [--tokens 8192 --hidden 1024 --vocab 151936] [--dtype fp32] [--json]

Method. Each method runs in its own fresh subprocess (so neither inherits the other's heap):
the worker builds the inputs (seeded, identical in both, filled in place in row chunks so that
building them leaves no transient peak), runs the method once on tiny inputs (loads MKL/OpenMP
code and thread pools, which are not the algorithm's memory), reads its current RSS
(/proc/self/statm) as the baseline, resets the kernel's peak-RSS mark to it (``5`` into
/proc/self/clear_refs, Linux >= 4.0; if refused, the in-place inputs already keep the peak at
the baseline, and ``peak_before`` in the raw output shows it), runs the method once under
``torch.no_grad()`` (forward only) and reads the peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``). Peak extra = peak RSS - baseline RSS: the
most the method ever added to the process, allocator slack included.

    naive:  log_softmax(hidden.float() @ weight.float().T, -1).gather(1, targets)   (materialises [T, V] twice)
    fused:  rlalign.ops.logprob_entropy(hidden, weight, targets)   strict profile, defaults
            (token_chunk 1024, vocab_chunk 8192), entropy included

The two log-prob vectors are compared (max |diff|) and the ratios printed; the requirement is
fused peak extra < 5% of naive.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("fp32", "bf16")
METHODS = ("naive", "fused")
REQUIRED_RATIO = 0.05


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _random_rows(rows: int, cols: int, scale: float, dtype, g, chunk: int = 4096):
    """N(0, scale^2) filled chunk by chunk: never more than one fp32 chunk of temporaries."""
    import torch
    out = torch.empty(rows, cols, dtype=dtype)
    for start in range(0, rows, chunk):
        part = torch.empty(min(chunk, rows - start), cols).normal_(generator=g).mul_(scale)
        out[start:start + part.shape[0]] = part
    return out


def make_inputs(tokens: int, hidden: int, vocab: int, dtype_name: str):
    import torch
    g = torch.Generator().manual_seed(1234)
    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    h = _random_rows(tokens, hidden, 1.0, dtype, g)
    w = _random_rows(vocab, hidden, 2.0 / hidden ** 0.5, dtype, g)  # logits std ~2
    t = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, t


def run_method(name: str, h, w, t):
    import torch.nn.functional as F

    from rlalign.ops import logprob_entropy
    if name == "naive":
        return F.log_softmax(h.float() @ w.float().T, dim=-1).gather(1, t.unsqueeze(1)).squeeze(1)
    return logprob_entropy(h, w, t, profile="strict")[0]


def worker(args) -> None:
    import torch
    sys.path.insert(0, str(REPO))
    h, w, t = make_inputs(args.tokens, args.hidden, args.vocab, args.dtype)
    with torch.no_grad():
        run_method(args.worker, h[:64], w[:2048], t[:64] % 2048)  # warm-up on tiny inputs
        before = rss_bytes()
        reset = reset_peak_rss()
        peak_before = peak_rss_bytes()
        start = time.perf_counter()
        logprob = run_method(args.worker, h, w, t)
        seconds = time.perf_counter() - start
    peak_after = peak_rss_bytes()
    torch.save(logprob, args.save)
    print(json.dumps({"method": args.worker, "rss_before": before, "peak_reset": reset, "peak_before": peak_before,
                      "peak_after": peak_after, "extra": peak_after - before, "seconds": seconds}))


def spawn(method: str, args, save: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", method, "--save", save, "--tokens", str(args.tokens),
           "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtype", args.dtype]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def compare(args) -> dict:
    import torch
    with tempfile.TemporaryDirectory() as tmp:
        runs = {m: spawn(m, args, os.path.join(tmp, f"{m}.pt")) for m in METHODS}
        naive_lp, fused_lp = (torch.load(os.path.join(tmp, f"{m}.pt")) for m in METHODS)
    naive, fused = runs["naive"], runs["fused"]
    return {
        "date": datetime.date.today().isoformat(),
        "machine": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
        "command": "python benchmarks/logprob_memory.py " + " ".join(sys.argv[1:]),
        "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype,
        "naive_extra_mib": naive["extra"] / 2**20, "fused_extra_mib": fused["extra"] / 2**20,
        "extra_ratio_fused_over_naive": fused["extra"] / naive["extra"],
        "naive_seconds": naive["seconds"], "fused_seconds": fused["seconds"],
        "time_ratio_fused_over_naive": fused["seconds"] / naive["seconds"],
        "max_abs_diff_logprob": float((naive_lp - fused_lp).abs().max()),
        "requirement_fused_extra_below_5pct_of_naive": fused["extra"] < REQUIRED_RATIO * naive["extra"],
        "raw": runs,
    }


def print_table(r: dict) -> None:
    print(f"{r['date']}  {r['machine']} ({r['cores']} cores, {r['torch_threads']} torch threads)  "
          f"torch {r['torch']}  python {r['python']}")
    print(f"T={r['tokens']} H={r['hidden']} V={r['vocab']} {r['dtype']}, forward only (no_grad)")
    print(f"{'method':8} {'peak extra MiB':>15} {'seconds':>9}")
    print(f"{'naive':8} {r['naive_extra_mib']:15.1f} {r['naive_seconds']:9.1f}")
    print(f"{'fused':8} {r['fused_extra_mib']:15.1f} {r['fused_seconds']:9.1f}")
    print(f"fused/naive: memory {r['extra_ratio_fused_over_naive']:.4f}, time {r['time_ratio_fused_over_naive']:.2f}; "
          f"max |diff| logprob {r['max_abs_diff_logprob']:.3e}; "
          f"requirement (< {REQUIRED_RATIO:.0%}): {'PASS' if r['requirement_fused_extra_below_5pct_of_naive'] else 'FAIL'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    result = compare(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
