"""Benchmark: peak host memory of one offloaded optimizer step: all at once, per parameter, in chunks (CPU, Linux).

A bf16 model of ``--tensors`` parameters of ``--mib`` MiB (fp32) each, fp32 masters and AdamW state offloaded
to the host (``MasterWeights(offload=True)``). One warm-up step, then one measured step of each path in
its own subprocess (a fresh allocator): how far the process's peak resident set (Linux VmHWM, reset
first) rises above its size before the step.

* ``chunked``: ``MasterWeights.step`` with ``chunk_elements`` = ``--chunk-mib`` of fp32 (what the trainer runs,
  ``optim.step_chunk_elements``: one chunk's widened gradient and AdamW temporaries at a time);
* ``per_parameter``: ``MasterWeights.step`` with chunks as large as a parameter (the path of 2026-12-01:
  one widened fp32 gradient at a time);
* ``all_at_once``: ``grads_to_master`` + ``optimizer.step`` + ``master_to_model`` (every fp32 gradient
  exists at once: the baseline, the path before 2026-12-01).

    python benchmarks/offload_step_memory.py [--tensors 8] [--mib 64] [--chunk-mib 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent('''
    import json, sys
    import torch
    from rlalign.train.master import MasterWeights

    def rss(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    mode, tensors, mib, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    n = mib * (1 << 20) // 4
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for _ in range(tensors))
    master = MasterWeights(model, enabled=True, offload=True, chunk_elements=chunk if mode == "chunked" else n)
    opt = torch.optim.AdamW(master.optim_params(), lr=1e-4, foreach=False)

    def optimizer_step():
        if mode != "all_at_once":
            master.step(opt)
        else:
            master.grads_to_master()
            opt.step()
            master.master_to_model()

    def set_grads():
        for p in model:
            p.grad = torch.randn(n).to(torch.bfloat16) * 1e-3

    set_grads()
    optimizer_step()                         # AdamW state allocated
    opt.zero_grad(set_to_none=True)
    for p in model:
        p.grad = None
    set_grads()                              # the measured step's bf16 gradients exist before the mark
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    # the baseline from the same counter as the peak: right after the reset VmHWM is the resident set, and it only
    # grows after that, so the rise is >= 0 by construction (VmRSS read here could exceed a later VmHWM by the
    # kernel's lagging per-thread RSS counters, and a rise of a few MiB then read negative on CI, 2026-12-03)
    before = rss("VmHWM:")
    optimizer_step()
    print(json.dumps({"mode": mode, "rise": rss("VmHWM:") - before}))
''')


def measure(mode: str, tensors: int, mib: int, chunk: int) -> int:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(tensors), str(mib), str(chunk)], capture_output=True,
                         text=True, env=env, timeout=600)
    if out.returncode:
        raise SystemExit(f"offload_step_memory: the {mode} run failed: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["rise"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--mib", type=int, default=64, help="fp32 MiB per parameter tensor")
    ap.add_argument("--chunk-mib", type=int, default=8, help="the chunked step's chunk, in fp32 MiB")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not os.access("/proc/self/clear_refs", os.W_OK):
        print("offload_step_memory: needs Linux's /proc/self/clear_refs to reset the peak resident set")
        return 1
    chunk = args.chunk_mib * (1 << 20) // 4
    rows = {m: measure(m, args.tensors, args.mib, chunk) for m in ("all_at_once", "per_parameter", "chunked")}
    result = {"tensors": args.tensors, "mib_per_tensor_fp32": args.mib, "chunk_mib_fp32": args.chunk_mib,
              "rise_mib": {m: round(v / (1 << 20), 1) for m, v in rows.items()},
              "per_parameter_over_all_at_once": round(rows["per_parameter"] / max(rows["all_at_once"], 1), 3),
              "chunked_over_per_parameter": round(rows["chunked"] / max(rows["per_parameter"], 1), 3)}
    print(json.dumps(result) if args.json else
          f"peak host rise of one offloaded step, {args.tensors} x {args.mib} MiB (fp32) parameters: "
          f"all at once {result['rise_mib']['all_at_once']} MiB, per parameter {result['rise_mib']['per_parameter']} "
          f"MiB ({result['per_parameter_over_all_at_once']}x), in {args.chunk_mib} MiB chunks "
          f"{result['rise_mib']['chunked']} MiB ({result['chunked_over_per_parameter']}x of per parameter)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
