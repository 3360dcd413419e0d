"""The strict implementations by (op, backend): filled by the backends (``register``), read by
:mod:`rlalign.ops._dispatch`. A module of its own so that the backends and the dispatcher both import it
without importing each other."""

from __future__ import annotations

from typing import Callable

from rlalign import envvars

IMPLEMENTATIONS: dict[tuple[str, str], Callable] = {}


def register(op: str, backend: str):
    """Decorator: ``fn`` is the strict implementation of ``op`` on ``backend`` (``torch`` | ``triton``)."""
    def deco(fn):
        IMPLEMENTATIONS[(op, backend)] = fn
        return fn
    return deco


# Ops whose results must agree bit for bit, so one backend must run all of them: the packed forward rotates with
# ``rope``, the paged one with ``rope_write_kv``; ``linear_group``'s outputs are ``linear``'s (a forward with or
# without grad). RLALIGN_TRITON_DISABLE naming one of a group disables the group.
SAME_BACKEND = (frozenset({"rope", "rope_write_kv"}), frozenset({"linear", "linear_group"}))


def disabled_ops(names: str) -> frozenset[str]:
    """The ops ``RLALIGN_TRITON_DISABLE`` (comma-separated names) sends to the torch backend, with the rest of
    each :data:`SAME_BACKEND` group any of them is in."""
    ops = {op.strip() for op in names.split(",") if op.strip()}
    for group in SAME_BACKEND:
        if ops & group:
            ops |= group
    return frozenset(ops)


# RLALIGN_TRITON_DISABLE may name any registered strict op (rlalign.envvars checks its value against them)
envvars.name_source("RLALIGN_TRITON_DISABLE", lambda: {op for op, _ in IMPLEMENTATIONS})
