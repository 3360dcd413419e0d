"""Graph-capture state: whether a CUDA graph is being captured (and with which host hints), and whether ops
must take their static-shape form (a captured or padded decode step).

While a CUDA graph is captured no op may wait for the device and nothing host-side runs at replay, so the
checks change form there: deferred verdicts are recorded into the graph (:mod:`.verdicts`), index
validations are skipped and their derivations recorded once per capture (:mod:`.tensor_cache`).
"""

from __future__ import annotations

import contextlib
import threading

from rlalign.contract.errors import ContractError


class CaptureState:
    """What one capture collects: the host ``hints`` it was given, the deferred ``verdicts`` recorded into the
    graph, and the index derivations recorded once (``derived``)."""

    def __init__(self, hints: dict):
        self.hints = hints
        self.verdicts: list = []
        # memo's captured derivations: (kind, tensor ids, extra) -> (the tensors, kept alive so that no id is
        # reused during the capture; the result)
        self.derived: dict = {}


_capture = threading.local()


def current_capture() -> CaptureState | None:
    """The capture in progress on this thread, None when none is."""
    return getattr(_capture, "state", None)


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
    state = _capture.state = CaptureState(hints)
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


def decode_step() -> bool:
    """Whether the current forward is a static-shape decode step (:func:`static_decode`, or a CUDA
    graph captured with ``max_query_len=1``)."""
    if getattr(_capture, "static_decode", False):
        return True
    state = getattr(_capture, "state", None)
    return state is not None and state.hints.get("max_query_len") == 1
