"""``task.env`` -> a factory of environments: a built-in name, ``module:Class`` or ``file.py:Class``.

As with a reward given by import path, the module is the user's code, imported and run with the user's rights in
the trainer's process (docs/agents.md); nothing in a run or model directory is ever imported (the config names the
file). ``task.env_args`` are the keyword arguments of each episode's ``Class(**env_args)``; the factory is tried
once here so a bad argument is a one-line error before training. Every problem is one :class:`EnvError` line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from rlalign.contract.errors import one_line
from rlalign.envs.base import EnvError
from rlalign.envs.builtin import BUILTIN_ENVS
from rlalign.tasks.user_code import import_user_attr

_FILE_MODULE_PREFIX = "rlalign_user_env_"


def env_is_code(spec: "str | None") -> bool:
    """Whether ``task.env`` names code to import (``module:Class`` or ``file.py:Class``), not a built-in or unset."""
    return isinstance(spec, str) and spec.strip() not in BUILTIN_ENVS


def env_source_file(spec: "str | None") -> "Path | None":
    """The ``.py`` file a ``file.py:Class`` env imports (relative to the current directory), else None."""
    module_name, sep, _ = spec.strip().rpartition(":") if isinstance(spec, str) else ("", "", "")
    return Path(module_name) if sep and module_name.endswith(".py") else None


def env_class(spec: str) -> Callable:
    """The class (or factory function) ``spec`` names."""
    if not isinstance(spec, str) or not spec.strip():
        raise EnvError(f"env {spec!r}: expected a built-in name ({', '.join(BUILTIN_ENVS)}) or 'module:Class'")
    spec = spec.strip()
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise EnvError(f"env {spec!r}: not a built-in name ({', '.join(BUILTIN_ENVS)}) and not of the form "
                       "'module:Class' or 'file.py:Class'")
    obj = import_user_attr(f"env {spec!r}", module_name, attr, _FILE_MODULE_PREFIX, EnvError)
    if not callable(obj):
        raise EnvError(f"env {spec!r}: {attr!r} is a {type(obj).__name__}, not a class")
    return obj


def load_env(spec: str, env_args: "Mapping | None" = None) -> Callable[[], object]:
    """A factory of fresh environments (one per episode), tried once: it must build an object with ``reset`` and
    ``step``."""
    cls, kwargs = env_class(spec), dict(env_args or {})

    def factory():
        try:
            env = cls(**kwargs)
        except Exception as e:
            raise EnvError(f"env {spec!r}: {getattr(cls, '__name__', cls)}(**{kwargs}) raised {one_line(e)}") from e
        missing = [m for m in ("reset", "step", "final_reward") if not callable(getattr(env, m, None))]
        if missing:
            raise EnvError(f"env {spec!r}: {type(env).__name__} has no {', '.join(missing)} method "
                           "(subclass rlalign.envs.Env)")
        return env

    factory()
    return factory


__all__ = ["env_class", "env_is_code", "env_source_file", "load_env"]
