"""Compile the varlen attention backward's kernels for Hopper (sm_90a) on a machine without a GPU and report
what limits them: per kernel and candidate launch (benchmarks/gpu_attention.py train_candidates), ptxas -v's
registers, spill bytes and shared memory, the wgmma instructions in the PTX (wgmma.mma_async count, and
whether any mma.sync is left), the stages asked for, the grid at 2 x 4,096 tokens (32 / 8 heads, d 128) and
its programs per SM (registers and shared memory limits of an H200 SM: 64 K registers, 228 KiB).
Triton ships ptxas, so the whole pipeline runs here (the stand-in driver of tests/sm90.py).

    PYTHONPATH=$PWD python benchmarks/attn_bwd_sm90_cpu.py [--all | LABEL ...]   (--all: every --sweep-train
    candidate; LABELs: those candidates)
"""
import os
import re
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from tests.sm90 import H200_SMS as SMS, activate_fake_sm90, compile_only_launches, ptxas_report  # noqa: E402

SM_REGS, SM_SMEM = 65536, 233472


def main() -> int:
    activate_fake_sm90(SMS)
    compiled = compile_only_launches()
    from rlalign.ops.triton_backend import attention as A
    from gpu_attention import train_candidates
    labels = [a for a in sys.argv[1:] if not a.startswith("--")]
    cands = train_candidates(A) if "--all" in sys.argv or labels else [("default", A.BWD_LAUNCH)]
    cands = [c for c in cands if not labels or c[0] in labels]
    bf = torch.bfloat16
    t, seq = 8192, 4096
    q, k = torch.empty(t, 32, 128, dtype=bf), torch.empty(t, 8, 128, dtype=bf)
    cu = torch.tensor([0, seq, t], dtype=torch.int32)
    print(f"{'candidate':>14} {'kernel':>6} {'regs':>4} {'spill':>9} {'smem':>6} {'wgmma':>5} {'sync':>4} "
          f"{'warps':>5} {'stg':>3} {'per SM':>6} {'grid':>15} {'waves':>5}")
    for label, launch in cands:
        before = len(compiled)
        try:
            A.varlen_backward(q, k, k, q, torch.empty(t, 32), cu, q, 0.1, launch=launch)
        except Exception as exc:  # noqa: BLE001 - a report goes on
            print(f"{label:>14} ERROR {exc!r}"[:300])
            continue
        for name, grid, kwargs, kernel in compiled[before:]:
            ptx = kernel.asm["ptx"]
            rep = ptxas_report(ptx) or ""
            regs = int(m.group(1)) if (m := re.search(r"Used (\d+) registers", rep)) else 0
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", rep)
            smem = kernel.metadata.shared
            warps = kwargs["num_warps"]
            per_sm = min(SM_REGS // max(regs * 32 * warps, 1), SM_SMEM // (smem + 1024)) if regs else 0
            g = tuple(grid) if not callable(grid) else grid
            progs = g[0] * g[1] * g[2]
            print(f"{label:>14} {name.replace('attn_bwd_', '').replace('_kernel', ''):>6} {regs:>4} "
                  f"{(spill.group(1) + '/' + spill.group(2)) if spill else '?':>9} {smem:>6} "
                  f"{len(re.findall(r'wgmma.mma_async', ptx)):>5} {len(re.findall(r'mma.sync', ptx)):>4} {warps:>5} "
                  f"{kwargs['num_stages']:>3} {per_sm:>6} {str(g):>15} {progs / max(per_sm * SMS, 1):>5.1f}")
            for line in rep.splitlines():
                if "C75" in line or "arning" in line:
                    print("      ptxas:", line.strip()[:200])
    return 0


if __name__ == "__main__":
    sys.exit(main())
