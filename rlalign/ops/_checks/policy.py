"""Where NaN/inf are looked for: the check policy (per-op or at the forward's boundaries) and the scope names
that per-op messages carry.

PER_OP: every strict op checks its floating inputs (the CPU default: a check there costs a fraction
of the op). BOUNDARY (the CUDA default): only the sites of BOUNDARY_SITES check; on a GPU every check
costs kernel launches (isfinite().all() took five: per-op checks were a third of a decode step's
kernel time, measured on an H200; :func:`rlalign.ops._checks.verdicts.finite_verdict` takes two).
BOUNDARY keeps the guarantee because a non-finite value produced or read anywhere in a forward
reaches the final hidden rows of the tokens it affects: matmul (x * inf, inf - inf, NaN * w),
residual adds, RMSNorm (inf * rsqrt(inf) = inf * 0 = NaN), silu_mul, rope, and attention's
p @ V (p * NaN, 0 * inf = NaN) carry it; the final hidden rows are checked where they leave for
the host (logprob_entropy / lm_logits). The exceptions -- operations that can drop a non-finite
value -- are checked where they happen:

* softmax drops a key whose score is -inf (exp(-inf) = 0): a K with an inf element. The keys
  a forward writes to the KV cache (write_kv_cache's k) and the keys of a packed forward
  (attention_varlen's k) are checked; NaN keys propagate (exp(NaN) = NaN).
* top-k routing selects experts from router logits (a NaN may just not be chosen): moe_route's
  logits are checked.

The sampler's logits (fp32 LM-head output, masked by callers with -inf) are checked by the sampler
itself under every policy (ops.sample: the torch backend's check_logit_values; the Triton kernel's
per-row flags, same rule and messages): they are not a BOUNDARY site.
Set RLALIGN_CHECKS=per-op to find the first op (and decoder layer) that saw a non-finite value.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from rlalign import envvars
from rlalign.contract.errors import ContractError

PER_OP, BOUNDARY = "per-op", "boundary"
CHECKS_ENV = "RLALIGN_CHECKS"
BOUNDARY_SITES = frozenset({
    ("logprob_entropy", "hidden"), ("lm_logits", "hidden"),      # every forward's values arrive here
    ("write_kv_cache", "k"), ("attention_varlen", "k"),          # softmax drops -inf scores
    ("moe_route", "logits"),                                      # top-k selection drops NaN
})
LOCALIZE_HINT = (f"checked at the forward's boundaries ({CHECKS_ENV}={BOUNDARY}); rerun with {CHECKS_ENV}={PER_OP} "
                 "to name the first op and layer that saw it")
_policy = threading.local()


def check_policy(device: torch.device | str) -> str:
    """PER_OP or BOUNDARY for tensors on ``device``: :func:`use_check_policy` if active, else the
    RLALIGN_CHECKS environment variable (per-op | boundary | auto), else auto: PER_OP on the CPU,
    BOUNDARY on accelerators. Graphs captured by the rollout engine keep the policy of their capture."""
    forced = getattr(_policy, "value", None)
    if forced is not None:
        return forced
    setting = envvars.read(CHECKS_ENV)   # per-op, boundary or auto (the rule refuses anything else)
    if setting in (PER_OP, BOUNDARY):
        return setting
    return PER_OP if torch.device(device).type == "cpu" else BOUNDARY


@contextlib.contextmanager
def use_check_policy(policy: str):
    """Force ``policy`` (PER_OP | BOUNDARY) on every device inside the block (tests run the CUDA
    policy on the CPU with it)."""
    if policy not in (PER_OP, BOUNDARY):
        raise ContractError(f"check policy must be {PER_OP!r} or {BOUNDARY!r}, got {policy!r}")
    before = getattr(_policy, "value", None)
    _policy.value = policy
    try:
        yield
    finally:
        _policy.value = before


@contextlib.contextmanager
def check_scope(label: str):
    """Name the part of a forward the ops run in (e.g. ``layers.3``) for per-op finiteness messages."""
    stack = getattr(_policy, "scopes", None)
    if stack is None:
        stack = _policy.scopes = []
    stack.append(label)
    try:
        yield
    finally:
        stack.pop()


def where_checked(policy: str) -> str:
    """The end of a finiteness message: the scope the check ran in (per-op), or how to localize (boundary)."""
    if policy == BOUNDARY:
        return LOCALIZE_HINT
    scopes = getattr(_policy, "scopes", None)
    return f"in {scopes[-1]}" if scopes else "outside the decoder layers"
