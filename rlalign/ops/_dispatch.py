"""Which backend runs a strict op: ``torch`` (reference, CPU and CUDA) or ``triton`` (CUDA, fast).

``RLALIGN_BACKEND=torch|triton`` forces one. Both engines of a run must use the same backend;
they do, because they call the same ops in the same process configuration.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from rlalign.contract.errors import fail

_REGISTRY: dict[tuple[str, str], Callable] = {}


def register(op: str, backend: str):
    def deco(fn):
        _REGISTRY[(op, backend)] = fn
        return fn
    return deco


def backend_name(device: torch.device) -> str:
    forced = os.environ.get("RLALIGN_BACKEND")
    if forced:
        return forced
    if device.type == "cuda" and _triton_available():
        return "triton"
    return "torch"


def _triton_available() -> bool:
    try:
        import rlalign.ops.triton_backend  # noqa: F401  (registers its kernels)
    except ImportError:
        return False
    return True


def strict_impl(op: str, device: torch.device) -> Callable:
    """The strict implementation of ``op`` for ``device``.

    On CUDA an op the triton backend does not implement runs on the torch backend, which honours
    the same contract (fixed-shape cuBLAS tiles): both engines resolve ops identically, so they
    still agree. A forced ``RLALIGN_BACKEND`` never mixes.
    """
    import rlalign.ops.torch_backend.registry  # noqa: F401
    name = backend_name(device)
    if name == "triton":
        _triton_available()  # importing the package registers its kernels (also when forced by env)
    fn = _REGISTRY.get((op, name))
    if fn is None and name == "triton" and not os.environ.get("RLALIGN_BACKEND"):
        fn = _REGISTRY.get((op, "torch"))
    if fn is None:
        raise fail(op, f"no strict implementation on backend {name!r} for device {device} "
                       "(strict never falls back; set RLALIGN_BACKEND=torch to use the reference backend)")
    return fn
