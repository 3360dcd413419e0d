"""The cross-machine mode of strict CPU runs (``RLALIGN_CPU_CROSS_MACHINE=1``) and Intel MKL's code path, which it
pins to MKL's machine-independent branch.

torch's CPU build calls MKL for its GEMMs (``torch.mm``, ``bmm``, the strict ops' row tiles, every weight
gradient) and for ``exp``, ``log`` and ``sqrt`` of contiguous float tensors (MKL's vector math, high-accuracy
mode: not correctly rounded). MKL picks a code path per CPU at its first call -- another one on an Intel
AVX-512 Xeon, an Intel AVX2 machine and an AMD EPYC -- and the paths round differently: the same strict run
then has other bits on another CPU (measured: advantage std, entropy and gradient norm from step 1).

MKL's Conditional Numerical Reproducibility mode ``COMPATIBLE`` runs one code path on every x86-64 CPU,
Intel or not, so its results are the same bits everywhere (for a fixed thread count). MKL reads the mode once,
at its first call; with the cross-machine mode on, :func:`pin` sets it (``MKL_CBWR=COMPATIBLE`` in the
environment, inherited by every process a run spawns) and must run before anything has called MKL in the
process. The ``rlalign`` command does it before any work, the trainer before it loads the model; a library user
who calls MKL before sets ``MKL_CBWR=COMPATIBLE`` in the environment instead. :func:`status` says what this
process runs (``rlalign doctor`` prints it). A user who set ``MKL_CBWR`` to another branch keeps it (and
:func:`status` reports the branch as not machine-independent).

The mode also selects the fixed-order reductions (:mod:`rlalign.reductions`) for the gradient norm and the
logged statistics (:func:`cross_machine`), and makes the compiled GEMM kernel, built to the pinned branch's
arithmetic (:mod:`rlalign.ops.torch_backend.clib`), the definition of every strict CPU linear shape
(``primitives.kernel_defines``: a column's bits then do not depend on the call's width, which CPU tensor
parallelism relies on). Its speed is the default's. Off by default for now: it changes the bits of every CPU run
(the recorded runs') and the test suite run in the mode does not pass yet (docs/cpu.md, "Across machines").
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from rlalign import envvars
from rlalign.contract.profiles import Profile, current_profile

VARIABLE = "MKL_CBWR"
PINNED = "COMPATIBLE"
# mkl_service.h: MKL_CBWR_BRANCH selects the branch in mkl_cbwr_get; the branch values (BRANCH_OFF, 1: no
# reproducibility mode, MKL picks its branch for the CPU; measured here, so are AUTO and COMPATIBLE)
_BRANCH_QUERY = 1
_BRANCHES = {0: "OFF", 1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1",
             8: "SSE4_2", 9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1",
             14: "AVX512_E1"}


def cross_machine() -> bool:
    """Whether strict CPU runs take the cross-machine arithmetic (``RLALIGN_CPU_CROSS_MACHINE=1``)."""
    return envvars.read("RLALIGN_CPU_CROSS_MACHINE")


def fixed_reductions() -> bool:
    """Whether the gradient norm and the logged statistics take :mod:`rlalign.reductions`' fixed order: strict CPU
    runs in the cross-machine mode, and every run in the ``portable`` profile (on every device: its CPU and GPU
    runs must agree bit for bit)."""
    return cross_machine() or current_profile() is Profile.PORTABLE


def pin() -> None:
    """In the cross-machine mode, ask MKL for its machine-independent branch (``MKL_CBWR=COMPATIBLE``) unless the
    environment already names a branch. Effective only before MKL's first call in this process (:func:`status`)."""
    if cross_machine():
        os.environ.setdefault(VARIABLE, PINNED)


def _library():
    """torch's CPU library, which links MKL statically and exports its service calls; None without MKL."""
    if not torch.backends.mkl.is_available():
        return None
    path = Path(torch.__file__).with_name("lib") / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(path))
        get = lib.mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    return get


def branch() -> "str | None":
    """The MKL branch this process runs (``COMPATIBLE``, ``AUTO``, ``AVX2`` ...), or None when torch has no MKL
    (or does not expose its mode). Querying it initialises MKL: call it after :func:`pin`."""
    get = _library()
    if get is None:
        return None
    code = get(_BRANCH_QUERY)
    return _BRANCHES.get(code, str(code))


def status() -> tuple[bool, str]:
    """(whether MKL's results are machine-independent here, one line saying why)."""
    name = branch()
    if name is None:
        return True, "torch has no MKL here: nothing to pin"
    if name == PINNED:
        return True, f"MKL runs its {PINNED} branch (the same bits on every x86-64 CPU)"
    return False, (f"MKL's reproducibility mode is {name} (its branch is chosen for this CPU): results reproduce "
                   f"on this machine only (set {VARIABLE}={PINNED} in the environment before the process starts)")


__all__ = ["PINNED", "VARIABLE", "branch", "cross_machine", "fixed_reductions", "pin", "status"]
