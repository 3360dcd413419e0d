"""What every doctor check module shares: the check record and fresh random inputs from the run's generator."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass
class CheckResult:
    op: str
    invariance: str
    holds: bool
    seconds: float
    detail: str = ""


@dataclasses.dataclass
class Check:
    op: str
    invariance: str
    run: Callable[[torch.device, torch.Generator], "bool | tuple[bool, str]"]
    devices: tuple[str, ...] = ("cpu", "cuda")
    torch_backend_only: bool = False   # a library property only the torch backend relies on


def randn(gen: torch.Generator, *shape, device, dtype=torch.float32) -> torch.Tensor:
    """Standard normal values drawn on the CPU from ``gen`` (so a seed gives the same inputs on every device)."""
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
