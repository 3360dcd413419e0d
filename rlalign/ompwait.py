"""How idle OpenMP threads wait in an ``rlalign`` command: on a busy machine they sleep
(``OMP_WAIT_POLICY=PASSIVE``); on a quiet one, and whenever the environment says how, libgomp's default stays.

torch's CPU build runs its intra-op threads, MKL's GEMMs and rlalign's compiled kernels on one GNU OpenMP
(libgomp) team. libgomp's default makes a thread that waits at a barrier spin for up to 300,000 iterations
before it sleeps. On a machine whose cores other jobs share, the thread it waits for is often descheduled,
and the spinning thread holds the core that thread needs: the embedded default run (``rlalign train``)
took about 5 times the CPU time and wall time on the 2-core development machine at load 5-6 (docs/cpu.md,
"Idle threads sleep"). With the passive policy an idle thread sleeps at once. On a quiet machine spinning is the
faster choice (the default run: 39 s spinning vs 52 s passive on the idle 2-core machine): each parallel region
then wakes its threads instead of finding them spinning. So the policy is set only when the 1-minute load average
at start is at least the number of cores this process may use (other work is competing for them).

Only how idle threads wait changes: the team, its size and how each op splits its work are the same, so every
computed bit is too (the default run's 121 metrics lines equal the recorded ones under both policies).

libgomp reads the variable once, when it is loaded (by ``import torch``): :func:`apply` must run before torch is
imported, which is why the ``rlalign`` command imports this module first. A user's ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` is kept (``OMP_WAIT_POLICY=ACTIVE`` restores spinning, e.g. on a dedicated machine). The
variable is inherited by the processes a command starts (reward workers, distributed ranks).
"""

from __future__ import annotations

import os

VARIABLE = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"
# a user who sets either chose how threads wait: leave both alone
USER_SETTINGS = (VARIABLE, "GOMP_SPINCOUNT")


def machine_busy() -> bool:
    """The 1-minute load average is at least the cores this process may run on (False where the OS does not say)."""
    try:
        return os.getloadavg()[0] >= len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return False


def apply(environ=os.environ, busy=machine_busy) -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` when ``busy()`` and it names no wait policy or spin count
    already; returns whether it was set. Effective for this process only when torch (libgomp) is not loaded yet."""
    if any(name in environ for name in USER_SETTINGS) or not busy():
        return False
    environ[VARIABLE] = PASSIVE
    return True


__all__ = ["apply", "machine_busy", "VARIABLE", "PASSIVE", "USER_SETTINGS"]
