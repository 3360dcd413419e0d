"""Bitwise comparison of two captures, boundary by boundary, and of two sets of token logprobs.

Elements are compared as raw bits (:mod:`rlalign.contract.bits`: -0.0 != +0.0, and NaNs with different
payloads differ).
Distances are in ULPs of the tensor's dtype: a float's bit pattern ``i`` (sign-magnitude) maps to
the ordered integer ``i`` if the sign bit is clear, else ``-1 - (i & magnitude_mask)``; the ULP
distance is the difference of ordered integers (so +0.0 and -0.0 are 1 ULP apart, and adjacent
floats of the same sign are 1 apart).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import torch

from rlalign.contract.bits import bit_view, differing
from rlalign.models.taps import EMBED, FINAL_NORM, LAYER_BOUNDARIES, LOGPROB
from rlalign.parity.capture import Capture, CapturedRows

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")


def split_name(name: str) -> tuple[int | None, str]:
    """``"layers.3.mlp"`` -> (3, "mlp"); ``"embed"`` -> (None, "embed")."""
    m = _LAYER_NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def forward_order(names: Sequence[str]) -> list[str]:
    """Names in the order a forward computes them: embed, layer 0 (input_norm, q, k, v, attn, o_proj,
    residual, post_norm, mlp), layer 1, ..., final_norm, logprob; other names after their layer."""
    appearance = {n: i for i, n in enumerate(names)}

    def key(name: str):
        layer, boundary = split_name(name)
        if layer is not None:
            rank = LAYER_BOUNDARIES.index(boundary) if boundary in LAYER_BOUNDARIES else len(LAYER_BOUNDARIES)
            return (1, layer, rank, appearance[name])
        group = {EMBED: 0, FINAL_NORM: 2, LOGPROB: 3}.get(name, 4)
        return (group, 0, 0, appearance[name])

    return sorted(names, key=key)


def ordered_ints(t: torch.Tensor) -> torch.Tensor:
    """Map floats to int64 so that ULP distance = difference (see module docstring)."""
    if not t.is_floating_point():
        return t.to(torch.int64)
    i = bit_view(t).to(torch.int64)
    mag = i & ((1 << (8 * t.element_size() - 1)) - 1)   # the magnitude bits under the sign bit
    return torch.where(i < 0, -1 - mag, i)


@dataclasses.dataclass
class Divergence:
    """The first differing element of a boundary (earliest position, then sequence, then feature)."""

    name: str
    layer: int | None
    boundary: str
    sequence: object
    position: int | None
    token: int | None
    feature: list[int]
    value_a: float
    value_b: float
    ulp: int
    key: str = ""             # hex prefix key of the row (identifies the token prefix)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("key")
        return d

    def describe(self) -> str:
        where = f"layer {self.layer} {self.boundary}" if self.layer is not None else self.boundary
        return (f"{where} ({self.name}), sequence {self.sequence} position {self.position} (token {self.token}), "
                f"feature {tuple(self.feature)}: {self.value_a!r} vs {self.value_b!r} ({self.ulp} ulp)")


@dataclasses.dataclass
class BoundaryDiff:
    name: str
    layer: int | None
    boundary: str
    rows: int                 # rows present on both sides
    elements: int
    mismatches: int
    max_ulp: int
    first: Divergence | None
    note: str = ""            # why it was not compared ("only in a", "shape differs", ...)
    duplicates_differ: int = 0  # rows one side computed twice with different bits (it disagrees with itself)

    @property
    def compared(self) -> bool:
        return not self.note

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["first"] = self.first.as_dict() if self.first else None
        return d


@dataclasses.dataclass
class CaptureComparison:
    verdict: str                      # "identical" | "localized" | "not comparable"
    reason: str
    boundaries: list[BoundaryDiff]
    first_divergence: Divergence | None

    @property
    def identical(self) -> bool:
        return self.verdict == "identical"

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "reason": self.reason,
                "first_divergence": self.first_divergence.as_dict() if self.first_divergence else None,
                "boundaries": [b.as_dict() for b in self.boundaries]}


def compare_rows(a: CapturedRows, b: CapturedRows) -> BoundaryDiff:
    """Compare the rows both captures hold for one name (rows matched by prefix key)."""
    layer, boundary = split_name(a.name)
    keys = [k for k in a.keys if k in b]
    if not keys:
        return BoundaryDiff(a.name, layer, boundary, 0, 0, 0, 0, None, note="no common rows")
    ta, tb = a.tensor(keys), b.tensor(keys)
    if ta.shape != tb.shape and ta[0].numel() == tb[0].numel():
        ta, tb = ta.reshape(len(keys), -1), tb.reshape(len(keys), -1)  # same row, other view ([T, H*D] vs [T, H, D])
    if ta.shape != tb.shape or ta.dtype != tb.dtype:
        return BoundaryDiff(a.name, layer, boundary, len(keys), 0, 0, 0, None,
                            note=f"shape/dtype differ: {tuple(ta.shape[1:])} {ta.dtype} vs {tuple(tb.shape[1:])} {tb.dtype}")
    diff = differing(ta, tb)
    count = int(diff.sum())
    result = BoundaryDiff(a.name, layer, boundary, len(keys), ta.numel(), count, 0, None,
                          duplicates_differ=a.duplicates_differ + b.duplicates_differ)
    if count == 0:
        return result
    ulps = (ordered_ints(ta) - ordered_ints(tb)).abs()
    result.max_ulp = int(ulps[diff].max())
    row_has = diff.reshape(len(keys), -1).any(dim=1).nonzero().flatten().tolist()
    row = min(row_has, key=lambda r: (_pos_key(a.info[keys[r]].position), str(a.info[keys[r]].label), r))
    feature_flat = int(diff[row].reshape(-1).nonzero()[0])
    feature = list(torch.unravel_index(torch.tensor(feature_flat), ta.shape[1:])) if ta.dim() > 1 else []
    info = a.info[keys[row]]
    va, vb = ta[row].reshape(-1)[feature_flat], tb[row].reshape(-1)[feature_flat]
    result.first = Divergence(a.name, layer, boundary, info.label, info.position, info.token,
                              [int(f) for f in feature], float(va), float(vb),
                              int(ulps[row].reshape(-1)[feature_flat]), keys[row].hex())
    return result


def _pos_key(position: int | None) -> float:
    return math.inf if position is None else position


def compare_captures(a: Capture, b: Capture, *, weights_hash_a: str | None = None,
                     weights_hash_b: str | None = None, names: Sequence[str] | None = None,
                     labels: tuple[str, str] = ("a", "b")) -> CaptureComparison:
    """Compare every name both captures hold, in forward order; the verdict:

    ``not comparable`` when the weights hashes differ (if given) or no row of any name is on both
    sides (different tokens); ``identical`` when every compared element has the same bits;
    ``localized`` otherwise, with the first divergence = the first boundary in forward order that
    differs, at its earliest (position, sequence) row and first feature.
    """
    if weights_hash_a and weights_hash_b and weights_hash_a != weights_hash_b:
        return CaptureComparison("not comparable", f"different weights (hash {weights_hash_a[:12]} vs "
                                 f"{weights_hash_b[:12]})", [], None)
    wanted = names if names is not None else list(dict.fromkeys(a.order + b.order))
    diffs = []
    for name in forward_order(list(wanted)):
        if name not in a.order or name not in b.order:
            layer, boundary = split_name(name)
            side = labels[0] if name in a.order else labels[1]
            diffs.append(BoundaryDiff(name, layer, boundary, 0, 0, 0, 0, None, note=f"only in {side}"))
            continue
        diffs.append(compare_rows(a.rows(name), b.rows(name)))
    compared = [d for d in diffs if d.compared]
    if not compared:
        return CaptureComparison("not comparable", "no (sequence, position) row was captured on both sides "
                                 "(different tokens, or nothing captured)", diffs, None)
    first = next((d.first for d in compared if d.mismatches), None)
    if first is None:
        return CaptureComparison("identical", f"{sum(d.elements for d in compared)} elements in "
                                 f"{len(compared)} boundaries have identical bits", diffs, None)
    return CaptureComparison("localized", f"first divergence: {first.describe()}", diffs, first)


# ---- token logprobs --------------------------------------------------------------------------------

@dataclasses.dataclass
class TokenMismatch:
    sequence: int
    index: int            # index of the generated token within its completion
    position: int         # absolute position of the token
    token: int
    rollout: float
    train: float

    @property
    def abs_diff(self) -> float:
        return abs(self.rollout - self.train)


@dataclasses.dataclass
class TokenComparison:
    tokens_compared: int
    mismatches: int
    max_abs_diff: float
    mean_abs_diff: float
    abs_diffs: list[float]                 # |rollout - train| of every compared token, in order
    first: TokenMismatch | None            # earliest position, then sequence
    not_comparable: str = ""               # reason, when the two sides cannot be compared

    @property
    def ok(self) -> bool:
        return not self.not_comparable and self.mismatches == 0


def compare_logprobs(rollout: Sequence[Sequence[float]], train: Sequence[Sequence[float]],
                     tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> TokenComparison:
    """Bitwise comparison of per-token logprobs (fp32 bits) of each completion."""
    if len(rollout) != len(train):
        return TokenComparison(0, 0, 0.0, 0.0, [], None, f"{len(rollout)} rollout vs {len(train)} train sequences")
    diffs: list[float] = []
    mismatches: list[TokenMismatch] = []
    for s, (r, t, toks, plen) in enumerate(zip(rollout, train, tokens, prompt_lens)):
        if len(r) != len(t):
            return TokenComparison(0, 0, 0.0, 0.0, [], None,
                                   f"sequence {s}: {len(r)} rollout vs {len(t)} train logprobs")
        ra, ta = torch.tensor(list(r), dtype=torch.float32), torch.tensor(list(t), dtype=torch.float32)
        d = (ra.double() - ta.double()).abs()
        diffs += d.tolist()
        for i in differing(ra, ta).nonzero().flatten().tolist():
            mismatches.append(TokenMismatch(s, i, plen + i, int(toks[i]), float(ra[i]), float(ta[i])))
    first = min(mismatches, key=lambda m: (m.position, m.sequence)) if mismatches else None
    finite = [x for x in diffs if math.isfinite(x)]
    return TokenComparison(len(diffs), len(mismatches), max(finite, default=0.0),
                           (sum(finite) / len(finite)) if finite else 0.0, diffs, first)


__all__ = ["compare_captures", "compare_rows", "compare_logprobs", "CaptureComparison", "BoundaryDiff",
           "Divergence", "TokenComparison", "TokenMismatch", "ordered_ints", "forward_order",
           "split_name", "LAYER_BOUNDARIES"]
