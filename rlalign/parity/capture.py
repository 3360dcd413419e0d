"""Capture named intermediate tensors of any engine that runs rlalign ops.

Models call ``tap(name, tensor)`` (:mod:`rlalign.models.taps`, which also holds the table of
boundary names) at semantic boundaries; it returns its input and costs one global read unless a
:func:`capture` is active: an active capture is the recorder installed in that hook.

Row identity. A rollout computes a sequence's tokens over many forwards (prefill chunks, then one
token per decode step), a trainer in one packed forward; rows are matched by what determines
them: the token prefix. Each row gets a **prefix key**

    key(p) = blake2b-128(key(p-1) || int64 token at p),   key(-1) = b""

(positions start at 0 in every sequence). A packed forward chains keys along each sequence. A
paged forward (:class:`~rlalign.models.batch.ForwardBatch` with a KV cache) continues a sequence
whose earlier tokens live in the cache: the key of its previous token is found by the *content* of
the cache slot that holds it (bytes of the last layer's K and V at that slot, recorded after the
forward that wrote it), so copy-on-write page copies, prefix caching and page reuse need nothing
from the engine. Rows whose prefix cannot be resolved get a key that matches nothing.

Where the layout comes from: :func:`note_batch` (called by a model at the start of a forward with
its ForwardBatch) or, with ``capture(model=...)``, forward pre-hooks that find the ForwardBatch in
the arguments of the model's modules (taps made before it is seen -- the embedding -- are bound to
it when it arrives). Other engines describe their rows with :func:`note_rows`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
from typing import Iterable, Sequence

import torch

from rlalign.contract.bits import bit_view, bits_equal
from rlalign.models import taps
from rlalign.models.batch import ForwardBatch
from rlalign.models.taps import note_batch, tap  # re-exported: the hook models call

ROOT_KEY = b""


def _active() -> "Capture | None":
    recorder = taps.installed()
    return recorder if isinstance(recorder, Capture) else None


def note_rows(token_lists: Sequence[Sequence[int]], labels: Sequence | None = None) -> None:
    """Tell the active capture (if any) that the next taps hold whole sequences, packed in order
    (rows of sequence i follow those of sequence i-1; positions 0..len-1). ``labels`` name the
    sequences in reports (default: their index)."""
    cap = _active()
    if cap is not None:
        cap.begin_layout(packed_layout(token_lists, labels))


def capture_active() -> bool:
    return _active() is not None


# ---- row layouts ---------------------------------------------------------------------------------

@dataclasses.dataclass
class RowLayout:
    """Who the rows of one forward are: per row its prefix key, sequence label, position and token."""

    keys: list[bytes]
    labels: list
    positions: list[int]
    tokens: list[int]
    last_rows: list[int]          # per sequence of the forward, its last row

    @property
    def num_rows(self) -> int:
        return len(self.keys)


def chain_key(prev: bytes, token: int) -> bytes:
    return hashlib.blake2b(prev + int(token).to_bytes(8, "little", signed=True), digest_size=16).digest()


def prefix_keys(tokens: Sequence[int], start_key: bytes = ROOT_KEY) -> list[bytes]:
    keys, k = [], start_key
    for t in tokens:
        k = chain_key(k, t)
        keys.append(k)
    return keys


def packed_layout(token_lists: Sequence[Sequence[int]], labels: Sequence | None = None) -> RowLayout:
    labels = list(range(len(token_lists))) if labels is None else list(labels)
    layout = RowLayout([], [], [], [], [])
    for seq, label in zip(token_lists, labels):
        seq = [int(t) for t in seq]
        layout.keys += prefix_keys(seq)
        layout.labels += [label] * len(seq)
        layout.positions += list(range(len(seq)))
        layout.tokens += seq
        layout.last_rows.append(layout.num_rows - 1)
    return layout


_ORPHAN_COUNTER = iter(range(1 << 62))


def _orphan_key() -> bytes:
    """A key no real prefix has (its prefix is unknown to the capture)."""
    return b"orphan:" + next(_ORPHAN_COUNTER).to_bytes(8, "little")


# ---- the capture ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Record:
    name: str
    tensor: torch.Tensor                 # detached copy of the kept rows
    layout: RowLayout | None             # None: rows unknown (keyed by occurrence and row index)
    rows: list[int]                      # rows of the forward that ``tensor`` holds, in order
    occurrence: int                      # how many earlier records share the name


class Capture:
    """Records tapped tensors while active (use :func:`capture`)."""

    def __init__(self, names: Iterable[str] | None = None, positions: Iterable[int] | None = None,
                 device: str | torch.device | None = "cpu", model: torch.nn.Module | None = None):
        self.patterns = list(names) if names is not None else None
        self.positions = set(int(p) for p in positions) if positions is not None else None
        self.device = device
        self.model = model
        self.records: list[Record] = []
        self.order: list[str] = []            # names in order of first appearance
        self._count: dict[str, int] = {}
        self._layout: RowLayout | None = None
        self._batch = None                    # the last ForwardBatch seen, and its layout
        self._batch_layout: RowLayout | None = None
        self._awaiting = False
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._fingerprints: dict[bytes, bytes] = {}
        self._unregistered: tuple | None = None   # (batch, layout) whose KV slots are not fingerprinted yet
        self._hooks: list = []
        self._prev = None                     # the recorder this capture replaced (restored on exit)

    # -- activation
    def __enter__(self) -> "Capture":
        self._prev = taps.install(self)
        if self.model is not None:
            self._install_hooks(self.model)
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._flush_pending()
        taps.install(self._prev)

    def _install_hooks(self, model: torch.nn.Module) -> None:
        backbone = getattr(model, "model", None)
        embed = getattr(backbone, "embed_tokens", None)
        if embed is not None:
            self._hooks.append(embed.register_forward_pre_hook(lambda mod, args: self.await_layout()))
        for module in model.modules():
            self._hooks.append(module.register_forward_pre_hook(self._find_batch, with_kwargs=True))

    def _find_batch(self, module, args, kwargs) -> None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, ForwardBatch):
                self.begin_batch(a)
                return

    # -- layouts
    def await_layout(self) -> None:
        """A new forward starts; taps until its layout is known are held and bound to it."""
        self._awaiting = True
        self._layout = None

    def begin_batch(self, batch) -> None:
        """The next taps hold the rows of ``batch`` (a ForwardBatch). Seeing the same batch again
        (hooks and an explicit note in one forward) only rebinds it."""
        if batch is not self._batch:
            self._register_previous_slots()
            self._batch, self._batch_layout = batch, self._layout_of_batch(batch)
            if batch.kv_cache is not None:
                self._unregistered = (batch, self._batch_layout)
        if self._layout is not self._batch_layout:
            self.begin_layout(self._batch_layout)

    def begin_layout(self, layout: RowLayout) -> None:
        self._layout = layout
        self._awaiting = False
        pending, self._pending = self._pending, []
        for name, tensor in pending:
            self._store(name, tensor)

    def _layout_of_batch(self, batch) -> RowLayout:
        ids = batch.input_ids.tolist()
        pos = batch.positions.tolist()
        cu = batch.cu_seqlens.tolist()
        layout = RowLayout([], [], pos, ids, [b - 1 for b in cu[1:]])
        for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            if b == a:
                continue
            key = self._start_key(batch, s, pos[a])
            for r in range(a, b):
                key = chain_key(key, ids[r]) if key is not None else _orphan_key()
                layout.keys.append(key)
                layout.labels.append(s)
        return layout

    def _start_key(self, batch, seq: int, position: int) -> bytes | None:
        """Key of the prefix before ``position`` of the batch's sequence ``seq``."""
        if position == 0:
            return ROOT_KEY
        if batch.kv_cache is None or batch.block_table is None:
            return None
        ps = batch.kv_cache.page_size
        page = int(batch.block_table[seq, (position - 1) // ps])
        fp = _slot_fingerprints(batch.kv_cache, [page * ps + (position - 1) % ps])[0]
        return self._fingerprints.get(fp)

    def _register_previous_slots(self) -> None:
        """Fingerprint the KV slots the previous paged forward wrote (their content is final now)."""
        if self._unregistered is None:
            return
        batch, layout = self._unregistered
        self._unregistered = None
        slots = batch.slot_mapping.tolist()
        for fp, key in zip(_slot_fingerprints(batch.kv_cache, slots), layout.keys):
            if not key.startswith(b"orphan:"):
                self._fingerprints.setdefault(fp, key)

    # -- recording
    def wants(self, name: str) -> bool:
        return self.patterns is None or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def record(self, name: str, tensor: torch.Tensor) -> None:
        if not self.wants(name):
            return
        if self._awaiting:
            self._pending.append((name, tensor.detach().clone()))
            return
        self._store(name, tensor)

    def _flush_pending(self) -> None:
        pending, self._pending = self._pending, []
        self._awaiting = False
        for name, tensor in pending:
            self._store(name, tensor)

    def _store(self, name: str, tensor: torch.Tensor) -> None:
        layout = self._layout
        rows = self._row_indices(tensor, layout)
        data = tensor.detach()
        if rows is not None and len(rows) != data.shape[0]:
            data = data.index_select(0, torch.tensor(rows, dtype=torch.int64, device=data.device))
        data = data.to(self.device, copy=True) if self.device is not None else data.clone()
        occurrence = self._count.get(name, 0)
        self._count[name] = occurrence + 1
        if occurrence == 0:
            self.order.append(name)
        self.records.append(Record(name, data, layout if rows is not None else None,
                                   rows if rows is not None else list(range(data.shape[0] if data.dim() else 0)),
                                   occurrence))

    def _row_indices(self, tensor: torch.Tensor, layout: RowLayout | None) -> list[int] | None:
        """Rows of the forward held by ``tensor`` that pass the position filter; None if unknown."""
        if layout is None or tensor.dim() == 0:
            return None
        if tensor.shape[0] == layout.num_rows:
            rows = range(layout.num_rows)
        elif tensor.shape[0] == len(layout.last_rows):
            rows = layout.last_rows
        else:
            return None
        if self.positions is None:
            return list(rows)
        return [r for r in rows if layout.positions[r] in self.positions]

    # -- reading
    @property
    def names(self) -> list[str]:
        return list(self.order)

    def rows(self, name: str) -> "CapturedRows":
        """Every captured row of ``name``, one per distinct key (the first one seen)."""
        out = CapturedRows(name)
        for rec in self.records:
            if rec.name != name:
                continue
            for i, r in enumerate(rec.rows):
                if rec.layout is None:
                    key, info = b"row:%d:%d" % (rec.occurrence, r), RowInfo(None, None, None)
                else:
                    key = rec.layout.keys[r]
                    info = RowInfo(rec.layout.labels[r], rec.layout.positions[r], rec.layout.tokens[r])
                out.add(key, rec.tensor[i], info)
        return out


@dataclasses.dataclass(frozen=True)
class RowInfo:
    label: object         # sequence label (index in its batch unless labelled)
    position: int | None
    token: int | None


class CapturedRows:
    """Rows of one name keyed by prefix key: ``keys`` (first-seen order), ``info[key]``, ``tensor(keys)``."""

    def __init__(self, name: str):
        self.name = name
        self.keys: list[bytes] = []
        self.info: dict[bytes, RowInfo] = {}
        self._rows: dict[bytes, torch.Tensor] = {}
        self.duplicates_differ = 0      # rows seen twice with different bits (a side disagreeing with itself)

    def add(self, key: bytes, row: torch.Tensor, info: RowInfo) -> None:
        old = self._rows.get(key)
        if old is None:
            self.keys.append(key)
            self.info[key] = info
            self._rows[key] = row
        elif not bits_equal(old, row):
            self.duplicates_differ += 1

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self.keys)

    def tensor(self, keys: Sequence[bytes]) -> torch.Tensor:
        return torch.stack([self._rows[k] for k in keys])

    def row(self, key: bytes) -> torch.Tensor:
        return self._rows[key]


def capture(names: Iterable[str] | None = None, *, positions: Iterable[int] | None = None,
            model: torch.nn.Module | None = None, device: str | torch.device | None = "cpu") -> Capture:
    """Context manager recording tapped tensors as detached copies.

    ``names``: fnmatch patterns of the names to keep (default all, e.g. ``["layers.1.*", "logprob"]``);
    ``positions``: keep only rows at these absolute positions; ``model``: install forward hooks that
    find each forward's ForwardBatch (needed unless the model calls :func:`note_batch` itself);
    ``device``: where copies are kept (None: the tensor's device).
    """
    return Capture(names, positions, device, model)


def _slot_fingerprints(kv_cache, slots: list[int]) -> list[bytes]:
    """blake2b-128 of the raw bytes of what the last layer caches at each slot (its K and V, or its latent row)."""
    if not slots or not kv_cache.k:
        return [b"none"] * len(slots)
    idx = torch.tensor(slots, dtype=torch.int64, device=kv_cache.k[-1].device)
    rows = bit_view(kv_cache.slot_values(kv_cache.num_layers - 1, idx)).cpu().numpy()
    return [hashlib.blake2b(r.tobytes(), digest_size=16).digest() for r in rows]


__all__ = ["tap", "note_batch", "note_rows", "capture", "capture_active", "Capture", "CapturedRows", "RowInfo",
           "RowLayout", "Record", "packed_layout", "prefix_keys", "chain_key", "ROOT_KEY"]
