"""Which backend runs a strict op: ``torch`` (reference, CPU and CUDA) or ``triton`` (CUDA, fast).

``RLALIGN_BACKEND=torch|triton`` forces one. Both engines of a run must use the same backend;
they do, because they call the same ops in the same process configuration. The environment is read
once, at the first op (this runs on every op call); :func:`refresh_env` re-reads it.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from rlalign.ops.portable.registry import refusal  # (also fills IMPLEMENTATIONS with the portable profile's ops)
import rlalign.ops.torch_backend.registry  # noqa: F401  (fills IMPLEMENTATIONS with the torch backend's ops)
from rlalign import envvars
from rlalign.contract.profiles import Profile, as_profile
from rlalign.contract.errors import fail
from rlalign.ops._registry import IMPLEMENTATIONS, disabled_ops
from rlalign.ops.torch_backend import clib


@functools.lru_cache(maxsize=1)
def _env() -> tuple[str, str]:
    return envvars.read("RLALIGN_BACKEND"), envvars.read("RLALIGN_TRITON_DISABLE")


def refresh_env() -> None:
    """Re-read ``RLALIGN_BACKEND``, ``RLALIGN_TRITON_DISABLE`` and ``RLALIGN_CPU_KERNELS`` (after changing
    them at run time; they are read once, at first use)."""
    _env.cache_clear()
    clib.enabled.cache_clear()


def backend_name(device: torch.device) -> str:
    return _resolve_backend(device.type, _env()[0])


@functools.lru_cache(maxsize=None)
def _resolve_backend(device_type: str, forced: str) -> str:
    if forced:
        if forced == "triton":
            triton_available()  # importing the package registers its kernels
        return forced
    if device_type == "cuda" and triton_available():
        return "triton"
    return "torch"


def triton_available() -> bool:
    """Whether the Triton backend imports (triton installed); importing it registers its kernels."""
    try:
        import rlalign.ops.triton_backend  # noqa: F401  lazy: triton is optional (GPU); importing registers its kernels
    except ImportError:
        return False
    return True


def probe_failure(what: str, exc: BaseException) -> str:
    """The one-line reason a native vendor path is not taken after its probe call raised: ``what`` (e.g. "the flash
    varlen kernel failed a probe call"), the exception's type and the first line of its message."""
    return f"{what} ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"


def strict_impl(op: str, device: torch.device, profile=None) -> Callable:
    """The strict implementation of ``op`` for ``device``; raises if the selected backend has none.

    In the portable profile (``profile``, or the current one when None): the ``portable`` implementation, the
    same on every device (rlalign/ops/portable), or a one-line refusal when the op has none.

    No fallback across backends: the torch backend on CUDA rests on cuBLAS properties that do not
    hold on an H200 (a bmm item's bits change with the batch count; a GEMM column's with N -- both
    measured), so an op the triton backend lacks must fail closed, not run elsewhere.
    ``RLALIGN_BACKEND=torch`` selects the torch backend on CUDA explicitly, and
    ``RLALIGN_TRITON_DISABLE=op1,op2`` sends the named ops there (explicit opt-ins, for debugging).
    Resolved once per (op, device type, environment): this runs on every op call.
    """
    if as_profile(profile) is Profile.PORTABLE:
        return _portable_impl(op)
    return _resolve_impl(op, device.type, *_env())


def _portable_impl(op: str) -> Callable:
    fn = IMPLEMENTATIONS.get((op, "portable"))
    if fn is None:
        raise refusal(op)
    return fn


@functools.lru_cache(maxsize=None)
def _resolve_impl(op: str, device_type: str, forced: str, disabled: str) -> Callable:
    name = _resolve_backend(device_type, forced)
    if name == "triton" and op in disabled_ops(disabled):
        name = "torch"
    fn = IMPLEMENTATIONS.get((op, name))
    if fn is None:
        raise fail(op, f"no strict implementation on backend {name!r} for device {device_type} "
                       "(strict never falls back to another backend)")
    return fn
