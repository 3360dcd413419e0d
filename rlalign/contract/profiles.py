"""Numerical profiles and how to select them.

``strict``  every op honours the contract in :mod:`rlalign.contract.spec`; anything that cannot
            (unsupported dtype, shape, device) raises :class:`ContractError`, never falls back.
``native``  vendor kernels (cuBLAS / MKL / SDPA), no invariance promise. The baseline for
            benchmarks, and for users who correct the mismatch with importance sampling.
``portable`` strict's promises, and the same bits on the CPU and on a CUDA GPU: every op built from
            correctly rounded IEEE operations in one fixed order (rlalign/ops/portable, docs/portable.md).
            Rollout, scoring and training of dense models (its own backward and a fixed-order optimizer
            step); anything else raises. Slow: an audit mode.

Selection, most specific first: the ``profile=`` argument of an op call, then the innermost
``use_profile(...)`` context, then the process default (``strict``). Engines take a ``profile``
config field and enter ``use_profile`` around their forward passes.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum


class Profile(str, enum.Enum):
    STRICT = "strict"
    NATIVE = "native"
    PORTABLE = "portable"


_current: contextvars.ContextVar[Profile] = contextvars.ContextVar("rlalign_profile", default=Profile.STRICT)


def as_profile(value: "str | Profile | None") -> Profile:
    if value is None:
        return _current.get()
    if isinstance(value, Profile):
        return value
    try:
        return Profile(str(value).lower())
    except ValueError:
        raise ValueError(f"unknown profile {value!r}: choose one of {[p.value for p in Profile]}") from None


def current_profile() -> Profile:
    return _current.get()


def bitwise(value: "str | Profile | None") -> bool:
    """Whether ``value`` promises rollout == trainer bit for bit (``strict`` and ``portable``; not ``native``)."""
    return as_profile(value) is not Profile.NATIVE


@contextlib.contextmanager
def use_profile(profile: "str | Profile"):
    """Run the enclosed ops under ``profile`` (``"strict"``, ``"native"`` or ``"portable"``)."""
    token = _current.set(as_profile(profile))
    try:
        yield
    finally:
        _current.reset(token)
