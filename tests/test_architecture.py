"""The package's layering, enforced (docs/architecture.md).

* imports point down the layers of ``[tool.importlinter]`` in pyproject.toml (import-linter's ``layers``
  contracts -- the package's layers, and the rooms of ``rollout`` and ``ops`` -- and its ``acyclic_siblings``
  contract, run on this checkout's ``rlalign``);
* no import cycle between any modules of ``rlalign``, imports inside functions included (grimp's graph);
* an import inside a function of ``rlalign`` that names an ``rlalign`` module says why it is not at module
  level (``# lazy: <reason>`` on its line): the only reason is a heavy optional dependency behind it (a cycle
  is not one: move code instead);
* no module imports another package's private module or another module's underscore names;
* no statement follows a ``return`` / ``raise`` in its block;
* the trainer's code uses torch through its public surface: it writes no private attribute of another object
  (a scheduler's ``_last_lr``, say) and replaces no module's ``forward``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import grimp

if sys.version_info >= (3, 11):
    import tomllib
else:   # Python 3.10 (requires-python >= 3.10): the same parser as a package, in the test extra
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlalign"


def _run_lint_imports() -> subprocess.CompletedProcess:
    code = ("import sys, rlalign\n"
            f"assert rlalign.__file__.startswith({str(PACKAGE)!r}), 'not this checkout: ' + rlalign.__file__\n"
            "from importlinter.cli import lint_imports\n"
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_imports_point_down_the_layers():
    out = _run_lint_imports()
    report = out.stdout[out.stdout.find("Broken contracts"):] if "Broken contracts" in out.stdout else out.stdout
    assert out.returncode == 0, f"import-linter: an import points up the layers\n{report[-4000:]}{out.stderr[-2000:]}"
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"{len(contracts)} kept, 0 broken" in out.stdout


def _import_cycles(graph) -> list[tuple[str, ...]]:
    """One shortest cycle per set of modules that import each other round (importer, ..., importer)."""
    cycles: dict[frozenset, tuple[str, ...]] = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                cycle = (importer, *back)
                key = frozenset(cycle)
                if key not in cycles or len(cycle) < len(cycles[key]):
                    cycles[key] = cycle
    return sorted(cycles.values())


def test_no_import_cycles():
    """grimp's graph of this checkout's rlalign (every import statement, inside functions too) has no cycle."""
    origin = importlib.util.find_spec("rlalign").origin
    assert origin.startswith(str(PACKAGE)), f"not this checkout: {origin}"
    cycles = _import_cycles(grimp.build_graph("rlalign", cache_dir=None))
    assert not cycles, "import cycles (move the shared piece down to a module both sides can import):\n" + \
        "\n".join(" -> ".join(cycle) for cycle in cycles)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield path, ".".join(parts), ast.parse(path.read_text()), path.read_text().splitlines()


def _imported_modules(node: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(absolute module, imported names) of an import statement; names empty for ``import x``."""
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [(target, [a.name for a in node.names])]


def test_function_level_internal_imports_say_why():
    hidden = []
    for path, module, tree, lines in _modules():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                targets = _imported_modules(node, module, path.name == "__init__.py")
                if any(t == "rlalign" or t.startswith("rlalign.") for t, _ in targets) and \
                        "lazy:" not in lines[node.lineno - 1]:
                    hidden.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not hidden, ("imports of rlalign modules inside functions: move them to module level (break a cycle by "
                        "moving code), or give the heavy optional dependency that keeps one lazy as "
                        "`# lazy: <reason>`:\n" + "\n".join(hidden))


def _private_parts(target: str) -> list[int]:
    return [i for i, part in enumerate(target.split(".")) if part.startswith("_") and not part.startswith("__")]


def test_no_private_names_across_modules():
    crossing = []
    for path, module, tree, _ in _modules():
        is_package = path.name == "__init__.py"
        own_package = module if is_package else module.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, names in _imported_modules(node, module, is_package):
                if not target.startswith("rlalign"):
                    continue
                for i in _private_parts(target):   # a private module: only its own package may import it
                    parent = ".".join(target.split(".")[:i])
                    if not (own_package == parent or own_package.startswith(parent + ".")):
                        crossing.append(f"{path.relative_to(ROOT)}:{node.lineno}: private module {target}")
                for name in names:
                    private_module = PACKAGE.parent / (target + "." + name).replace(".", "/")
                    is_module = private_module.with_suffix(".py").exists() or (private_module / "__init__.py").exists()
                    if name.startswith("_") and not name.startswith("__") and not (
                            is_module and own_package.startswith(target)):
                        crossing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}.{name}")
    assert not crossing, "imports of another module's private names (make them public, or move the code):\n" + \
        "\n".join(crossing)


def test_no_statement_follows_a_return_or_raise():
    """Unreachable code: a statement after ``return`` / ``raise`` / ``continue`` / ``break`` in the same block never
    runs (a test's float64 accuracy check was once found stranded after a ``return``, so it never checked)."""
    stranded = []
    for path in [*ROOT.joinpath("rlalign").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py"),
                 *ROOT.joinpath("benchmarks").glob("*.py"), *ROOT.joinpath("scripts").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if not isinstance(block, list):
                    continue
                for stmt, after in zip(block, block[1:]):
                    if isinstance(stmt, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
                        stranded.append(f"{path.relative_to(ROOT)}:{after.lineno}")
    assert not stranded, f"statements that can never run: {stranded}"


def _assigned_attributes(tree: ast.AST):
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute):
                    yield part


def test_trainer_writes_no_private_attribute_of_another_object_and_patches_no_forward():
    found = []
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        for attr in _assigned_attributes(ast.parse(path.read_text())):
            owner = attr.value.id if isinstance(attr.value, ast.Name) else None
            private = attr.attr.startswith("_") and not attr.attr.startswith("__") and owner != "self"
            if private or attr.attr == "forward":
                found.append(f"{path.relative_to(ROOT)}:{attr.lineno}: .{attr.attr}")
    assert not found, "\n".join(found)
