"""CUDA: a rollout engine sharing the policy's weight tensors keeps its captured decode graphs valid across
in-place optimizer steps (fp32 masters rounded into the shared bf16 tensors, chunked), and the chunked
AdamW step gives the unchunked step's bits on the GPU (alignment of chunk views, vectorized and
unvectorized elementwise kernels)."""

from __future__ import annotations

import pytest

from tests.train.test_shared_engine import shared_engine_sees_in_place_steps
from tests.train.test_master import _assert_same_step

pytestmark = pytest.mark.cuda   # skipped without CUDA (tests/conftest.py)


def test_captured_decode_graphs_read_the_shared_weights_after_each_step():
    engine, _ = shared_engine_sees_in_place_steps("cuda", "on")
    assert engine.counters["graph_steps"] > 0


@pytest.mark.parametrize("chunk", [1, 3, 1000, 4099, 1 << 20])
@pytest.mark.parametrize("offload", [False, True])
def test_chunked_step_equals_the_whole_step_on_the_gpu(chunk, offload):
    """bf16 weights on the GPU; masters and AdamW state there (or offloaded to the host): chunk views at odd
    offsets give the whole step's bits (the unchunked reference runs on the same device)."""
    _assert_same_step([((100_003,), "bf16"), ((257, 129), "bf16"), ((70_001,), "fp32")], offload=offload, clip=True,
                      seed=3, chunk=chunk, device="cuda")
