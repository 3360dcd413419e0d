"""GPU timing shared by the benchmarks/gpu_*.py scripts: a call's median time, eager or replayed from a CUDA graph.

The rollout engine replays its decode steps from CUDA graphs, so a decode-sized call's host launch cost (tens of
microseconds of Python and launcher work, often more than its GPU work at batch 1-64) is not in its step time;
``graphed`` times what the engine pays. Import only where CUDA is available.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable

import torch


def bench_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` (one warm call first; triton's do_bench: ``warmup`` ms of warm-up,
    ``rep`` ms of repetitions)."""
    import triton
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graphed(fn: Callable[[], object], capture_context: Callable[[], object] | None = None) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (warmed up eagerly and on a side stream first: compiles and allocator
    pools happen outside the capture) -> the graph's replay. ``capture_context`` (e.g. ``ops.capturing_graph``)
    wraps the capture for ops that would otherwise wait for the device."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with (capture_context() if capture_context else contextlib.nullcontext()), torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def replay_ms_per_set(fn: Callable[..., object], sets: list, warmup: int = 25, rep: int = 100) -> float:
    """ms per input set of one CUDA-graph replay that runs ``fn(*set)`` on every set (rotating copies keep the
    operands out of L2; the sweeps and the GEMM census time with it)."""
    return bench_ms(graphed(lambda: [fn(*s) for s in sets]), warmup=warmup, rep=rep) / len(sets)


def watched(what: str, fn: Callable[[], object], seconds: float):
    """fn() followed by a device synchronize; past ``seconds`` (a hung kernel never returns) print ``what`` and end
    the process with exit code 3, so a sweep or a test run names the case instead of hanging."""
    timer = threading.Timer(seconds, lambda: (print(f"\nHANG (> {seconds:.0f} s): {what}", flush=True), os._exit(3)))
    timer.start()
    try:
        out = fn()
        torch.cuda.synchronize()
        return out
    finally:
        timer.cancel()
