"""The trainer's code uses torch through its public surface: it writes no private attribute of another object
(a scheduler's ``_last_lr``, say) and replaces no module's ``forward``."""

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "rlalign" / "train"


def _assigned_attributes(tree: ast.AST):
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute):
                    yield part


def test_no_private_attribute_of_another_object_and_no_patched_forward():
    found = []
    for path in sorted(TRAIN.rglob("*.py")):
        for attr in _assigned_attributes(ast.parse(path.read_text())):
            owner = attr.value.id if isinstance(attr.value, ast.Name) else None
            private = attr.attr.startswith("_") and not attr.attr.startswith("__") and owner != "self"
            if private or attr.attr == "forward":
                found.append(f"{path.relative_to(TRAIN.parents[1])}:{attr.lineno}: .{attr.attr}")
    assert not found, "\n".join(found)
