"""Errors of the rollout engine: each one says what went wrong and what to do about it."""

from __future__ import annotations

from rlalign.contract.errors import RLAlignError


class RolloutError(RLAlignError):
    """Base of the rollout engine's errors."""


class KVCacheTooSmallError(RolloutError):
    """One sequence cannot fit in the whole KV cache, even with every other sequence preempted."""


class WeightsUpdateError(RolloutError):
    """A weight update was refused (requests in flight, unknown tensor name, wrong shape)."""


class RequestError(RolloutError, ValueError):
    """A request is invalid (empty prompt, bad sampling parameters, unknown request id, ...)."""


class RolloutConfigError(RolloutError, ValueError):
    """A RolloutConfig field is out of range."""
