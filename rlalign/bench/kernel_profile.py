"""Where a call's time goes, by kernel family: the measured answer to "what limits this step".

``profile_breakdown(fn, device)`` runs ``fn()`` once under ``torch.profiler`` (``KernelProfile``: a window of a
call) and sums the self time of every
kernel (CUDA: device time of each GPU kernel, those replayed from CUDA graphs included; CPU: self CPU time of
each aten op) into families by name (first matching pattern of :data:`FAMILIES`, else "other"). It returns the
total, each family's milliseconds and share, and the top kernels -- divided by ``steps`` where given, so a
rollout benchmark reports per decode step. The patterns cover our Triton kernels' names and the vendor kernels
that the native profile and the baselines call (cuBLAS / CUTLASS / flash); a kernel they do not match is counted
as "other", never dropped: the families always sum to the total.

On CUDA the breakdown also says where the device sat idle inside the window (``idle``, :func:`idle_gaps`): the
window's span from its first kernel's start to its last kernel's end, the time no kernel ran, and the idle gaps
of at least ``GAP_MIN_US`` grouped by cause. A gap's cause is the host call that made the device wait: the
latest synchronising CUDA runtime call (``cudaStreamSynchronize``, a blocking ``cudaMemcpy``, ...) that ended
inside the gap, named by the aten op and (with ``stacks=True``) the rlalign / bench Python frame it was called
from; a gap with no such call is "launch" (the host did not enqueue the next kernel in time).
"""

from __future__ import annotations

import re
from typing import Callable

import torch

FAMILIES: tuple[tuple[str, str], ...] = (
    ("attention", r"attention|attn|paged|flash|fmha|sdpa|split_kv|kv_split|merge_split"),
    ("moe", r"route|combine|moe|permute|grouped"),
    ("gemm", r"gemm|kpart|matmul|gemv|cutlass|xmma|nvjet|cublas|segment_partials|merge_partials|aten::mm|aten::addmm"
             r"|aten::bmm|aten::linear"),
    ("logprob_sample", r"logprob|\blp_|sample|sort|topk|top_p|softmax|logsumexp|argmax|gumbel|score|entropy"
                       r"|aten::exp\b"),
    ("checks", r"isfinite|finite|verdict|check|aten::all|aten::any|and_kernel"),   # and_kernel: CUDA's all()
    ("norm_rope_act", r"rms|norm|rope|rotary|silu|swiglu|gelu"),
    ("embedding_copy", r"embedding|index|gather|scatter|copy|cat|fill"),
)
_COMPILED = tuple((name, re.compile(pattern, re.IGNORECASE)) for name, pattern in FAMILIES)


def family(kernel_name: str) -> str:
    """The first family whose pattern occurs in ``kernel_name``, else ``"other"``."""
    for name, pattern in _COMPILED:
        if pattern.search(kernel_name):
            return name
    return "other"


def _kernel_times_us(prof, device: str) -> dict[str, tuple[float, int]]:
    """{kernel or op name: (self microseconds, calls)} -- GPU kernels on CUDA, aten ops on the CPU."""
    from torch.autograd import DeviceType
    times: dict[str, tuple[float, int]] = {}
    for event in prof.key_averages():
        if device == "cuda":
            if event.device_type != DeviceType.CUDA:
                continue
            us = event.self_device_time_total
        else:
            if event.device_type != DeviceType.CPU or not event.key.startswith("aten::"):
                continue
            us = event.self_cpu_time_total
        if us > 0:
            total, calls = times.get(event.key, (0.0, 0))
            times[event.key] = (total + us, calls + event.count)
    return times


GAP_MIN_US = 20.0
CLOCK_SLACK_US = 10.0   # host and device timestamps come from different clocks
_SYNC_CALL = re.compile(r"^cuda(StreamSynchronize|DeviceSynchronize|EventSynchronize|Memcpy|MemcpyAsync)$")
_OUR_FRAME = re.compile(r"(rlalign|bench)/[\w/]+\.py\(\d+\)")


def _cause(event) -> str:
    """The aten op and our innermost Python frame above a synchronising runtime call."""
    aten = frame = None
    parent = event.cpu_parent
    while parent is not None and (aten is None or frame is None):
        if aten is None and parent.name.startswith("aten::"):
            aten = parent.name
        if frame is None and _OUR_FRAME.search(parent.name):
            frame = parent.name[_OUR_FRAME.search(parent.name).start():]
        parent = parent.cpu_parent
    return " via ".join(x for x in (frame, aten or event.name) if x)


def idle_gaps(kernels: list[tuple[float, float, str]], syncs: list[tuple[float, float, str]],
              min_gap_us: float = GAP_MIN_US, top: int = 12) -> dict:
    """Idle time between GPU kernels (microsecond intervals ``(start, end, name)``), with causes.

    Kernels may overlap (several streams): the busy time is the union of their intervals. Every gap >=
    ``min_gap_us`` between busy stretches is charged to the latest ``syncs`` entry ``(start, end, cause)`` that
    ended inside it (the host waited for the device, then had to launch again), else to "launch". Returns ms."""
    if not kernels:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": 0, "by_cause": [], "largest": []}
    kernels = sorted(kernels)
    ends = sorted(syncs, key=lambda s: s[1])
    busy = 0.0
    run_start, run_end, last_name = kernels[0][0], kernels[0][1], kernels[0][2]
    gaps = []
    for start, end, name in kernels[1:]:
        if start > run_end:
            busy += run_end - run_start
            if start - run_end >= min_gap_us:
                inside = [s for s in ends if run_end - CLOCK_SLACK_US <= s[1] <= start]
                gaps.append((start - run_end, last_name, name, inside[-1][2] if inside else "launch"))
            run_start = start
        if end >= run_end:
            run_end, last_name = end, name
    busy += run_end - run_start
    span = max(e for _, e, _ in kernels) - kernels[0][0]
    by_cause: dict[str, list[float]] = {}
    for us, _, _, cause in gaps:
        by_cause.setdefault(cause, []).append(us)
    return {
        "span_ms": round(span / 1e3, 4), "busy_ms": round(busy / 1e3, 4), "idle_ms": round((span - busy) / 1e3, 4),
        "gaps": len(gaps), "gap_min_us": min_gap_us,
        "by_cause": [{"cause": c[:200], "ms": round(sum(v) / 1e3, 4), "gaps": len(v)}
                     for c, v in sorted(by_cause.items(), key=lambda item: -sum(item[1]))],
        "largest": [{"us": round(us, 1), "after": a[:80], "before": b[:80], "cause": c[:200]}
                    for us, a, b, c in sorted(gaps, key=lambda g: -g[0])[:top]],
    }


def _timeline(prof) -> tuple[list, list]:
    """(GPU kernels, synchronising runtime calls with their causes) of a CUDA profile, in microseconds."""
    from torch.autograd import DeviceType
    kernels, syncs = [], []
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            kernels.append((event.time_range.start, event.time_range.end, event.name))
        elif _SYNC_CALL.match(event.name):
            syncs.append((event.time_range.start, event.time_range.end, _cause(event)))
    return kernels, syncs


class KernelProfile:
    """``torch.profiler`` around a window of a call: ``start()`` / ``stop()`` (e.g. from the first decode step
    to the end of a rollout, so prefill stays out), then :meth:`breakdown`."""

    def __init__(self, device: str, stacks: bool = False):
        from torch.profiler import ProfilerActivity, profile
        self.device = device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        # stacks: Python frames as events, so an idle gap's cause names our line (slows the host a little)
        self._prof = profile(activities=activities, with_stack=stacks)
        self.running = False

    def start(self) -> None:
        self._prof.start()
        self.running = True

    def stop(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()   # the window's last kernels finish inside it
        self._prof.stop()
        self.running = False

    def breakdown(self, steps: int | None = None, top: int = 40) -> dict:
        """Kernel time of the window by family, per step when ``steps`` is given (see the module docstring)."""
        times = _kernel_times_us(self._prof, self.device)
        div = max(1, steps or 1) * 1000.0   # microseconds -> milliseconds per step
        total = sum(us for us, _ in times.values())
        families: dict[str, float] = {}
        for name, (us, _) in times.items():
            families[family(name)] = families.get(family(name), 0.0) + us
        ranked = sorted(times.items(), key=lambda item: -item[1][0])[:top]
        idle = {"idle": idle_gaps(*_timeline(self._prof))} if self.device == "cuda" else {}
        return idle | {
            "per": f"step ({steps} profiled)" if steps else "call",
            "kernel_ms": round(total / div, 4),
            "kernel_calls": round(sum(calls for _, calls in times.values()) / max(1, steps or 1), 2),
            "families": {name: {"ms": round(us / div, 4), "share": round(us / total, 4) if total else 0.0}
                         for name, us in sorted(families.items(), key=lambda item: -item[1])},
            "top": [{"name": name[:200], "family": family(name), "ms": round(us / div, 4), "calls": calls}
                    for name, (us, calls) in ranked],
        }


def profile_breakdown(fn: Callable[[], object], device: str, steps: int | None = None, top: int = 40,
                      stacks: bool = False) -> dict:
    """Profile one whole ``fn()`` and group its kernel time (see the module docstring)."""
    prof = KernelProfile(device, stacks)
    prof.start()
    try:
        fn()
    finally:
        prof.stop()
    return prof.breakdown(steps, top)
