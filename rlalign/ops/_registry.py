"""The strict implementations by (op, backend): filled by the backends (``register``), read by
:mod:`rlalign.ops._dispatch`. A module of its own so that the backends and the dispatcher both import it
without importing each other."""

from __future__ import annotations

from typing import Callable

IMPLEMENTATIONS: dict[tuple[str, str], Callable] = {}


def register(op: str, backend: str):
    """Decorator: ``fn`` is the strict implementation of ``op`` on ``backend`` (``torch`` | ``triton``)."""
    def deco(fn):
        IMPLEMENTATIONS[(op, backend)] = fn
        return fn
    return deco
