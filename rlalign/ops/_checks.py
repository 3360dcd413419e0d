"""Input validation shared by the ops: clear errors that name the op and the problem."""

from __future__ import annotations

import collections
import contextlib
import threading

import torch

from rlalign import envvars
from rlalign.contract import spec
from rlalign.contract.errors import ContractError, fail
from rlalign.ops.torch_backend import clib

STRICT_DTYPES = tuple(getattr(torch, name) for name in spec.STRICT_DTYPES)


def dtype_ok(op: str, *tensors: torch.Tensor) -> torch.dtype:
    """All tensors share one strict dtype (float32 or bfloat16); returns it."""
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype not in STRICT_DTYPES:
            raise fail(op, f"dtype {t.dtype} is not supported in strict (use torch.bfloat16 or torch.float32)")
        if t.dtype != dtype:
            raise fail(op, f"mixed dtypes {dtype} and {t.dtype}: cast the inputs to one dtype")
    return dtype


def same_device(op: str, *tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise fail(op, f"tensors on different devices ({dev} and {t.device})")


def ndim(op: str, name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != n:
        raise fail(op, f"{name} must have {n} dims, got shape {tuple(t.shape)}")


_pending = threading.local()

# ---- where NaN/inf are looked for: the check policy ------------------------------------------------
#
# PER_OP: every strict op checks its floating inputs (the CPU default: a check there costs a fraction
# of the op). BOUNDARY (the CUDA default): only the sites of BOUNDARY_SITES check; on a GPU every check
# costs kernel launches (isfinite().all() took five: per-op checks were a third of a decode step's
# kernel time, measured on an H200; :func:`finite_verdict` takes two).
# BOUNDARY keeps the guarantee because a non-finite value produced or read anywhere in a forward
# reaches the final hidden rows of the tokens it affects: matmul (x * inf, inf - inf, NaN * w),
# residual adds, RMSNorm (inf * rsqrt(inf) = inf * 0 = NaN), silu_mul, rope, and attention's
# p @ V (p * NaN, 0 * inf = NaN) carry it; the final hidden rows are checked where they leave for
# the host (logprob_entropy / lm_logits). The exceptions -- operations that can drop a non-finite
# value -- are checked where they happen:
#   * softmax drops a key whose score is -inf (exp(-inf) = 0): a K with an inf element. The keys
#     a forward writes to the KV cache (write_kv_cache's k) and the keys of a packed forward
#     (attention_varlen's k) are checked; NaN keys propagate (exp(NaN) = NaN).
#   * top-k routing selects experts from router logits (a NaN may just not be chosen): moe_route's
#     logits are checked.
# The sampler's logits (fp32 LM-head output, masked by callers with -inf) are checked by the sampler
# itself under every policy (ops.sample: the torch backend's check_logit_values; the Triton kernel's
# per-row flags, same rule and messages): they are not a BOUNDARY site.
# Set RLALIGN_CHECKS=per-op to find the first op (and decoder layer) that saw a non-finite value.
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


def _where(policy: str) -> str:
    if policy == BOUNDARY:
        return LOCALIZE_HINT
    scopes = getattr(_policy, "scopes", None)
    return f"in {scopes[-1]}" if scopes else "outside the decoder layers"


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
    capture = getattr(_capture, "state", None)
    if capture is not None:  # recorded into the graph; the caller re-queues it after each replay
        capture.verdicts.append((op, f"{message or f'{name} contains NaN or inf'} ({_where(policy)})",
                                 finite_verdict(t) if verdict is None else verdict))
        return
    if t.device.type == "cpu":
        if (not _any_nonfinite_cpu(t)) if verdict is None else bool(verdict):
            return
        if not bool(torch.isfinite(t).all()):
            bad = (~torch.isfinite(t)).nonzero()[0].tolist()
            first = f"first at index {bad}, value {t[tuple(bad)].item()}"
            raise fail(op, f"{message} ({first}; {_where(policy)})" if message else
                       f"{name} contains NaN or inf ({first}; {_where(policy)})")
        if verdict is not None:   # fail closed: the kernel's flag and the scan disagree
            raise fail(op, f"internal: a kernel's verdict says {name} is not finite but every element is")
        return
    queue = getattr(_pending, "items", None)
    if queue is None:
        queue = _pending.items = []
    queue.append((op, f"{message or f'{name} contains NaN or inf'} ({_where(policy)})",
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


class TensorCache:
    """A small LRU of values derived from tensors, keyed by ``kind``, ``extra`` and each tensor's identity,
    storage and in-place version counter (a tensor written in place gets a new entry). An entry holds
    its tensors, so an id cannot be reused by another tensor while it is cached. Inference tensors
    (torch.inference_mode, e.g. vLLM's) carry no version counter: never cached, computed every time.

    Only for a batch's index tensors, which the callers build per batch and never write: the version
    counter misses in-place writes that bypass autograd (``t.data.<op>_()``, fused optimizers), so values
    derived from weights (which such updates write) are never cached here."""

    def __init__(self, size: int):
        self.size = size
        self.entries: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()

    def get(self, kind, compute, tensors: tuple, extra: tuple = ()):
        if any(t.is_inference() for t in tensors):
            return compute()
        key = (kind, extra) + tuple((id(t), t.data_ptr(), t._version) for t in tensors)
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            return hit[1]
        value = compute()    # a failing compute raises and caches nothing
        self.entries[key] = (tensors, value)
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


_memo = TensorCache(16)


class _CaptureState:
    def __init__(self, hints: dict):
        self.hints = hints
        self.verdicts: list = []
        # memo's captured derivations: (kind, tensor ids, extra) -> (the tensors, kept alive so that no id is
        # reused during the capture; the result)
        self.derived: dict = {}


_capture = threading.local()


@contextlib.contextmanager
def capturing_graph(**hints):
    """While a CUDA graph is captured no op may wait for the device, and nothing host-side runs at
    replay. Inside this context: the index validations of :func:`memo` are skipped (the caller --
    the rollout engine, which built the batch -- validates it on the host before every replay),
    host values an op would read from the device come from ``hints`` (:func:`capture_hint`), and
    deferred finiteness verdicts are recorded into the graph instead of queued: the context yields
    the list of them, for :func:`requeue` after each replay."""
    if getattr(_capture, "state", None) is not None:
        raise ContractError("capturing_graph: already capturing")
    state = _capture.state = _CaptureState(hints)
    try:
        yield state.verdicts
    finally:
        _capture.state = None


def is_capturing() -> bool:
    return getattr(_capture, "state", None) is not None


def capture_hint(name: str):
    """A host value given to :func:`capturing_graph` (raises if the capture did not provide it)."""
    hints = _capture.state.hints
    if name not in hints:
        raise ContractError(f"capturing a CUDA graph needs the host value {name!r} (pass it to capturing_graph)")
    return hints[name]


@contextlib.contextmanager
def static_decode():
    """Inside: every paged forward is a decode step of static shapes -- one query per sequence, the
    block table's width fixed by the caller (the rollout engine's decode graphs, captured or run
    padded). Ops that would read lengths on the host take a form with static shapes instead
    (the native profile's paged attention); the strict forward's ops are unaffected, and the sampler
    (``sample``, ``sample_and_score``) takes its static form (:func:`static_shapes`): same bits."""
    before = getattr(_capture, "static_decode", False)
    _capture.static_decode = True
    try:
        yield
    finally:
        _capture.static_decode = before


def static_shapes() -> bool:
    """Whether ops must take their static-shape form, with no host read of tensor data and no
    data-dependent shape: while a CUDA graph is captured, and inside :func:`static_decode` (which runs
    the same form eagerly, so the CPU tests exercise it). The sampler and the logprob op's target
    check have such a form; their validations become :func:`deferred` verdicts there."""
    return is_capturing() or getattr(_capture, "static_decode", False)


def deferred(op: str, message: str, ok: torch.Tensor) -> None:
    """A validation computed on the device (``ok``: a 0-dim bool tensor, True = valid), without a host
    read where one is not free: recorded into the graph while capturing (checked after each replay, like
    :func:`finite`'s verdicts), checked at once for a CPU tensor, queued for :func:`flush` on a GPU."""
    capture = getattr(_capture, "state", None)
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


def decode_step() -> bool:
    """Whether the current forward is a static-shape decode step (:func:`static_decode`, or a CUDA
    graph captured with ``max_query_len=1``)."""
    if getattr(_capture, "static_decode", False):
        return True
    state = getattr(_capture, "state", None)
    return state is not None and state.hints.get("max_query_len") == 1


def memo(kind: str, compute, *tensors: torch.Tensor, extra: tuple = (), capturing=None):
    """``compute()`` once per (kind, tensors, extra): a batch's index tensors (cu_seqlens, seq_lens,
    block_table, slot_mapping) are the same objects in every layer of a forward, so their
    validation and the host values derived from them need one device sync per forward, not one
    per layer. Cached in a :class:`TensorCache` (a failing ``compute`` raises and caches nothing).

    While a CUDA graph is captured (:func:`capturing_graph`) ``compute`` (which may sync) is not called: the
    result is ``capturing()``, which must not sync (None when omitted: validation only), derived once per
    capture and (kind, tensors, extra) -- its kernels are recorded once and every later layer of the captured
    forward reads their outputs (the index tensors do not change within a forward)."""
    if is_capturing():
        if capturing is None:
            return None
        derived = _capture.state.derived
        key = (kind, tuple(id(t) for t in tensors), extra)
        if key not in derived:
            derived[key] = (tensors, capturing())
        return derived[key][1]
    return _memo.get(kind, compute, tensors, extra)


def contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise fail(op, f"{name} must be contiguous (call .contiguous() first); got strides {t.stride()}")


def index_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise fail(op, f"{name} must be an int32/int64 tensor, got {t.dtype}")


__all__ = ["ContractError", "TensorCache", "dtype_ok", "same_device", "ndim", "finite", "flush", "requeue", "memo", "capturing_graph",
           "is_capturing", "capture_hint", "contiguous", "index_dtype", "check_policy", "use_check_policy", "check_scope",
           "PER_OP", "BOUNDARY", "BOUNDARY_SITES", "CHECKS_ENV", "decode_step", "static_decode", "static_shapes", "deferred",
           "finite_verdict"]
