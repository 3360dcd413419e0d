"""Compiling our Triton / Gluon kernels for Hopper (sm_90a) on a machine without a GPU: a stand-in driver whose
target is sm_90, and Triton's own ptxas for the register / spill / shared-memory report. Used by the sm_90a compile
checks (tests/ops/test_triton_interpret.py, tests/ops/test_gemm_ws_compile.py) and benchmarks/attn_bwd_sm90_cpu.py.
Activate the driver in a fresh process before the triton backend package is imported; ``compile_only_launches``
then turns every Triton JIT launch into a compile-only warmup and records it."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import NamedTuple

H200_SMS = 132


class _Sm90Driver:
    """Triton's active-driver interface, answering for one sm_90 device; tensors stay on the CPU."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def is_active(self):
        return True


def activate_fake_sm90(sms: int = H200_SMS, gluon_gemm: bool = False) -> None:
    """Make Triton compile for sm_90 and the triton backend import and size its grids for ``sms`` SMs, with CPU
    tensors standing for the device's (launches must be compile-only: see the callers' JITFunction.run patch).
    ``gluon_gemm``: the dispatcher may take the Gluon K-partition kernel (its Hopper check sees the stand-in
    device); otherwise the CPU tensors fail that check and the Triton kernels are compiled."""
    import torch
    from triton.runtime import driver
    driver.set_active(_Sm90Driver())
    torch.cuda.is_available = lambda: True   # let the backend package import
    import rlalign.ops.triton_backend._common as common
    common.num_sms = lambda index: sms
    if gluon_gemm:
        import rlalign.ops.triton_backend.gemm_ws as ws
        ws._capability = lambda device: (9, 0)


_REDUCE = re.compile(r'"tt\.reduce"\([^)]*\) <\{axis = (\d+) : i32\}> \(\{.*?\}\) : \(tensor<([\dx]+)x(\w+),',
                     re.DOTALL)


def float_reduction_widths(ttgir: str) -> list[int]:
    """The width (elements along the reduced axis) of every floating-point ``tt.reduce`` in a TTGIR module. A
    reduction over more than two values adds them in the order of the operand's register layout, which Triton
    derives from the kernel's loads; over two values the order cannot matter (a + b == b + a)."""
    widths = []
    for axis, shape, elem in _REDUCE.findall(ttgir):
        if elem.startswith(("f", "bf")):
            widths.append(int(shape.split("x")[int(axis)]))
    return widths


class Launch(NamedTuple):
    """One compile-only launch: the kernel's name, its grid, the launch's keyword arguments (constexprs and
    launch options) and the compiled kernel (``.asm["ttgir" | "ptx"]``, ``.metadata.shared``)."""
    name: str
    grid: object
    kwargs: dict
    kernel: object


def compile_only_launches() -> list[Launch]:
    """Make every Triton JIT launch in this process compile only (``warmup``: the real launchers run on CPU
    tensors, nothing executes) and return the list each launch appends its :class:`Launch` to."""
    from triton.runtime.jit import JITFunction
    compiled: list[Launch] = []
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(Launch(self.fn.__name__, grid, kwargs, kernel))
        return kernel

    JITFunction.run = compile_only
    return compiled


def ptxas_report(ptx: str, timeout: int = 300) -> str | None:
    """ptxas -v for sm_90a on ``ptx``: its info lines (registers, spills, performance warnings), or None when
    Triton's ptxas cannot be found or run."""
    try:
        import triton.backends.nvidia as nv
        exe = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        run = subprocess.run([exe, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, timeout=timeout)
        os.unlink(f.name)
    except (ImportError, OSError, subprocess.SubprocessError):
        return None
    return run.stderr if run.returncode == 0 else None
