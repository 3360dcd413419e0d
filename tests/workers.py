"""Checks that run in a child Python process: the Triton interpreter must be switched on (or off) before triton is
imported, and the sm_90a compile checks replace Triton's driver. The child prints one line ``RESULTS <json>``
(its last such line counts); the parent reads it here, or fails the test with the child's output tails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "RESULTS "


def spawn(args: list[str], interpret: bool) -> subprocess.Popen:
    """``python <args>`` from the repository root, with the repository on PYTHONPATH and TRITON_INTERPRET=1 or
    unset."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def collect(proc: subprocess.Popen, timeout: float) -> tuple[dict | None, int, str, str]:
    """(the child's results or None, its exit code, stdout, stderr). ``timeout`` is a hang guard, not a speed check."""
    out, err = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith(MARK)]
    return (json.loads(lines[-1][len(MARK):]) if lines else None), proc.returncode, out, err


def run_worker(args: list[str], interpret: bool, timeout: float) -> dict:
    """The child's results; the test fails with the tails of its output when it printed none."""
    results, rc, out, err = collect(spawn(args, interpret), timeout)
    if results is None:
        pytest.fail(f"worker {' '.join(args)[:80]} printed no results (rc {rc}):\n{out[-3000:]}\n{err[-3000:]}")
    return results


def worker_main(sm90, interpret) -> None:
    """The child's side for a worker module with two modes: ``--sm90`` runs ``sm90()`` (the stand-in sm_90 driver:
    no interpreter), anything else ``interpret(sys.argv[2:])`` after patching the interpreter; prints the results
    line, or the traceback and exits 1."""
    try:
        if sys.argv[1] == "--sm90":
            results = sm90()
        else:
            from tests.ops.test_triton_interpret import _patch_interpreter
            _patch_interpreter()
            results = interpret(sys.argv[2:])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    print(MARK + json.dumps(results))
