import logging

import pytest
import torch

from rlalign.train.logs import LOGGER


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


def pytest_collection_modifyitems(config, items):
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
