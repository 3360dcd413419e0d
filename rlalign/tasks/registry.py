"""Reward functions by name or import path, and safe scoring.

A reward function scores one sample, ``fn(prompt: str, completion: str, answer: str, **fields) -> float``, or a
whole batch with TRL's signature, ``fn(prompts: list[str], completions: list[str], **columns) -> list[float]`` (its
first two parameters named ``prompts`` and ``completions``, :func:`is_batched`; ``columns`` holds ``answer`` and the
rows' other fields, one list each). :func:`load_reward` accepts a built-in name (:data:`BUILTIN_REWARDS`), an import path
``"package.module:function"`` (a dotted attribute after the colon is allowed:
``"mod:Class.method"``), or a file path ``"path/to/file.py:function"``. Every load problem is a
one-line :class:`RewardLoadError` naming the path. :func:`score` calls a reward on a batch and
turns an exception (``sys.exit`` included), a non-numeric return or a value outside
``[-REWARD_LIMIT, REWARD_LIMIT]`` (NaN and +-inf included) into a :class:`RewardError` naming
the reward by its file and line, the sample (index and prompt excerpt) and, for an exception, the
file and line that raised it. :func:`call_reward` is that check for one sample, shared by
:func:`score` (in this process) and the reward worker (:mod:`rlalign.tasks.reward_worker`, where the
trainer runs rewards).

Security: a reward given as ``module:function`` or ``file.py:function`` is imported and run with the
user's rights, by design (docs/reliability.md); the trainer runs it in a process of its own.
"""

from __future__ import annotations

from rlalign.contract.errors import RLAlignError, one_line
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sysconfig
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlalign.tasks.arithmetic import arithmetic_reward
from rlalign.tasks.user_code import import_user_attr
from rlalign.tasks.rewards import (gsm8k_reward, gsm8k_reward_fallback, gsm8k_reward_last_number, math_reward,
                                   math_verify_reward)

RewardFn = Callable[[str, str, str], float]
# Largest |reward| accepted: group statistics (squares, sums) must stay finite in fp32 (max ~3.4e38).
REWARD_LIMIT = 1e9
_FILE_MODULE_PREFIX = "rlalign_user_reward_"

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "arithmetic": arithmetic_reward,
    "gsm8k": gsm8k_reward,
    "gsm8k_fallback": gsm8k_reward_fallback,
    "gsm8k_last_number": gsm8k_reward_last_number,
    "math": math_reward,
    "math_verify": math_verify_reward,   # needs the math-verify package (checked at load)
}


class RewardLoadError(RLAlignError, ValueError):
    """A reward function could not be loaded; the one-line message names the path."""


class RewardError(RLAlignError, ValueError):
    """A reward function raised or returned a non-finite / non-numeric value on a sample."""


def keyword_filter(reward_fn) -> Callable[[Mapping[str, Any]], dict]:
    """Which of a row's extra fields the reward takes: every one with ``**kwargs``, else its keyword-capable
    parameters past the first three (prompt, completion, answer)."""
    try:
        params = list(inspect.signature(reward_fn).parameters.values())
    except (TypeError, ValueError):   # a builtin or C function: the plain signature
        return lambda extra: {}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict
    names = {p.name for p in params[3:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return lambda extra: {k: v for k, v in extra.items() if k in names}


def is_batched(reward_fn) -> bool:
    """Whether ``reward_fn`` takes the whole batch (TRL's signature): its first two parameters are named
    ``prompts`` and ``completions`` (TRL passes them by these names)."""
    try:
        params = list(inspect.signature(reward_fn).parameters)
    except (TypeError, ValueError):
        return False
    return params[:2] == ["prompts", "completions"]


def batch_keyword_filter(reward_fn) -> Callable[[Mapping[str, list]], dict]:
    """Which columns a batched reward takes: every one with ``**kwargs``, else those it names."""
    params = list(inspect.signature(reward_fn).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict
    names = {p.name for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return lambda columns: {k: v for k, v in columns.items() if k in names}


def batch_columns(answers: Sequence[str], extras: "Sequence[Mapping[str, Any]] | None") -> dict[str, list]:
    """The columns a batched reward receives: ``answer`` and each extra field, one value per sample (None where a
    sample's row lacks the field)."""
    columns: dict[str, list] = {"answer": list(answers)}
    for key in dict.fromkeys(k for e in (extras or ()) for k in e):
        columns.setdefault(key, [e.get(key) for e in extras])
    return columns


def batch_label(name: str, prompts: Sequence[str]) -> str:
    """How a reward error names a batched call: ``reward NAME on a batch of N samples (first prompt '...')``."""
    first = f" (first prompt {_excerpt(prompts[0])})" if prompts else ""
    return f"reward {name} on a batch of {len(prompts)} samples{first}"


def reward_is_code(spec: str) -> bool:
    """Whether ``spec`` names code to import (``module:function`` or ``file.py:function``), not a built-in."""
    return isinstance(spec, str) and spec.strip() not in ("builtin", *BUILTIN_REWARDS)


def reward_source_file(spec: str) -> "Path | None":
    """The ``.py`` file a ``file.py:function`` reward imports (as :func:`load_reward` resolves it: relative to
    the current directory), None for a built-in or ``module:function`` reward."""
    module_name, sep, _ = spec.strip().rpartition(":") if isinstance(spec, str) else ("", "", "")
    return Path(module_name) if sep and module_name.endswith(".py") else None


def load_reward(spec: str) -> RewardFn:
    """Resolve a built-in name, ``module:function`` or ``file.py:function`` to a callable."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardLoadError(f"reward {spec!r}: expected a built-in name "
                              f"({', '.join(BUILTIN_REWARDS)}) or 'module:function'")
    spec = spec.strip()
    if spec == "math_verify" and importlib.util.find_spec("math_verify") is None:
        raise RewardLoadError("reward 'math_verify' needs the math-verify package, which is not installed here: "
                              "pip install math-verify (or use task.reward=math, rlalign's own parser)")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardLoadError(f"reward {spec!r}: not a built-in name ({', '.join(BUILTIN_REWARDS)}) "
                              f"and not of the form 'module:function'")
    obj = import_user_attr(f"reward {spec!r}", module_name, attr, _FILE_MODULE_PREFIX, RewardLoadError)
    if not callable(obj):
        raise RewardLoadError(f"reward {spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def _excerpt(text: str, limit: int = 60) -> str:
    return repr(_shorten(text, limit))


def sample_label(name: str, index: int, prompt: str) -> str:
    """How a reward error names the call: ``reward NAME on sample I (prompt '...')``."""
    return f"reward {name} on sample {index} (prompt {_excerpt(prompt)})"


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def reward_name(fn: Callable) -> str:
    """``module:function``, or ``path/to/file.py:line:function`` for a reward loaded from a file."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    if module and module.startswith(_FILE_MODULE_PREFIX):
        try:
            return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}:{name}"
        except (TypeError, OSError):
            pass
    return f"{module}:{name}" if module else name


def _raised_at(exc: BaseException) -> str:
    """`` at file.py:line`` of the innermost frame of the traceback that is the user's code (where the reward raised,
    or called the library that did): frames of the standard library and of installed packages are skipped -- a
    package may wrap ``sys.exit`` (W&B does) or raise on the reward's behalf. The innermost frame when every frame
    is a library's."""
    frames = traceback.extract_tb(exc.__traceback__)
    if len(frames) <= 1:
        return ""
    own = [f for f in frames if not _library_file(f.filename)]
    frame = own[-1] if own else frames[-1]
    return f" at {frame.filename}:{frame.lineno}"


def _library_file(filename: str) -> bool:
    """A file of the standard library or an installed package (or frozen / generated code)."""
    if filename.startswith("<"):
        return True
    path = os.path.realpath(filename)
    return any(path.startswith(os.path.realpath(root) + os.sep) for root in _LIBRARY_ROOTS)


_LIBRARY_ROOTS = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")})


def _as_float(value: object) -> float | None:
    if isinstance(value, (numbers.Real, np.bool_)):
        return float(value)
    return None


def call_reward(reward_fn: RewardFn, where: str, prompt: str, completion: str, answer: str, keywords: Mapping,
                catch: tuple = (Exception,)) -> float:
    """``float(reward_fn(prompt, completion, answer, **keywords))``, checked; ``where`` is the call's
    :func:`sample_label`. ``sys.exit`` and the exception types in ``catch`` become a :class:`RewardError`
    (the reward worker catches every ``BaseException``: a ``KeyboardInterrupt`` raised there is the reward's,
    never the user's), as does a return that is not a real number (bool counts as 0/1) or lies outside
    ``[-REWARD_LIMIT, REWARD_LIMIT]`` (NaN and +-inf included)."""
    return _checked(_call(lambda: reward_fn(prompt, completion, answer, **keywords), where, catch), where)


def call_batch_reward(reward_fn, name: str, prompts: Sequence[str], completions: Sequence[str],
                      columns: Mapping[str, list], catch: tuple = (Exception,)) -> list[float]:
    """A batched reward (:func:`is_batched`) on the whole batch, ``reward_fn(prompts=..., completions=...,
    **columns)``, checked as :func:`call_reward` checks one value: it must return one real number per sample."""
    where = batch_label(name, prompts)
    values = _call(lambda: reward_fn(prompts=list(prompts), completions=list(completions), **columns), where, catch)
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, np.ndarray)):
        raise RewardError(f"{where} returned {type(values).__name__}, expected a list of {len(prompts)} floats")
    if len(values) != len(prompts):
        raise RewardError(f"{where} returned {len(values)} values for {len(prompts)} samples")
    return [_checked(v, sample_label(name, i, prompts[i])) for i, v in enumerate(values)]


def _call(thunk, where: str, catch: tuple):
    try:
        return thunk()
    except SystemExit as e:   # a reward must not end the training (its checkpoint state would be lost)
        raise RewardError(f"{where} called sys.exit({e.code!r}){_raised_at(e)}; return a reward instead") from None
    except catch as e:
        raise RewardError(f"{where} raised {one_line(e)}{_raised_at(e)}") from e


def _checked(value, where: str) -> float:
    number = _as_float(value)
    if number is None:
        raise RewardError(f"{where} returned {type(value).__name__} {_shorten(repr(value), 60)}, expected a float")
    if not (math.isfinite(number) and abs(number) <= REWARD_LIMIT):
        raise RewardError(f"{where} returned {number}, expected a finite float in [-{REWARD_LIMIT:g}, "
                          f"{REWARD_LIMIT:g}] (larger values overflow the fp32 group statistics); scale the reward")
    return number


def check_lengths(prompts: Sequence, completions: Sequence, answers: Sequence, extras: "Sequence | None") -> None:
    """``ValueError`` unless the batch's lists (and ``extras`` when given) have one entry per sample."""
    if not len(prompts) == len(completions) == len(answers):
        raise ValueError(f"score: lengths differ: {len(prompts)} prompts, {len(completions)} completions, "
                         f"{len(answers)} answers")
    if extras is not None and len(extras) != len(prompts):
        raise ValueError(f"score: {len(extras)} extras for {len(prompts)} prompts")


def score(reward_fn: RewardFn, prompts: Sequence[str], completions: Sequence[str],
          answers: Sequence[str], extras: "Sequence[Mapping[str, Any]] | None" = None) -> list[float]:
    """``[float(reward_fn(p, c, a, **kw)) for each sample]``, checked, in this process (a batched reward,
    :func:`is_batched`: one :func:`call_batch_reward` call). ``extras``: each sample's
    dataset-row fields besides prompt and answer; ``kw`` holds those the function takes as keyword parameters
    (all of them when it has ``**kwargs``; none for the plain three-argument signature), as TRL passes columns.

    Raises :class:`RewardError` naming the reward, the sample index and a prompt excerpt when
    the function raises, returns something that is not a real number (bool counts as 0/1), or
    returns NaN or +-inf (:func:`call_reward`); raises ``ValueError`` when the lists differ in length.
    """
    check_lengths(prompts, completions, answers, extras)
    name = reward_name(reward_fn)
    if is_batched(reward_fn):
        return call_batch_reward(reward_fn, name, prompts, completions,
                                 batch_keyword_filter(reward_fn)(batch_columns(answers, extras)))
    accepts = keyword_filter(reward_fn)
    return [call_reward(reward_fn, sample_label(name, i, prompt), prompt, completion, answer,
                        accepts(extras[i]) if extras is not None else {})
            for i, (prompt, completion, answer) in enumerate(zip(prompts, completions, answers, strict=True))]
