"""The ``rlalign`` command makes idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``) before torch loads libgomp,
unless the user chose a wait policy or spin count (rlalign/ompwait.py; docs/cpu.md, "Idle threads sleep")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from rlalign import ompwait

ROOT = Path(__file__).resolve().parents[1]


@given(env=st.dictionaries(st.sampled_from(["OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "PATH"]),
                           st.sampled_from(["ACTIVE", "passive", "0", "10000", ""])))
def test_a_user_setting_is_kept_else_passive(env):
    before = dict(env)
    chose = any(name in before for name in ompwait.USER_SETTINGS)
    assert ompwait.apply(env) is (not chose)
    if chose:
        assert env == before
    else:
        assert env == {**before, "OMP_WAIT_POLICY": "PASSIVE"}


def _libgomp_policy(**overrides: str) -> str:
    """The wait policy libgomp initialised with in a fresh ``rlalign --version`` (OMP_DISPLAY_ENV prints it)."""
    env = {k: v for k, v in os.environ.items() if k not in ompwait.USER_SETTINGS}
    env.update(PYTHONPATH=str(ROOT), OMP_DISPLAY_ENV="TRUE", **overrides)
    done = subprocess.run([sys.executable, "-m", "rlalign.cli.main", "--version"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "OMP_WAIT_POLICY" in line]
    if not lines:
        pytest.skip("this torch build's OpenMP runtime does not display its settings (not libgomp)")
    return lines[0].split("=", 1)[1].strip().strip("'")


def test_the_command_sets_the_policy_before_torch_loads_libgomp():
    assert _libgomp_policy() == "PASSIVE"
    assert _libgomp_policy(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
