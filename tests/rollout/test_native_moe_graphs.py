"""The native profile's MoE experts as grouped GEMMs (``torch._grouped_mm``), so a native MoE engine decodes
from CUDA graphs like strict (the same machinery), CPU tier:

- over shapes (empty expert groups, one token, k = 1 and 2, fp32 and bf16) the grouped path equals the
  per-expert loop to rounding, and reads nothing on the host (every host read of a tensor raises inside it);
- the cases it refuses name why (per-expert lists, autograd, a torch that refuses the strides), and the
  engine's check finds the tiny MoE model's experts capturable; a native MoE engine on the padded graphs
  samples its decode steps in them and overlaps them.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.models.testing import tiny_model
from rlalign.ops.moe import _native_expert_ffn, expert_ffn_loop, native_grouped_unavailable
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.rollout.device_setup import native_experts_read_host
from tests.bitwise import assert_close_report
from tests.rollout.test_engine_routing import MOE


@contextlib.contextmanager
def no_host_reads():
    """Any read of a tensor's values on the host (item, tolist, bool, int, float, numpy) raises inside."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("a host read of a tensor inside the native grouped experts")
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "numpy")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    try:
        for name in names:
            setattr(torch.Tensor, name, refuse)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@settings(max_examples=25, deadline=None)
@given(experts=st.sampled_from([1, 3, 8]), hidden=st.sampled_from([16, 64]), inter=st.sampled_from([8, 32]),
       tokens=st.integers(1, 40), k=st.sampled_from([1, 2]), dtype=st.sampled_from(["float32", "bfloat16"]),
       seed=st.integers(0, 2**16))
def test_grouped_native_experts_equal_the_loop_without_host_reads(experts, hidden, inter, tokens, k, dtype, seed):
    dt = getattr(torch, dtype)
    k = min(k, experts)
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(experts, inter, hidden, generator=g).to(dt) * 0.1 for _ in range(2))
    down = torch.randn(experts, hidden, inter, generator=g).to(dt) * 0.1
    ids = torch.sort(torch.randint(0, experts, (tokens * k,), generator=g)).values   # sorted: some groups empty
    rows = torch.randn(tokens * k, hidden, generator=g).to(dt)
    with torch.no_grad():
        assert native_grouped_unavailable(rows, gate, up, down) is None
        want = expert_ffn_loop(rows, ids, gate, up, down, None, profile="native")
        with no_host_reads():
            got = _native_expert_ffn(rows, ids, gate, up, down, None, "native")
    tol = (1e-5, 1e-5) if dt == torch.float32 else (2e-2, 2e-2)
    assert got.dtype == dt
    assert_close_report(got.float(), want.float(), atol=tol[0], rtol=tol[1], what=f"grouped vs loop {ids.tolist()}")


def test_grouped_native_experts_name_what_they_refuse():
    gate, up, down = torch.zeros(2, 8, 16), torch.zeros(2, 8, 16), torch.zeros(2, 16, 8)
    rows = torch.zeros(3, 16)
    assert "lists" in native_grouped_unavailable(rows, list(gate), list(up), list(down))
    assert "differ" in native_grouped_unavailable(rows.bfloat16(), gate, up, down)
    with torch.enable_grad():
        assert "autograd" in native_grouped_unavailable(rows, gate.requires_grad_(), up, down)
    odd = (torch.zeros(2, 10, 6), torch.zeros(2, 10, 6), torch.zeros(2, 6, 10))    # 24-byte rows: refused by torch
    reason = native_grouped_unavailable(torch.zeros(3, 6), *odd)
    assert reason is None or "probe" in reason
    # whichever path, ops.moe_experts in the native profile computes the same experts
    x, experts = torch.randn(4, 6), torch.tensor([[0, 1], [1, 0], [1, 1], [0, 0]])
    odd = tuple(torch.randn(w.shape) for w in odd)
    with torch.no_grad():
        stacked = ops.moe_experts(x, experts, *odd, profile="native")
        listed = ops.moe_experts(x, experts, *(list(w) for w in odd), profile="native")
    assert_close_report(stacked, listed, atol=1e-6, rtol=1e-6, what="native experts, stacked vs lists")


def test_native_moe_engine_samples_and_overlaps_in_the_graphs():
    torch.manual_seed(0)
    moe = tiny_model("qwen3_moe", seed=4, init_std=0.2, **MOE)
    engine = RolloutEngine(moe, RolloutConfig(profile="native", num_pages=64, page_size=4, decode_graphs="padded",
                                              overlap="on", decode_graph_max_batch=8))
    assert native_experts_read_host(engine.model) is None
    got = engine.generate([[1, 2, 3, 4, 5], [7, 8]], SamplingParams(n=2, max_new_tokens=5, seed=1, ignore_eos=True))
    assert all(len(c.tokens) == 5 for c in got)
    assert engine.counters["graph_steps"] > 0 and engine.counters["overlapped_steps"] > 0
