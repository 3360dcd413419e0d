"""The repository speaks of the product, not of how it was built: no internal work-period labels ("session 22",
"s12/call5"), issue numbers ("issue 17"), team roles ("the lead's"), citations of raw-output folders and notes that
are not in the tree (benchmarks/gpu_2026-*, benchmarks/runs/, the results notebook, the work log) or of the
removed device-job scripts. Measurements are cited by card and date and point to docs/performance.md,
docs/design/ or a file under benchmarks/evidence/ (raw evidence, not scanned).

Every tracked text file of the scanned folders is read whole; a pattern may span a line break and comment
leaders (``session\\n# 12``). A failure lists file:line and the matched text of every hit."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("rlalign/", "tests/", "configs/", "scripts/", "docs/", "benchmarks/", ".ci/", "README.md", "CHANGELOG.md",
           "pyproject.toml")
NOT_SCANNED = ("benchmarks/evidence/", "tests/test_product_words.py")
GAP = r"[\s#*]+"   # between two words: spaces, line breaks, comment leaders

PATTERNS = {
    "work period": re.compile(rf"\bsessions?{GAP}\d+|\bsessions?[-_]?\d+", re.I),
    "run label": re.compile(
        r"\d{4}-\d\d-\d\d[a-z]?-s\d{1,2}\b"               # a dated run folder with its period: 2026-12-02-s12
        r"|\bs\d{1,2}/(?=call|c\d\b)"                    # s12/call5, s22/c1 (not a launch label's w4/s4/)
        rf"|\bs\d{{1,2}}{GAP}(?:calls?|sweeps?)\b|\bthe{GAP}s\d{{1,2}}{GAP}runs\b"   # s15 call, the s11 runs
        r"|\bcall_?c?\d+\b"                             # call5, call_c1 (a device call as a run label)
        rf"|\bcall{GAP}\d+\b"                           # call 9
        r"|/c\d(?:-c\d)?\b|\(c\d(?:[;)]|-c\d)",          # .../c1-c4, (c3; ...), (c1)
        re.I),
    "issue number": re.compile(rf"\bissues?(?:{GAP}|-)#?\d+|\bthe{GAP}issue's\b", re.I),
    "team role": re.compile(rf"\bthe{GAP}lead\b|\blead's\b", re.I),
    "removed notes": re.compile(r"docs/LOG\.md|\bRESULTS\.md"),
    "removed raw output": re.compile(
        r"(?<![\w/.])bench/"                           # the top-level bench/ folder (now benchmarks/)
        r"|benchmarks/gpu_(?!(?:attention|gated_delta|linear|logprob|moe)\.py\b|\*\.py)"   # dated GPU output folders
        r"|benchmarks/runs/"),
    "removed device scripts": re.compile(
        r"\b(?:gpu_(?:headline|moe|check|suite|verify|multi|common|e2e|learn_sweep|perf|rollout|stages)"
        r"|ray_gpu_check)\.sh\b"),
}


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):   # not a git checkout: walk the tree
        names = [os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
                 for d, _, files in os.walk(ROOT) if ".git" not in Path(d).parts for f in files]
    return sorted(n for n in names if n.startswith(SCANNED) and not n.startswith(NOT_SCANNED))


def hits_in(text: str) -> list[tuple[int, str, str]]:
    """(line, kind, matched text) of every pattern match in ``text``."""
    found = []
    for kind, pattern in PATTERNS.items():
        for m in pattern.finditer(text):
            found.append((text.count("\n", 0, m.start()) + 1, kind, " ".join(m.group(0).split())))
    return sorted(found)


def test_no_work_period_labels_issue_numbers_or_team_roles():
    hits = []
    for name in tracked_files():
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue   # binary (images)
        text = data.decode("utf-8", errors="replace")
        hits += [f"{name}:{line}: {kind}: {matched!r}" for line, kind, matched in hits_in(text)]
    print("\n".join(hits))
    assert not hits, f"{len(hits)} hits (write the date and the card, and cite docs/performance.md, docs/design/ or " \
                     f"benchmarks/evidence/):\n" + "\n".join(hits)


# Lines as they stood in the tree before the scrub (each must be caught), and product text that must not be.
OLD_LINES = (
    "# H200, 2026-12-02 (session 12, benchmarks/gpu_2026-12-02-s12/call5): 128-row dQ tiles with 8 warps",
    "# streamed launch. H200, 2026-12-03 (session 18, benchmarks/gpu_2026-12-03-s18/call_c1, --sweep-decode",
    "# - session 22 (benchmarks/gpu_2026-12-03-s22/c1-c4; M 1,024 / 4,096 / 16,384): level 2 in a per-program slot",
    "# 53 / 60 steps (benchmarks/runs/lr_proxy_2026-12-02-s11, docs/gpu.md) puts a gradual rise",
    "# (gemm_ws.NARROW_WS, chosen by gemm_ws.launch_for; session 15 call 9: 1.24x the 64x128 launch)",
    "#: ignored EXTRA_CHAR_COST: the s11 runs before this map ran it at its own 1/16)",
    "# with int64 offsets (session\n# 22) ptxas folds them",
    "SESSION14_WS = WsConfig(block_m=128, block_n=128, stages=6)",
    'cands = [("default", d), ("session-11 default", A.BackwardLaunch()),',
    "# Qwen3-8B shape on one H200 with ALL training state on the GPU (issue 17): strict GRPO",
    "# Issue 21's multi-GPU runs in one device job on 2, 4 or 8 GPUs of one host",
    '"""CUDA: the native rollout profile as a fair baseline (issue 16.1).',
    "`--workload` names the issue-16 shapes (Qwen3 shapes with",
    '"""The issue\'s bitwise test: every sampled token\'s logprob equals the trainer\'s packed-forward logprob,',
    "KPART_BACKWARD_AFTER_S = 110   # the reference rows are skipped past this many seconds (the lead's call)",
    "def compile_kpart(cfg):   # the --sweep-kpart candidates: what the lead's one GPU call compiles",
    "On an H200 (the lead's run): captured decode graphs that sample give the eager sampler's bits",
    "# threshold is in docs/LOG.md); column shards must be at least this wide.",
    "for the 64-row tiles with 64-column steps (benchmarks/RESULTS.md, session 21).",
    'OUT="${OUT:-bench/gpu_out}"',
    "| 2026-11-30 to 2026-12-03 | `benchmarks/gpu_2026-*` (listed under \"Evidence files\") |",
    "#   bash scripts/gpu_headline.sh                         # all of it, one GPU job",
)
PRODUCT_LINES = (
    "merged by a balanced binary tree: ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7))",
    "    s0, n = cu[2].item(), lens[2]",
    "for c0 in range(0, v, GRAD_CHUNK):",
    "@pytest.fixture(scope=\"session\")",
    "with ops.check_scope(f\"layers.{index}\"), recompute.layer_session():",
    "gives a hidden state turned toward it an ~82-nat lead, so the body alone makes the policy one-hot",
    "the 8B's lead of S x 4096 nats for a state aligned with one row",
    "python benchmarks/gpu_linear.py --out DIR; benchmarks/gpu_attention.py, benchmarks/gpu_*.py",
    "rlalign/bench/rollout.py and tests/bench/test_rollout.py",
    "# H200, 2026-12-03 (benchmarks/evidence/gemm-h200/kpart-p4-ring-sweep.json): 0.88-0.95 of cuBLAS",
    "a 5-step cuda run; one call per distinct temperature; 19 calls a step",
    "The worker runs in a session of its own: Ctrl-C in the terminal reaches the trainer only",
)


@pytest.mark.parametrize("line", OLD_LINES)
def test_the_patterns_catch_the_old_wording(line):
    assert hits_in(line), line


@pytest.mark.parametrize("line", PRODUCT_LINES)
def test_the_patterns_leave_product_text_alone(line):
    assert not hits_in(line), hits_in(line)
