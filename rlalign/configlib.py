"""Dataclass configs from YAML plus dotted command-line overrides, validated.

``load_config(Schema, "cfg.yaml", ["algo.kl_coef=0.01", "run.dir=runs/x"])`` returns a ``Schema``
instance. An unknown key fails with the nearest valid names; a value of the wrong type names the
field and the type it wants; a key given twice in one YAML mapping fails with the key and both lines
(YAML would keep the second silently). Values in overrides are parsed as YAML scalars (``0.01``,
``true``, ``null``, ``[1, 2]``).

Value rules: a config dataclass declares ``CHECKS: ClassVar[dict[str, Rule]]``, one :class:`Rule`
per field, next to its fields. :func:`build` applies them after the types are checked, so every
bad value fails at load with the key and the allowed range (``run.checkpoint_every must be an
integer >= 1, got 0``). Each rule also lists values it refuses (``Rule.bad``), which the tests
walk field by field. Rules that need two fields go in the dataclass's ``validate()``.

Usual ranges: a field where a typo gives an absurd but legal value (``optim.lr=1e9``) also declares
``GUARDS: ClassVar[dict[str, Rule]]``, its usual range. :func:`unusual_value` finds the first value
outside it whose key the config does not list as meant (``run.allow_unusual`` for the training
config): a typo stops the run, a deliberate value needs one more key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable

import yaml

from rlalign.contract.errors import RLAlignError


class ConfigError(RLAlignError, ValueError):
    """A config file or override is wrong; the message names the key and the fix."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """A field's allowed values: ``allows(value)``; ``describe`` completes "KEY must be ..."."""
    describe: str
    allows: Callable[[Any], bool]
    bad: tuple = ()             # values the rule refuses (the tests feed each one)
    optional: bool = False      # None is allowed too

    def problem(self, key: str, value: Any) -> "str | None":
        if value is None and self.optional:
            return None
        if self.allows(value):
            return None
        return f"{key} must be {self.describe}{' (or null)' if self.optional else ''}, got {value!r}"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def at_least(low, *, optional=False, what="an integer") -> Rule:
    return Rule(f"{what} >= {low}", lambda x: _number(x) and x >= low,
                (low - 1, float("nan")) if what != "an integer" else (low - 1,), optional)


def greater_than(low, *, optional=False) -> Rule:
    return Rule(f"a finite number > {low}", lambda x: _number(x) and x > low,
                (low, low - 1.0, float("nan"), float("inf")), optional)


def within(low, high, *, low_open=False, high_open=False, optional=False) -> Rule:
    lo, hi = "(" if low_open else "[", ")" if high_open else "]"

    def allows(x):
        return _number(x) and (x > low if low_open else x >= low) and (x < high if high_open else x <= high)
    bad = (low - 1.0, high + 1.0, float("nan")) + ((low,) if low_open else ()) + ((high,) if high_open else ())
    return Rule(f"a number in {lo}{low}, {high}{hi}", allows, bad, optional)


def usual(low, high, bad: tuple, *, low_open=False) -> Rule:
    """A usual range (``GUARDS``): ``within(low, high)``; ``bad`` lists legal values outside it (tests feed them)."""
    return dataclasses.replace(within(low, high, low_open=low_open), bad=tuple(bad))


def one_of(*choices, optional=False) -> Rule:
    names = [str(c) for c in choices]
    listed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
    return Rule(listed, lambda x: x in choices, ("bogus",), optional)


def non_empty(what="a non-empty string", *, optional=False, bad=("", "  ")) -> Rule:
    return Rule(what, lambda x: isinstance(x, str) and bool(x.strip()), bad, optional)


def checked_by_type(kind: str, bad=("bogus",)) -> Rule:
    """A bool or Literal field: its type already admits only the allowed values."""
    return Rule(kind, lambda x: True, bad)


def pair_within(low, high) -> Rule:
    return Rule(f"two numbers in [{low}, {high})",
                lambda x: isinstance(x, (list, tuple)) and len(x) == 2 and all(_number(v) and low <= v < high for v in x),
                ([0.9], [0.9, 0.99, 0.999], [0.9, 1.0], [-0.1, 0.99], [0.9, float("nan")]))


def load_config(schema: type, path: "str | Path | None" = None, overrides: "list[str] | None" = None,
                base: "dict | None" = None):
    """``base`` (a mapping of sections, e.g. a run's saved config.yaml) under the file under the overrides."""
    return build(schema, merge(base or {}, load_raw(path, overrides)), prefix="")


class DuplicateKeyError(yaml.YAMLError):
    """A mapping gives the same key twice (YAML itself keeps the second and drops the first silently)."""

    def __init__(self, key, first_line: int, line: int):
        super().__init__(f"key {key!r} appears twice in one mapping (lines {first_line} and {line}); keep one")


class _Loader(yaml.SafeLoader):
    """YAML with the 1.2 booleans: only true/false (any case) are bools. YAML 1.1 also reads on/off/yes/no
    as bools, which turned the documented ``rollout.decode_graphs=off`` into False and failed the run.
    A key given twice in one mapping is a :class:`DuplicateKeyError` (merge keys ``<<`` may repeat keys)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key, line = self.construct_object(key_node), key_node.start_mark.line + 1
                if key in seen:
                    raise DuplicateKeyError(key, seen[key], line)
                seen[key] = line
        return super().construct_mapping(node, deep)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def load_yaml(text: str):
    """Parse config YAML (a file, a saved run config or one override's value) with YAML 1.2 booleans."""
    return yaml.load(text, Loader=_Loader)


def load_raw(path: "str | Path | None" = None, overrides: "list[str] | None" = None) -> dict:
    """The nested mapping the file and the overrides spell out (unvalidated; only the keys given)."""
    raw: dict = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        try:
            parsed = load_yaml(value) if value != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: cannot parse value ({exc.__class__.__name__})") from None
        _set_dotted(raw, key.strip(), parsed)
    return raw


def merge(base: dict, top: dict) -> dict:
    """``top`` over ``base``, section by section (a new dict; neither input changes)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def flatten(obj, prefix: str = "") -> dict:
    """A dataclass instance (or nested mapping) as ``{"section.key": value}``."""
    items = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj
    out = {}
    for key, value in items.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def field_help(schema: type) -> dict[str, str]:
    """``{field name: one-line meaning}`` of a dataclass, read from the comment that ends the field's
    line in its source (``steps: int = 120   # optimizer steps``): the comment is the one place the
    meaning is written. Fields without a comment are absent."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    try:
        source = textwrap.dedent(inspect.getsource(schema))
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.end_lineno in comments:
            out[node.target.id] = comments[node.end_lineno]
    return out


def describe(schema: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(section.key, default, meaning)`` for every leaf field of a nested dataclass schema."""
    rows = []
    helps = field_help(schema)
    hints = typing.get_type_hints(schema)
    instance = schema()
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], f"{prefix}{f.name}.")
        else:
            rows.append((prefix + f.name, yaml.safe_dump(getattr(instance, f.name), default_flow_style=True)
                         .strip().removesuffix("...").strip(), helps.get(f.name, "")))
    return rows


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "save it as UTF-8") from None
    try:
        data = load_yaml(text) or {}
    except DuplicateKeyError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: the problem and where (``found ... at line 3, column 5``)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None:
        return " ".join(str(exc).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def unusual_value(obj, allowed, allow_key: str, prefix: str = "") -> "str | None":
    """The first field of ``obj`` (a nested config dataclass) outside its usual range (the ``GUARDS`` of its
    section), unless its key is in ``allowed``; None when every value is usual or allowed. ``allow_key`` names
    the config key that lists the allowed ones, for the message."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            problem = unusual_value(value, allowed, allow_key, f"{prefix}{f.name}.")
            if problem:
                return problem
    for name, rule in getattr(type(obj), "GUARDS", {}).items():
        key, value = prefix + name, getattr(obj, name)
        if key not in allowed and value is not None and not rule.allows(value):
            return (f"{key}={value!r} is outside its usual range, {rule.describe}: a typo? If it is meant, "
                    f"allow it with {allow_key}=[{key}]")
    return None


def guarded_keys(schema: type, prefix: str = "") -> list[str]:
    """Every ``section.key`` of a nested config schema that declares a usual range (``GUARDS``)."""
    hints = typing.get_type_hints(schema)
    keys = [prefix + name for name in getattr(schema, "GUARDS", {})]
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += guarded_keys(hints[f.name], f"{prefix}{f.name}.")
    return keys


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part} is a value, not a section")
    node[parts[-1]] = value


def build(schema: type, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            near = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(prefix + n for n in near)}?" if near else \
                f"; valid keys: {', '.join(prefix + n for n in fields)}"
            raise ConfigError(f"unknown config key {prefix}{key}{hint}")
        kwargs[key] = _coerce(hints[key], value, prefix + key)
    try:
        obj = schema(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {exc}") from None
    for name, rule in getattr(schema, "CHECKS", {}).items():
        problem = rule.problem(prefix + name, getattr(obj, name))
        if problem:
            raise ConfigError(problem)
    validate = getattr(obj, "validate", None)
    if validate:
        problem = validate()
        if problem:
            raise ConfigError(f"{prefix}{problem}")
    return obj


def _coerce(hint, value, name: str):
    if dataclasses.is_dataclass(hint):
        return build(hint, value if value is not None else {}, prefix=name + ".")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, name)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{name}: bad value {value!r}")
    if origin is typing.Literal:
        if value not in args:
            near = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            extra = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{name} must be one of {list(args)}, got {value!r}{extra}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        inner = args[0] if args else Any
        return [_coerce(inner, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-2" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value
