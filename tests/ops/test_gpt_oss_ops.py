"""gpt-oss's ops: moe_route_topk_softmax, clamped_swiglu, YaRN rope tables.

Row invariance (bitwise: a token's routing and activation do not depend on the other rows), accuracy vs
transformers' formulas in float64, the tie rule (equal logits: the lower expert index), gradients vs float64
autograd, and the YaRN inverse frequencies / attention factor vs transformers' ``_compute_yarn_parameters``.
"""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from tests.bitwise import assert_bitwise_equal, assert_close_report

SETTINGS = dict(max_examples=20, deadline=None)


@settings(**SETTINGS)
@given(rows=st.integers(1, 70), experts=st.integers(1, 12), data=st.data(), seed=st.integers(0, 2**16))
def test_route_is_row_invariant_and_matches_topk_then_softmax(rows, experts, data, seed):
    k = data.draw(st.integers(1, experts))
    logits = torch.randn(rows, experts, generator=torch.Generator().manual_seed(seed)) * 3
    ids, w = ops.moe_route_topk_softmax(logits, k)
    row = data.draw(st.integers(0, rows - 1))
    ids1, w1 = ops.moe_route_topk_softmax(logits[row:row + 1], k)
    assert torch.equal(ids[row:row + 1], ids1)
    assert_bitwise_equal(w[row:row + 1], w1, "a row routed alone")
    values, ref_ids = torch.topk(logits.double(), k, dim=-1)
    assert torch.equal(torch.sort(ids, -1).values, torch.sort(ref_ids, -1).values)
    assert_close_report(w, torch.softmax(values, -1), 1e-6, 1e-6, "weights")


def test_route_ties_go_to_the_lower_expert_and_gradients_match():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]], requires_grad=True)
    ids, w = ops.moe_route_topk_softmax(logits, 2)
    assert ids.tolist() == [[1, 2], [0, 1]]
    g = torch.tensor([[0.3, -1.0], [2.0, 0.5]])
    (w * g).sum().backward()
    ref = logits.detach().double().requires_grad_(True)
    (torch.softmax(ref.gather(1, ids), -1) * g.double()).sum().backward()
    assert_close_report(logits.grad, ref.grad, 1e-7, 1e-6, "d logits")


def _hf_swiglu(gate, up, alpha, limit):
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_accuracy_row_invariance_and_gradient(dtype):
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(33, 40, generator=gen) * 6).to(dtype), (torch.randn(33, 40, generator=gen) * 6).to(dtype)
    out = ops.clamped_swiglu(gate, up, 1.702, 7.0)
    assert out.dtype == dtype
    assert_bitwise_equal(out[5:6], ops.clamped_swiglu(gate[5:6], up[5:6], 1.702, 7.0), "one row alone")
    ref = _hf_swiglu(gate.double(), up.double(), 1.702, 7.0)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_close_report(out, ref, tol, tol, "clamped swiglu")
    if dtype == torch.float32:
        a, b = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
        ops.clamped_swiglu(a, b, 1.702, 7.0).sum().backward()
        ra, rb = gate.double().requires_grad_(True), up.double().requires_grad_(True)
        _hf_swiglu(ra, rb, 1.702, 7.0).sum().backward()
        assert_close_report(a.grad, ra.grad, 1e-5, 1e-5, "d gate")
        assert_close_report(b.grad, rb.grad, 1e-5, 1e-5, "d up")


@pytest.mark.parametrize("params", [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    dict(factor=4.0, original_max_position_embeddings=64),                       # truncate defaults to true
    dict(factor=8.0, original_max_position_embeddings=2048, mscale=1.0, mscale_all_dim=0.5),
    dict(factor=4.0, original_max_position_embeddings=512, attention_factor=1.3),
])
def test_yarn_tables_match_transformers(params):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = dict(params, rope_type="yarn")
    cfg = transformers.GptOssConfig(head_dim=64, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                    max_position_embeddings=131072, rope_parameters=dict(scaling, rope_theta=150000.0))
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = ops.rope_inv_freq(64, 150000.0, scaling)
    assert ours.dtype == torch.float64
    assert_close_report(ours, inv.double(), 0, 1e-6, "inv_freq (transformers computes in fp32)")
    assert math.isclose(ops.rope_attention_scaling(scaling), factor, rel_tol=1e-12)
