"""Saved activations rebuilt in the backward instead of kept: same bits, less activation memory.

A decoder layer's linears save their input for dW: the RMSNorm outputs that q/k/v_proj and gate/up_proj
read, and silu_mul's output that down_proj reads; attention saves the roped q and k. Each of these is
deterministic elementwise work on tensors the backward keeps anyway (the norm's input and weight,
silu_mul's gate and up; with a q/k norm, the projection's output that the q/k norm saves, its weight and the
rope tables), so it can be rebuilt in the backward with the forward's bits, and not kept ([T, hidden] twice,
[T, intermediate] once, and with a q/k norm [T, (heads + kv_heads) x head_dim] once per layer).

How: :func:`layer_session` (entered by ``blocks.decoder_layer_block`` around a layer's forward) installs
``torch.autograd.graph.saved_tensors_hooks``; the block cores :func:`register` each rebuildable tensor
with its recipe (the function and its inputs). When an op saves a tensor that *is* a registered one (the
same storage, offset and element count, both contiguous: ``ops.linear`` saves ``x.reshape(-1, K)``, a
view), the hook keeps the recipe instead, **provided every recipe input has itself been saved earlier in
the layer** (its storage seen by the hook): only then is the rebuild free of memory. Where a backend
saves something else (the CPU torch backend in bf16 saves fp32 copies of the norm's and silu_mul's
inputs), nothing changes for that tensor. Every other saved tensor passes through untouched.

Unpacking rebuilds the tensor once under ``no_grad`` and the forward's profile; q/k/v_proj share one
recipe, so the rebuilt tensor is cached for its other unpacks and dropped after the last one.

Fails closed (``RLAlignError``, one line): a recipe input, or the registered tensor, modified in place
after the forward (``_version`` changed); a double backward (``create_graph=True``) through a recipe.

Off: in no_grad / inference (nothing is saved), outside the strict profile, under
``torch.utils.checkpoint``'s hooks (a checkpointed layer saves only its inputs: nothing to gain, and the
recipes would hold tensors the checkpoint drops), and when switched off (:func:`set_enabled`,
:func:`disabled`). Other saved-tensor hooks already active (e.g. a test counting saved bytes) are
composed with: every tensor this module does not replace by a recipe is handed to them.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Callable

import torch

from rlalign import ops
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import Profile, current_profile, use_profile

_ENABLED = True
_PACKS = 0   # saves replaced by recipes in this process (pack_count)
_session: contextvars.ContextVar["_Session | None"] = contextvars.ContextVar("rlalign_recompute", default=None)


def set_enabled(on: bool) -> None:
    """Turn recomputation on (the default) or off for this process."""
    global _ENABLED
    _ENABLED = bool(on)


def is_enabled() -> bool:
    return _ENABLED


@contextlib.contextmanager
def disabled():
    """Keep every saved activation inside the block (restores the previous setting)."""
    global _ENABLED
    before, _ENABLED = _ENABLED, False
    try:
        yield
    finally:
        _ENABLED = before


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recipe:
    """One registered tensor: how to rebuild it, its inputs' versions at registration, the packs it replaced."""

    def __init__(self, name: str, out: torch.Tensor, rebuild: Callable[[], torch.Tensor], inputs: tuple):
        self.name, self.rebuild, self.inputs = name, rebuild, inputs
        self.versions = tuple(t._version for t in inputs)
        self.out_ref, self.out_version = weakref.ref(out), out._version
        self.profile = current_profile()
        self.packs = 0          # how many saves this recipe replaced
        self.pending = 0        # unpacks left in the current backward before the cache is dropped
        self.cache: torch.Tensor | None = None

    def matches(self, t: torch.Tensor) -> bool:
        out = self.out_ref()
        return (out is not None and t.is_contiguous() and out.is_contiguous() and t.numel() == out.numel()
                and t.dtype == out.dtype and t.device == out.device and _storage_key(t) == _storage_key(out)
                and t.storage_offset() == out.storage_offset())

    def unpack(self, shape: torch.Size) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RLAlignError(f"recompute: double backward (create_graph=True) through the rebuilt {self.name} is not "
                               "supported; turn recomputation off (rlalign.models.recompute.set_enabled(False))")
        if self.cache is None:
            self._check_versions()
            # the forward's profile; no finiteness re-check: the inputs were checked in the forward and are
            # unchanged (versions), and a deferred GPU check queued here, in autograd's thread, would never be flushed
            with torch.no_grad(), use_profile(self.profile), ops.use_check_policy("boundary"):
                self.cache = self.rebuild()
            self.pending = self.packs
        rebuilt = self.cache.view(shape)
        self.pending -= 1
        if self.pending <= 0:   # the last unpack of this backward: drop it (a retained graph rebuilds again)
            self.cache = None
        return rebuilt

    def _check_versions(self) -> None:
        now = tuple(t._version for t in self.inputs)
        out = self.out_ref()
        if now != self.versions or (out is not None and out._version != self.out_version):
            raise RLAlignError(f"recompute: an input of {self.name} was modified in place after the forward "
                               f"(versions {self.versions} -> {now}); it cannot be rebuilt with the forward's bits")


def _count_pack(recipe: _Recipe) -> None:
    global _PACKS
    _PACKS += 1
    recipe.packs += 1


class _Packed:
    __slots__ = ("recipe", "shape")

    def __init__(self, recipe: _Recipe, shape: torch.Size):
        self.recipe, self.shape = recipe, shape


class _Outer:
    """A tensor handed to the saved-tensor hooks that were active before the session (their packed value)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _Session:
    """One layer's forward: its registered recipes and the storages saved so far."""

    def __init__(self, outer):
        self.outer = outer
        self.recipes: list[_Recipe] = []
        self.saved: set[int] = set()

    def pack(self, t: torch.Tensor):
        for recipe in self.recipes:
            if recipe.matches(t) and all(_storage_key(i) in self.saved for i in recipe.inputs):
                _count_pack(recipe)
                return _Packed(recipe, t.shape)
        if t.numel():
            self.saved.add(_storage_key(t))
        return t if self.outer is None else _Outer(self.outer[0](t))

    def unpack(self, packed):
        if isinstance(packed, _Packed):
            return packed.recipe.unpack(packed.shape)
        if isinstance(packed, _Outer):
            return self.outer[1](packed.value)
        return packed


def _active_hooks():
    """The saved-tensor hooks already active (torch.utils.checkpoint's, a test's), or None. Private torch API
    (present in torch 2.8-2.13); without it the session cannot compose with them: a one-line error."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        raise RLAlignError(f"recompute: torch {torch.__version__} does not expose the active saved-tensor hooks; "
                           "turn recomputation off (rlalign.models.recompute.set_enabled(False))")
    return top(False)


def _under_checkpoint(outer) -> bool:
    return outer is not None and getattr(outer[0], "__module__", "") == "torch.utils.checkpoint"


@contextlib.contextmanager
def layer_session():
    """Around one decoder layer's forward: saved tensors registered inside are rebuilt in the backward."""
    if not (_ENABLED and torch.is_grad_enabled() and current_profile() is Profile.STRICT):
        yield
        return
    outer = _active_hooks()
    if _under_checkpoint(outer):
        yield
        return
    session = _Session(outer)
    token = _session.set(session)
    try:
        with torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack):
            yield
    finally:
        _session.reset(token)


def register(name: str, out: torch.Tensor, rebuild: Callable[[], torch.Tensor], *inputs: torch.Tensor) -> None:
    """``rebuild()`` recomputes ``out`` bit for bit from ``inputs`` (deterministic, no randomness); a save of
    ``out`` in the current layer session is replaced by this recipe. No session: nothing happens."""
    session = _session.get()
    if session is None or not out.numel():
        return
    session.recipes.append(_Recipe(name, out, rebuild, inputs))


def pack_count() -> int:
    """Saves replaced by recipes in this process so far (take a difference around a forward)."""
    return _PACKS


__all__ = ["set_enabled", "is_enabled", "disabled", "layer_session", "register", "pack_count"]
