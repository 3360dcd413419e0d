"""The checkpoint layout of a model's parameters: one owner of the map between the tensors a model holds
and the tensors a Hugging Face checkpoint names.

Most parameters are checkpoint tensors as they are (same name, same shape). A module that stores several
checkpoint tensors in one parameter (a sparse layer's experts: ``experts.gate_proj`` [E, I, H] holds the
checkpoint's ``experts.{e}.gate_proj.weight`` [I, H] for every e) declares it with
``checkpoint_entries() -> [(checkpoint suffix, parameter suffix, index along dim 0)]`` in checkpoint order;
expert e's tensor is then the view ``param[e]`` (no copy). Every name-based consumer goes through here:
checkpoint load/save (models.checkpoint), :func:`rlalign.models.checkpoint.weights_hash`, the random
init, the gradient norm (the norm over the checkpoint's tensors, so it has the same bits whether experts
are stacked or not, sharded or not) and the vLLM plugin's weight loader.

Order: the model's parameter order, a stacking module's entries expanded where its first parameter sits
(for the experts: expert 0's gate, up, down, then expert 1's, ...: the order of the per-expert modules the
model used to hold, so norms, random draws and hashes over this order kept their bits).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
from torch import nn


class Entry(NamedTuple):
    checkpoint_name: str       # the Hugging Face tensor name
    param_name: str            # the model parameter that holds it
    index: int | None          # its index along the parameter's dim 0 (None: the whole parameter)


def checkpoint_entries(model: nn.Module) -> list[Entry]:
    """Every checkpoint tensor of ``model``, in order (see the module docstring)."""
    owners = {prefix: m for prefix, m in model.named_modules() if hasattr(m, "checkpoint_entries")}
    out: list[Entry] = []
    expanded: set[str] = set()
    for name, _ in model.named_parameters():
        prefix, _, _ = name.rpartition(".")
        owner = owners.get(prefix)
        if owner is None:
            out.append(Entry(name, name, None))
        elif prefix not in expanded:
            expanded.add(prefix)
            out.extend(Entry(f"{prefix}.{ck}", f"{prefix}.{param}", index)
                       for ck, param, index in owner.checkpoint_entries())
    return out


def entry_view(tensor: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The checkpoint tensor ``entry`` inside ``tensor`` (its parameter, or a tensor of the parameter's shape
    such as its gradient): a view, never a copy."""
    return tensor if entry.index is None else tensor[entry.index]


def checkpoint_split(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, view) of every checkpoint tensor whose parameter is in ``tensors`` (parameter name ->
    a tensor of its shape: the parameters, their gradients, gathered full tensors under TP), in order."""
    for entry in checkpoint_entries(model):
        t = tensors.get(entry.param_name)
        if t is not None:
            yield entry.checkpoint_name, entry_view(t, entry)


def checkpoint_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, view of the parameter) of every checkpoint tensor; writing a view writes the model."""
    return checkpoint_split(model, dict(model.named_parameters()))


def stack_checkpoint_names(model: nn.Module, named: Mapping[str, object]) -> dict[str, object]:
    """``named`` (name -> value) with the checkpoint tensors that stacking parameters hold (per-expert names:
    what run checkpoints stored before the experts were stacked) replaced by their parameter: tensors stacked
    along a new dim 0 in index order, other values (e.g. a dtype name) kept once. Other names pass as they
    are. Raises ValueError naming a parameter whose pieces are incomplete."""
    stacking = {e.checkpoint_name: e for e in checkpoint_entries(model) if e.index is not None}
    counts: dict[str, int] = {}
    for e in stacking.values():
        counts[e.param_name] = counts.get(e.param_name, 0) + 1
    out: dict[str, object] = {}
    pieces: dict[str, dict[int, object]] = {}
    for name, value in named.items():
        entry = stacking.get(name)
        if entry is None:
            out[name] = value
        else:
            pieces.setdefault(entry.param_name, {})[entry.index] = value
    for param, parts in pieces.items():
        if len(parts) != counts[param]:
            missing = min(set(range(counts[param])) - set(parts))
            raise ValueError(f"{param}: piece {missing} of {counts[param]} is missing")
        ordered = [parts[i] for i in range(counts[param])]
        out[param] = torch.stack(ordered) if isinstance(ordered[0], torch.Tensor) else ordered[0]
    return out


__all__ = ["Entry", "checkpoint_entries", "entry_view", "checkpoint_split", "checkpoint_tensors",
           "stack_checkpoint_names"]
