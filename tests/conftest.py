import logging
import os

import pytest
import torch

from rlalign.train.run.logs import LOGGER


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The suite runs thousands of tiny GEMMs, far below a thread pool's break-even point; with two
    OpenMP threads on a busy 2-core machine each can wait 10-30 ms for a descheduled worker. One
    thread is faster, and every bitwise property is checked at a fixed thread count either way
    (`rlalign doctor`, run as a subprocess by the tests, checks the default count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The modules that take longest on CI's 2 cores (--durations, 2026-12-02), handed to the xdist workers first so
# that the two finish together (pyproject's addopts: --dist loadfile --no-loadscope-reorder; the other modules
# follow in collection order). An ordering hint only: a module missing here can cost wall time, never a result.
SLOWEST_FIRST = (
    "tests/ops/test_triton_interpret.py",         # two subprocesses: the interpreter checks, the sm_90a compiles
    "tests/ops/test_attention_launch.py",
    "tests/integrations/test_ray.py",
    "tests/integrations/vllm/test_plugin.py",
    "tests/ops/test_moe_dispatch.py",
    "tests/integrations/vllm/test_cli.py",
    "tests/distributed/test_train_parallel.py",
    "tests/ops/test_gemm_schedules.py",
    "tests/ops/test_gemm_ws_compile.py",          # an sm_90a compile subprocess (not yet timed)
)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): two test processes on a CPU machine (CI: 2 cores; each runs
    torch on one thread, see _one_thread), none (the tests run in this process, as without xdist) where
    CUDA is available, so that the CUDA tier keeps one process per GPU unless a script asks for more
    with ``-n``. A pytest a test runs as a child (tests/ops/test_moe_dispatch.py) runs in one process too: its
    parent is already one of the two. PYTEST_XDIST_AUTO_NUM_WORKERS overrides all of these."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if torch.cuda.is_available() or os.environ.get("PYTEST_XDIST_WORKER"):
        return 0
    return 2 if len(os.sched_getaffinity(0)) >= 2 else 0


def _slowest_first(items):
    """Stable: the SLOWEST_FIRST modules' tests first, in that order, each module's tests in their own order."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):   # the order in which xdist hands modules out (see SLOWEST_FIRST)
        _slowest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class LogLines(logging.Handler):
    """The rlalign logger's messages (INFO and up), collected on that logger itself: once a test has installed
    the CLI handler the logger no longer propagates to the root, where pytest's caplog listens."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.messages)


@pytest.fixture
def rlalign_log():
    lines = LogLines()
    LOGGER.addHandler(lines)
    level = LOGGER.level
    LOGGER.setLevel(min(level or logging.INFO, logging.INFO))
    try:
        yield lines
    finally:
        LOGGER.removeHandler(lines)
        LOGGER.setLevel(level)
