import pytest
import torch


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
