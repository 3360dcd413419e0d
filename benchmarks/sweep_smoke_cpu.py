"""CPU smoke run of the sweeps (benchmarks/gpu_attention.py --sweep-decode and --sweep-train, benchmarks/gpu_linear.py
--sweep-small and --sweep-mid) under the Triton interpreter: tiny shapes, fp32 (the interpreter mis-rounds bf16), the CUDA
timing replaced by a counter (the "ms" columns mean nothing). It runs the sweeps' code paths -- candidate
lists, launches, the bitwise check against the default, the tables -- before they spend device time.
Note: the interpreter's tl.dot is a BLAS matmul, whose bits depend on the tile width, so GEMM candidates
with another block N show DIFFER here; on the GPU that is what the sweep measures.

    PYTHONPATH=$PWD python benchmarks/sweep_smoke_cpu.py attn|train|lin
"""
import itertools
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from tests.ops.test_triton_interpret import _patch_interpreter  # noqa: E402

_patch_interpreter()
import rlalign.bench.cuda_timing as T  # noqa: E402

ctr = itertools.count(1)
T.bench_ms = lambda fn, warmup=25, rep=100: (fn(), 0.01 * next(ctr) % 0.07 + 0.01)[1]   # a stand-in time
T.graphed = lambda fn, ctx=None: fn
import gpu_attention as GA  # noqa: E402
import torch  # noqa: E402
import gpu_linear as GL  # noqa: E402

GA.SWEEP_DEVICE = GL.SWEEP_DEVICE = "cpu"
which = sys.argv[1]
if which == "attn":
    GA.SWEEP_BATCHES = (1, 5)
    GA.SWEEP_CTX, GA.SWEEP_HQ, GA.SWEEP_HKV, GA.SWEEP_PAGE = 300, 2, 1, 16
    GA.D = 16
    GA._flash_varlen_decode = lambda *a: None
    GA._sdpa = lambda q, k, v, causal: ((lambda: q), "stub")
    from rlalign.ops.triton_backend import attention as A
    pf = A.paged_forward
    A.paged_forward = lambda q, kc, vc, *a, **k: pf(q.float(), kc.float(), vc.float(), *a, **k)   # interpreter: fp32 only
    rows = GA.sweep_decode()
    GA.print_sweep(rows)
elif which == "train":
    # 2 x 70 and 1 x 130 tokens, 4/2 heads, d 16: every candidate's tiles see ragged edges; SDPA stubbed
    GA.TRAIN_SHAPES, GA.TRAIN_ACC_LENS = ((2, 70), (1, 130)), (1, 37, 100)
    GA.TRAIN_HQ, GA.TRAIN_HKV, GA.D, GA.TRAIN_DTYPE = 4, 2, 16, torch.float32
    GA._sdpa_train_ms = lambda *a: (0.05, "stub")
    rows = GA.sweep_train()
    GA.print_train(rows)
    bad = [r for r in rows if r["label"] != "baseline" and ("error" in r or not isinstance(r["f64_err"], float)
                                                            or r["f64_err"] > 2e-5)]
    if bad:
        raise SystemExit(f"sweep-train smoke: candidates failed or are inaccurate: {bad}")
else:
    from rlalign.ops.triton_backend import gemm as G
    GL.SMALL_SHAPES = (("tiny a", 72, 512), ("tiny b", 40, 1024))
    GL.SMALL_M = (1, 3)
    GL.ROTATE_BYTES = 1
    orig = G.gemm
    def gemm_f32(x, w, **kw):   # the interpreter checks fp32 only
        return orig(x.float(), w.float(), **kw)
    G.gemm = gemm_f32
    cands = GL.small_candidates()
    GL.small_candidates = lambda: cands[:3]
    rows = GL.sweep_small()
    GL.print_small(rows)
    GL.MID_M = (65, 130)
    mids = GL.mid_candidates()
    GL.mid_candidates = lambda: mids[:2]
    rows = GL.sweep_mid()
    GL.print_mid(rows)
