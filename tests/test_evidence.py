"""benchmarks/evidence/ holds exactly the raw output that published figures cite: every kept file has a row in its
README (the manifest), every row names files that exist, every kept file is cited outside the folder (a claim of
benchmarks/reproduce.py or a tracked document), and every ``benchmarks/evidence/...`` path a tracked file names
exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "benchmarks" / "evidence"
MANIFEST = EVIDENCE / "README.md"
PATH = re.compile(r"benchmarks/evidence/[\w./-]+\w")


def _kept() -> set[str]:
    return {p.relative_to(EVIDENCE).as_posix() for p in EVIDENCE.rglob("*") if p.is_file() and p != MANIFEST}


def _manifest_files() -> set[str]:
    """The backticked paths of the manifest table's first column."""
    files = set()
    for line in MANIFEST.read_text().splitlines():
        cells = line.split("|")
        if len(cells) > 2 and "`" in cells[1]:
            files |= set(re.findall(r"`([^`]+)`", cells[1]))
    return files


def _tracked_text() -> dict[str, str]:
    """Tracked text files outside the evidence folder (git ls-files where git is available, else a walk)."""
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    texts = {}
    for name in names:
        if name.startswith("benchmarks/evidence/") or not name.endswith((".md", ".py", ".yaml", ".sh", ".toml")):
            continue
        path = ROOT / name
        if path.is_file():
            texts[name] = path.read_text(errors="replace")
    return texts


def test_every_kept_file_is_in_the_manifest_and_every_listed_file_exists():
    kept, listed = _kept(), _manifest_files()
    assert not kept - listed, f"files in benchmarks/evidence/ without a manifest row: {sorted(kept - listed)}"
    assert not listed - kept, f"manifest rows naming missing files: {sorted(listed - kept)}"


def _claimed() -> set[str]:
    """The recorded outputs of benchmarks/reproduce.py's claims."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import reproduce
    return {c.recorded for c in reproduce.CLAIMS}


def test_every_kept_file_is_cited_outside_the_folder():
    cited = {m for text in _tracked_text().values() for m in PATH.findall(text)} | _claimed()
    uncited = sorted(f for f in _kept() if f"benchmarks/evidence/{f}" not in cited)
    assert not uncited, f"evidence no claim or document cites (remove it, or cite it): {uncited}"


def test_every_cited_evidence_path_exists():
    missing = sorted({f"{name}: {m}" for name, text in _tracked_text().items() for m in PATH.findall(text)
                      if not (ROOT / m).exists()})
    assert not missing, "cited evidence that is not in the tree:\n" + "\n".join(missing)
