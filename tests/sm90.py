"""Compiling our Triton / Gluon kernels for Hopper (sm_90a) on a machine without a GPU: a stand-in driver whose
target is sm_90, and Triton's own ptxas for the register / spill / shared-memory report. Used by the sm_90a compile
checks (tests/ops/test_triton_interpret.py, tests/ops/test_gemm_ws_compile.py) and bench/attn_bwd_sm90_cpu.py.
Activate the driver in a fresh process before the triton backend package is imported."""

from __future__ import annotations

import os
import subprocess
import tempfile

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
