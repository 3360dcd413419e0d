"""Where a call's time goes, by kernel family: the measured answer to "what limits this step".

``profile_breakdown(fn, device)`` runs ``fn()`` once under ``torch.profiler`` (``KernelProfile``: a window of a
call) and sums the self time of every
kernel (CUDA: device time of each GPU kernel, those replayed from CUDA graphs included; CPU: self CPU time of
each aten op) into families by name (first matching pattern of :data:`FAMILIES`, else "other"). It returns the
total, each family's milliseconds and share, and the top kernels -- divided by ``steps`` where given, so a
rollout benchmark reports per decode step. The patterns cover our Triton kernels' names and the vendor kernels
that the native profile and the baselines call (cuBLAS / CUTLASS / flash); a kernel they do not match is counted
as "other", never dropped: the families always sum to the total.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

FAMILIES: tuple[tuple[str, str], ...] = (
    ("attention", r"attention|attn|paged|flash|fmha|sdpa|split_kv|kv_split|merge_split"),
    ("moe", r"route|combine|moe|permute|grouped"),
    ("gemm", r"gemm|matmul|gemv|cutlass|xmma|nvjet|cublas|segment_partials|merge_partials|aten::mm|aten::addmm"
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


class KernelProfile:
    """``torch.profiler`` around a window of a call: ``start()`` / ``stop()`` (e.g. from the first decode step
    to the end of a rollout, so prefill stays out), then :meth:`breakdown`."""

    def __init__(self, device: str):
        from torch.profiler import ProfilerActivity, profile
        self.device = device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        self._prof = profile(activities=activities)
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
        return {
            "per": f"step ({steps} profiled)" if steps else "call",
            "kernel_ms": round(total / div, 4),
            "kernel_calls": round(sum(calls for _, calls in times.values()) / max(1, steps or 1), 2),
            "families": {name: {"ms": round(us / div, 4), "share": round(us / total, 4) if total else 0.0}
                         for name, us in sorted(families.items(), key=lambda item: -item[1])},
            "top": [{"name": name[:200], "family": family(name), "ms": round(us / div, 4), "calls": calls}
                    for name, (us, calls) in ranked],
        }


def profile_breakdown(fn: Callable[[], object], device: str, steps: int | None = None, top: int = 40) -> dict:
    """Profile one whole ``fn()`` and group its kernel time (see the module docstring)."""
    prof = KernelProfile(device)
    prof.start()
    try:
        fn()
    finally:
        prof.stop()
    return prof.breakdown(steps, top)
