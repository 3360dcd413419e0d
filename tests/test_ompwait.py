"""On a busy machine the ``rlalign`` command makes idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``) before
torch loads libgomp, unless the user chose a wait policy or spin count; on a quiet one libgomp's default stays
(rlalign/ompwait.py; docs/cpu.md, "Idle threads sleep")."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from rlalign import ompwait

ROOT = Path(__file__).resolve().parents[1]


@given(env=st.dictionaries(st.sampled_from(["OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "PATH"]),
                           st.sampled_from(["ACTIVE", "passive", "0", "10000", ""])), busy=st.booleans())
def test_a_user_setting_is_kept_else_passive_when_busy(env, busy):
    before = dict(env)
    chose = any(name in before for name in ompwait.USER_SETTINGS)
    assert ompwait.apply(env, busy=lambda: busy) is (busy and not chose)
    if chose or not busy:
        assert env == before
    else:
        assert env == {**before, "OMP_WAIT_POLICY": "PASSIVE"}


@given(load=st.floats(0, 64), cores=st.integers(1, 16))
def test_busy_means_the_load_reaches_the_usable_cores(load, cores):
    with mock.patch.object(os, "getloadavg", lambda: (load, load, load)), \
            mock.patch.object(os, "sched_getaffinity", lambda pid: set(range(cores))):
        assert ompwait.machine_busy() is (load >= cores)


RUN_VERSION = ("import os, sys; load = float(sys.argv[1]); os.getloadavg = lambda: (load, load, load); "
               "from rlalign.cli.main import main; sys.exit(main(['--version']))")


def _libgomp_spincount(load: float, **overrides: str) -> int:
    """How long libgomp's idle threads spin (GOMP_SPINCOUNT; 0: they sleep at once, the passive policy) in a fresh
    ``rlalign --version`` started at this load average. (libgomp displays OMP_WAIT_POLICY as PASSIVE whether or not
    it is set; the spin count tells the two apart.)"""
    env = {k: v for k, v in os.environ.items() if k not in ompwait.USER_SETTINGS}
    env.update(PYTHONPATH=str(ROOT), OMP_DISPLAY_ENV="VERBOSE", **overrides)
    done = subprocess.run([sys.executable, "-c", RUN_VERSION, str(load)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "GOMP_SPINCOUNT" in line]
    if not lines:
        pytest.skip("this torch build's OpenMP runtime does not display its settings (not libgomp)")
    return int(lines[0].split("=", 1)[1].strip().strip("'"))


def test_the_command_sets_the_policy_before_torch_loads_libgomp():
    assert _libgomp_spincount(load=1e6) == 0                                # busy: threads sleep
    assert _libgomp_spincount(load=1e6, OMP_WAIT_POLICY="ACTIVE") > 0       # the user's choice
    assert _libgomp_spincount(load=0.0) > 0                                 # quiet: libgomp's default spin
