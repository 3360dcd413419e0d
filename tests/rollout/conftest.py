import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    """The rollout tests run tiny models whose ops are far below a thread pool's break-even point:
    one thread is faster, and immune to a loaded CI machine. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
