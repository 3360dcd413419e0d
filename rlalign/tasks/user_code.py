"""The user's code a config names (``module:attr`` or ``file.py:attr``: rewards, environments), imported.

Such code runs with the user's rights in the trainer's process; the callers decide what may be named (never a
file inside a run or model directory, docs/reliability.md). A ``file.py`` module is registered in ``sys.modules``
under ``prefix`` + a hash of its resolved path, so the callers can tell their users' modules from installed ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from rlalign.contract.errors import RLAlignError, one_line


def file_module_name(prefix: str, file: Path) -> str:
    return f"{prefix}{abs(hash(str(Path(file).resolve())))}"


def import_user_module(what: str, module_name: str, prefix: str, error: type[RLAlignError]) -> ModuleType:
    """Import ``module_name`` (a dotted module or a ``.py`` file path); every failure is one ``error`` line that
    starts with ``what`` (e.g. ``reward 'my.py:score'``)."""
    if module_name.endswith(".py"):
        file = Path(module_name)
        if not file.is_file():
            raise error(f"{what}: file {module_name!r} not found")
        name = file_module_name(prefix, file)
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise error(f"{what}: importing {module_name!r} failed: {one_line(e)}") from e
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise error(f"{what}: module {module_name!r} not found") from e
        raise error(f"{what}: importing {module_name!r} failed: {one_line(e)}") from e
    except Exception as e:
        raise error(f"{what}: importing {module_name!r} failed: {one_line(e)}") from e


def import_user_attr(what: str, module_name: str, attr: str, prefix: str, error: type[RLAlignError]):
    """``module_name``'s attribute ``attr`` (dotted: ``Outer.inner``), imported as :func:`import_user_module` does."""
    obj = import_user_module(what, module_name, prefix, error)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{what}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


__all__ = ["file_module_name", "import_user_attr", "import_user_module"]
