import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """The models tests issue thousands of tiny GEMMs; with OpenMP threads on a busy 2-core machine
    each one can wait ~10-30 ms for a descheduled worker. One thread is 10-30x faster there, and the
    bitwise properties are checked at a fixed thread count either way. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
