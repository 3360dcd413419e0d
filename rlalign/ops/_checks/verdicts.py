"""NaN/inf checks and device verdicts: checked at once on the CPU, deferred on a GPU to the next sync point,
recorded into the graph while a CUDA graph is captured.

:func:`finite` checks a tensor under the check policy (:mod:`.policy`); :func:`deferred` takes any validation
already computed on the device (a 0-dim bool). On a GPU their verdicts wait in a per-thread queue that
:func:`flush` reads (one sync, raising for the first that failed); a capture's verdicts are re-queued after
each replay (:func:`requeue`).
"""

from __future__ import annotations

import threading

import torch

from rlalign.contract.errors import fail
from rlalign.ops._checks.arguments import STRICT_DTYPES
from rlalign.ops._checks.capture import current_capture, is_capturing
from rlalign.ops._checks.policy import BOUNDARY, BOUNDARY_SITES, check_policy, where_checked
from rlalign.ops.torch_backend import clib

_pending = threading.local()


def finite(op: str, name: str, t: torch.Tensor, message: str | None = None, *,
           verdict: torch.Tensor | None = None) -> None:
    """Strict ops refuse NaN/inf inputs: they would poison every reduction they enter.

    Which calls check depends on :func:`check_policy` (PER_OP: all; BOUNDARY: the sites of
    BOUNDARY_SITES). On the CPU the check is immediate. On a GPU an immediate check would make the
    host wait for the device, so the verdict is kept on the device and :func:`flush` (called by the
    ops whose results go to the host anyway: logprob_entropy, lm_logits) raises for the *first*
    check that failed -- still an error naming the op, one sync per forward.
    ``message`` replaces the default "<name> contains NaN or inf"; every message ends with where the
    check ran (per-op: the scope, e.g. ``layers.3``; boundary: how to localize).
    ``verdict``: a 0-dim bool on ``t``'s device, exactly ``isfinite(t).all()``, already computed by a kernel
    that read ``t`` anyway (rope_write_kv's flags): it replaces :func:`finite_verdict`'s pass over ``t``;
    the policy, the messages and the deferral are this function's, whoever computed the verdict. On the
    CPU a False verdict still scans ``t`` to name the first bad index.
    """
    if not (t.is_floating_point() and t.numel()):
        return
    policy = check_policy(t.device)
    if policy == BOUNDARY and (op, name) not in BOUNDARY_SITES:
        return
    capture = current_capture()
    if capture is not None:  # recorded into the graph; the caller re-queues it after each replay
        capture.verdicts.append((op, f"{message or f'{name} contains NaN or inf'} ({where_checked(policy)})",
                                 finite_verdict(t) if verdict is None else verdict))
        return
    if t.device.type == "cpu":
        if (not _any_nonfinite_cpu(t)) if verdict is None else bool(verdict):
            return
        if not bool(torch.isfinite(t).all()):
            bad = (~torch.isfinite(t)).nonzero()[0].tolist()
            first = f"first at index {bad}, value {t[tuple(bad)].item()}"
            raise fail(op, f"{message} ({first}; {where_checked(policy)})" if message else
                       f"{name} contains NaN or inf ({first}; {where_checked(policy)})")
        if verdict is not None:   # fail closed: the kernel's flag and the scan disagree
            raise fail(op, f"internal: a kernel's verdict says {name} is not finite but every element is")
        return
    queue = getattr(_pending, "items", None)
    if queue is None:
        queue = _pending.items = []
    queue.append((op, f"{message or f'{name} contains NaN or inf'} ({where_checked(policy)})",
                  finite_verdict(t) if verdict is None else verdict))
    if len(queue) >= 4096:  # bound the queue on long runs without a flushing op
        flush()


def finite_verdict(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool on ``t``'s device: every element of ``t`` is finite. Two kernels, one pass over ``t``:
    max |x| (``vector_norm(t, inf)``, a max reduction that propagates NaN; |±inf| = inf) compared with
    +inf (NaN < inf is False). The max of |x| is exact (no rounding, no overflow of finite values), so
    the verdict is exactly isfinite(t).all() -- which on a GPU takes five kernels (isfinite is
    x == x, |x|, != inf, and; then all) and four passes."""
    return torch.linalg.vector_norm(t.detach(), float("inf")) < float("inf")


def _any_nonfinite_cpu(t: torch.Tensor) -> bool:
    """Whether a CPU tensor may hold NaN/inf: one pass of the compiled check (csrc/elementwise.c) when it is
    built, else one sum (a sum is non-finite iff an element is or the finite elements overflow: ~10x
    cheaper than isfinite().all(), which then only runs to tell the two apart)."""
    if t.dtype in STRICT_DTYPES and t.is_contiguous():
        lib = clib.library()
        if lib is not None:
            return bool(lib.rl_any_nonfinite(t.data_ptr(), t.numel(), int(t.dtype == torch.bfloat16)))
    return not bool(torch.isfinite(t.sum()))


def requeue(verdicts: list) -> None:
    """Queue deferred verdicts recorded while capturing a CUDA graph (their tensors are refreshed by
    every replay); the next :func:`flush` checks them."""
    queue = getattr(_pending, "items", None)
    if queue is None:
        queue = _pending.items = []
    queue.extend(verdicts)


def flush() -> None:
    """Raise for the first deferred GPU finiteness check that failed (see :func:`finite`). A no-op while
    a CUDA graph is captured (reading a verdict would sync; the capture's verdicts are re-queued after
    each replay and checked by the caller)."""
    queue = getattr(_pending, "items", None)
    if not queue or is_capturing():
        return
    _pending.items = []
    verdicts = torch.stack([ok.to(queue[0][2].device) for _, _, ok in queue]).tolist()
    for (op, message, _), ok in zip(queue, verdicts):
        if not ok:
            raise fail(op, f"{message} (detected on the device at the next sync point)")


def deferred(op: str, message: str, ok: torch.Tensor) -> None:
    """A validation computed on the device (``ok``: a 0-dim bool tensor, True = valid), without a host
    read where one is not free: recorded into the graph while capturing (checked after each replay, like
    :func:`finite`'s verdicts), checked at once for a CPU tensor, queued for :func:`flush` on a GPU."""
    capture = current_capture()
    if capture is not None:
        capture.verdicts.append((op, message, ok))
        return
    if ok.device.type == "cpu":
        if not bool(ok):
            raise fail(op, message)
        return
    queue = getattr(_pending, "items", None)
    if queue is None:
        queue = _pending.items = []
    queue.append((op, message, ok))
