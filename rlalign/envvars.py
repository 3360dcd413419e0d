"""Every ``RLALIGN_*`` environment variable rlalign reads, with its rule: the one place they are read.

Like a config key, each variable declares what it means, its default and the values it allows
(:data:`VARIABLES`); :func:`read` returns the parsed value and refuses anything else with one line naming the
variable and what is allowed (``RLALIGN_CPU_KERNELS='yes' is not allowed: it must be 0 or 1 (...)``). An empty
value counts as unset. :func:`check_environment` (run by the ``rlalign`` command before any work) checks every
``RLALIGN_*`` variable that is set, and refuses a name rlalign does not read (a typo would be ignored silently).

Rules whose allowed names live in an upper layer (the strict ops' names) get them through :func:`name_source`,
which that layer calls when it fills its registry. Each rule lists values it refuses (``EnvVar.bad``), which the
tests set one by one, so a new variable without a rule fails CI; a test also checks that no module reads an
``RLALIGN_*`` variable from ``os.environ`` past this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

from rlalign.contract.errors import RLAlignError

PREFIX = "RLALIGN_"


class EnvVarError(RLAlignError, ValueError):
    """An ``RLALIGN_*`` environment variable holds a value its rule refuses, or is not one rlalign reads."""


@dataclasses.dataclass(frozen=True)
class EnvVar:
    name: str
    meaning: str
    default: str                      # the value an unset (or empty) variable stands for
    allowed: str                      # completes "NAME must be ..."
    parse: Callable[[str], Any]       # the stripped text -> the value; ValueError when the rule refuses it
    bad: tuple[str, ...]              # values the rule refuses (the tests set each one)


_NAME_SOURCES: dict[str, Callable[[], Iterable[str]]] = {}


def name_source(variable: str, names: Callable[[], Iterable[str]]) -> None:
    """Let ``variable``'s rule check its comma-separated names against ``names()`` (called at each read)."""
    _NAME_SOURCES[variable] = names


def _choice(*choices: str, lower: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.lower() if lower else text
        if value not in choices:
            raise ValueError(text)
        return value
    return parse


def _switch(on: tuple[str, ...], off: tuple[str, ...]) -> Callable[[str], bool]:
    def parse(text: str) -> bool:
        value = text.lower()
        if value in on:
            return True
        if value in off:
            return False
        raise ValueError(text)
    return parse


def _positive_ints(count: int) -> Callable[[str], "tuple[int, ...] | None"]:
    def parse(text: str) -> "tuple[int, ...] | None":
        if not text:
            return None
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != count or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(text)
        return tuple(int(p) for p in parts)
    return parse


def _op_names(variable: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        names = [n.strip() for n in text.split(",") if n.strip()]
        known = _NAME_SOURCES.get(variable)
        allowed = set(known()) if known is not None else None
        if any(not re.fullmatch(r"[a-z0-9_]+", n) or (allowed is not None and n not in allowed) for n in names):
            raise ValueError(text)
        return ",".join(names)
    return parse


def _directory(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_absolute() or (path.exists() and not path.is_dir()):
        raise ValueError(text)
    return path


def _names_description(var: "EnvVar") -> str:
    """What a variable whose names come from a :func:`name_source` allows, with the names registered now."""
    return f"{var.allowed} ({', '.join(sorted(_NAME_SOURCES[var.name]()))})"


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("RLALIGN_BACKEND", "the backend of every strict op; unset: triton on a CUDA device where it imports, else "
           "torch", "", "torch or triton", _choice("", "torch", "triton"), ("tourch", "cuda", "Triton")),
    EnvVar("RLALIGN_TRITON_DISABLE", "strict ops sent to the torch backend on CUDA, for debugging; docs/gpu.md", "",
           "comma-separated strict op names", _op_names("RLALIGN_TRITON_DISABLE"),
           ("linaer", "rope,bogus", "rope;sample")),
    EnvVar("RLALIGN_TRITON_GEMM_TILE", "one GEMM tile BM,BN,warps,stages for every M, a safety switch; docs/gpu.md",
           "", "four comma-separated integers >= 1 (BM,BN,warps,stages)", _positive_ints(4),
           ("128,128", "128,128,8,x", "0,128,8,4")),
    EnvVar("RLALIGN_TRITON_ATTN_TILE", "one attention tile BM,warps,stages for prefill and decode; docs/gpu.md", "",
           "three comma-separated integers >= 1 (BM,warps,stages)", _positive_ints(3), ("64,4", "x", "64,0,2")),
    EnvVar("RLALIGN_TRITON_GEMM_WS", "the warp-specialised Gluon GEMM kernel on Hopper GPUs; docs/gpu.md", "1",
           "0 (off) or 1 (on, the default)", _switch(("1",), ("0",)), ("yes", "2", "off")),
    EnvVar("RLALIGN_CPU_KERNELS", "the compiled C kernels of the CPU strict path; 0 runs the torch formulation, the "
           "same bits, slower; docs/cpu.md", "1", "0 (off) or 1 (on, the default)", _switch(("1",), ("0",)),
           ("yes", "2", "off")),
    EnvVar("RLALIGN_CPU_CROSS_MACHINE", "strict CPU runs with the same bits on every x86-64 CPU with AVX2: MKL pinned "
           "to its COMPATIBLE branch, the compiled kernels as the strict linear and fixed-order reductions; docs/cpu.md", "0",
           "0 (off, the default) or 1 (on)", _switch(("1",), ("0",)), ("yes", "2", "on")),
    EnvVar("RLALIGN_CACHE_DIR", "where the compiled CPU kernels are cached", "~/.cache/rlalign",
           "an absolute directory path (~ expanded; created when missing)", _directory, ("relative/dir", "/dev/null")),
    EnvVar("RLALIGN_CHECKS", "the strict ops' finiteness checks; auto: per-op on the CPU, boundary on GPUs; "
           "docs/gpu.md", "auto", "per-op, boundary or auto", _choice("per-op", "boundary", "auto", lower=True),
           ("sometimes", "perop", "1")),
    EnvVar("RLALIGN_VLLM", "rlalign's vLLM plugin in vLLM processes; docs/vllm.md", "0",
           "1, true, yes, on or strict (on) or 0, false, no or off", _switch(("1", "true", "yes", "on", "strict"),
                                                                          ("0", "false", "no", "off")),
           ("maybe", "2", "enabled")),
)}


def read(name: str):
    """The value of the registered variable ``name`` (its default when unset or empty), checked by its rule."""
    raw = os.environ.get(name)
    text = raw.strip() if raw is not None and raw.strip() else VARIABLES[name].default
    try:   # parsed at every read (no memo): a rule may depend on state that changes (the registered ops, HOME)
        return VARIABLES[name].parse(text)
    except ValueError:
        raise EnvVarError(_refusal(VARIABLES[name], raw)) from None


def _refusal(var: EnvVar, raw: "str | None") -> str:
    allowed = _names_description(var) if var.name in _NAME_SOURCES else var.allowed
    return f"{var.name}={raw!r} is not allowed: it must be {allowed}; fix or unset it ({var.name}: {var.meaning})"


def check_environment(environ: "dict[str, str] | None" = None) -> None:
    """Every ``RLALIGN_*`` variable set in the environment is one rlalign reads, with a value its rule allows."""
    for name in sorted(n for n in (os.environ if environ is None else environ) if n.startswith(PREFIX)):
        if name not in VARIABLES:
            near = difflib.get_close_matches(name, list(VARIABLES), n=1)
            hint = f"did you mean {near[0]}?" if near else f"the variables are {', '.join(VARIABLES)}"
            raise EnvVarError(f"{name} is set, but rlalign reads no such environment variable; {hint} "
                              "(unset it)")
        read(name)


__all__ = ["EnvVar", "EnvVarError", "VARIABLES", "PREFIX", "read", "check_environment", "name_source"]
