"""``rlalign doctor``: check, on this machine, every invariance the strict profile relies on.

It sits above the ops it drives (it calls the public ops and the torch backend's compiled-kernel
checks) and below everything that reports on the machine (``environment``).

Three kinds of checks, each with fresh random inputs (a new seed every run):

* *library assumptions* (:mod:`.library`) -- exactly the properties listed in ``spec.cpu_backend_assumptions``
  (fixed-shape GEMMs are row/column/item invariant, exp/log/sqrt are position invariant, all of it
  deterministic run to run), on the shapes the torch backend issues, and that the compiled CPU
  kernels (a speed path) give the torch formulation's bits;
* *op invariances* (:mod:`.op_checks`) -- each strict op's contract end to end (batch size, row position,
  packing, prefill vs decode, chunk sizes, TP partition), through the public ops;
* *the model's three paths* (:mod:`.paths`) -- packed == one-shot prefill == chunked prefill + decode through a
  small model of each family, per dtype: the ops composed as the trainer and the rollout engine compose them;
* *across machines* (:mod:`.machine`, CPU) -- MKL runs its machine-independent branch, and a fixed probe through
  every strict op gives the committed reference bits: a strict run here has the bits of one recorded elsewhere.

Strict relies on the doctor being green on the machine that runs it.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Callable

import torch

from rlalign.doctor import library, machine, op_checks, paths
from rlalign.doctor.base import Check, CheckResult
from rlalign.ops import backend_name


# library assumptions, then each op's invariances, then the ops composed by a model's three paths
CHECKS: tuple[Check, ...] = library.CHECKS + op_checks.CHECKS + paths.CHECKS + machine.CHECKS


def run_checks(device: str = "cpu", seed: int | None = None, progress: Callable[[str], None] | None = None):
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    results = []
    for check in CHECKS:
        if dev.type not in check.devices:
            continue
        if check.torch_backend_only and backend_name(dev) != "torch":
            continue  # e.g. CUDA with the triton backend: cuBLAS properties are not relied on
        if progress:
            progress(f"{check.op}: {check.invariance}")
        t0 = time.perf_counter()
        try:
            out = check.run(dev, gen)
        except Exception as exc:  # a check that crashes does not hold; say why
            out = (False, f"{type(exc).__name__}: {exc}")
        holds, detail = out if isinstance(out, tuple) else (bool(out), "")
        results.append(CheckResult(check.op, check.invariance, holds, time.perf_counter() - t0, detail))
    return results, seed


def environment(device: str) -> dict:
    """The software and the machine; ``cpu``, ``cpu_capability`` (torch's vector width) and ``mkl_branch`` (MKL's
    code path) are what decides the CPU's bits (:func:`machine.identity`)."""
    info = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            **{k: v for k, v in machine.identity().items() if k != "mkl_machine_independent"}}
    try:
        import triton   # lazy: an optional GPU dependency, reported only when present
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
