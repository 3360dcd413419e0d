"""Every RLALIGN_* environment variable has a declared rule (rlalign.envvars) and is read only through it: a bad
value, or an RLALIGN_* name rlalign does not read, is one line naming the variable and what is allowed."""

import ast
import re
from pathlib import Path

import pytest

import rlalign.ops  # noqa: F401  (registers the strict ops, whose names RLALIGN_TRITON_DISABLE may list)
from rlalign import envvars
from rlalign.cli.main import main
from rlalign.envvars import VARIABLES, EnvVarError

PACKAGE = Path(__file__).resolve().parents[2] / "rlalign"
# Reads that do not go through rlalign.envvars yet, each with its reason; remove an entry when its read moves.
NOT_YET_THROUGH_THE_REGISTRY: set[tuple[str, str]] = set()


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_every_variable_refuses_its_bad_values_in_one_line(name, monkeypatch):
    var = VARIABLES[name]
    assert var.meaning and var.allowed and var.bad, f"{name} needs a meaning, its allowed values and bad examples"
    monkeypatch.delenv(name, raising=False)
    envvars.read(name)   # the default passes its own rule
    monkeypatch.setenv(name, var.default)
    envvars.read(name)
    for value in var.bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(EnvVarError) as err:
            envvars.read(name)
        text = str(err.value)
        assert text.startswith(f"{name}={value!r} is not allowed: it must be ") and "\n" not in text, text


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_an_empty_value_counts_as_unset(name, monkeypatch):
    monkeypatch.setenv(name, "  ")
    assert envvars.read(name) == VARIABLES[name].parse(VARIABLES[name].default)


def _rlalign_names_in_source():
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in re.findall(r"\bRLALIGN_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
            yield path.relative_to(PACKAGE), name


def test_every_variable_named_in_the_code_is_registered():
    missing = sorted({f"{path}: {name}" for path, name in _rlalign_names_in_source() if name not in VARIABLES})
    assert not missing, "RLALIGN_* names without a rule in rlalign/envvars.py VARIABLES:\n" + "\n".join(missing)


def _environ_reads(tree: ast.Module):
    """(line, variable) of every read of an RLALIGN_* variable from os.environ / os.getenv: by a literal, or by a
    module-level name bound to one (``ENV = "RLALIGN_X"``). Writes, deletes and pops (save and restore) are not reads."""
    constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}

    def variable(arg):
        value = arg.value if isinstance(arg, ast.Constant) else constants.get(getattr(arg, "id", None))
        return value if isinstance(value, str) and value.startswith(envvars.PREFIX) else None

    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "setdefault") and is_environ(f.value)) or \
                    (isinstance(f, ast.Attribute) and f.attr == "getenv"):
                if variable(node.args[0]):
                    yield node.lineno, variable(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            if variable(node.slice):
                yield node.lineno, variable(node.slice)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            if variable(node.left):
                yield node.lineno, variable(node.left)


def test_no_module_reads_an_rlalign_variable_past_the_registry():
    bypass = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel == Path("envvars.py"):
            continue
        for line, name in _environ_reads(ast.parse(path.read_text())):
            if (str(rel), name) not in NOT_YET_THROUGH_THE_REGISTRY:
                bypass.append(f"rlalign/{rel}:{line}: {name}")
    assert not bypass, "read these through rlalign.envvars.read (its rule checks the value):\n" + "\n".join(bypass)


def test_the_scan_sees_reads_by_literal_and_by_constant():
    tree = ast.parse('import os\nENV = "RLALIGN_X"\na = os.environ.get("RLALIGN_Y")\nb = os.environ[ENV]\n'
                     'c = "RLALIGN_Z" in os.environ\nos.environ[ENV] = "1"\nd = os.getenv("HOME")\n')
    assert sorted(_environ_reads(tree)) == [(3, "RLALIGN_Y"), (4, "RLALIGN_X"), (5, "RLALIGN_Z")]


def test_an_unknown_rlalign_variable_is_named_with_the_nearest_one(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path
    monkeypatch.setenv("RLALIGN_CPU_KERNEL", "0")
    assert main(["report", str(run_dir)]) == 2
    assert "RLALIGN_CPU_KERNEL is set, but rlalign reads no such environment variable; did you mean " \
           "RLALIGN_CPU_KERNELS?" in capsys.readouterr().err


def test_the_cache_dir_rule_expands_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RLALIGN_CACHE_DIR", "~/kernels")
    assert envvars.read("RLALIGN_CACHE_DIR") == tmp_path / "kernels"
