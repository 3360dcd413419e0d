"""Shared fixtures of the CUDA suite: every test here runs the Triton backend on a CUDA device.

The tests carry ``pytest.mark.cuda`` and skip without CUDA (tests/conftest.py). Bitwise checks use
torch.equal on raw bits and report the first differing index (tests/bitwise.py).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def triton_backend():
    """The imported backend package; fails (not skips) if CUDA is there but the backend is not."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import rlalign.ops.triton_backend as tb
    from rlalign.ops._dispatch import backend_name
    assert backend_name(torch.device("cuda")) == "triton", "strict ops on CUDA do not dispatch to triton"
    return tb


def rand(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    """Fresh random normal data on the GPU (never zeros: they hide unwritten outputs)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out has a non-finite value."""
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))
