"""Values derived from a batch's index tensors, computed once per forward (:func:`memo`) in a small LRU keyed by
the tensors' identity and version (:class:`TensorCache`); while a CUDA graph is captured, derived once per
capture without a host sync."""

from __future__ import annotations

import collections

import torch

from rlalign.ops._checks.capture import current_capture


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


def memo(kind: str, compute, *tensors: torch.Tensor, extra: tuple = (), capturing=None):
    """``compute()`` once per (kind, tensors, extra): a batch's index tensors (cu_seqlens, seq_lens,
    block_table, slot_mapping) are the same objects in every layer of a forward, so their
    validation and the host values derived from them need one device sync per forward, not one
    per layer. Cached in a :class:`TensorCache` (a failing ``compute`` raises and caches nothing).

    While a CUDA graph is captured (:func:`capturing_graph`) ``compute`` (which may sync) is not called: the
    result is ``capturing()``, which must not sync (None when omitted: validation only), derived once per
    capture and (kind, tensors, extra) -- its kernels are recorded once and every later layer of the captured
    forward reads their outputs (the index tensors do not change within a forward)."""
    capture = current_capture()
    if capture is not None:
        if capturing is None:
            return None
        derived = capture.derived
        key = (kind, tuple(id(t) for t in tensors), extra)
        if key not in derived:
            derived[key] = (tensors, capturing())
        return derived[key][1]
    return _memo.get(kind, compute, tensors, extra)
