"""DeepSeek-V3's router op (ops.moe_route_grouped_sigmoid): row invariance (bitwise: a token's experts and weights
do not depend on the other rows or their order), agreement with transformers' DeepseekV3TopkRouter arithmetic in
float64, the tie rule (equal values: the lower group, then the lower expert first), the bias used for the choice
only, gradients vs float64 autograd, refusals."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract.errors import RLAlignError
from tests.bitwise import assert_bitwise_equal, assert_close_report

SETTINGS = dict(max_examples=25, deadline=None)


def reference(logits, bias, k, n_group, topk_group, normalize, scaling):
    """transformers' DeepseekV3TopkRouter.forward after its linear, in float64: (expert sets, weights by expert)."""
    scores = logits.double().sigmoid()
    choice = scores + bias.double()
    t, e = choice.shape
    group = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    idx = torch.topk(group, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group).scatter_(1, idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e)
    chosen = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), k=k, dim=-1, sorted=False)[1]
    w = scores.gather(1, chosen)
    if normalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen, w * scaling


def shape(draw):
    n_group = draw(st.integers(1, 4))
    size = draw(st.integers(2, 5))
    topk_group = draw(st.integers(1, n_group))
    k = draw(st.integers(1, topk_group * size))
    return n_group, size, topk_group, k


@settings(**SETTINGS)
@given(rows=st.integers(1, 40), data=st.data(), seed=st.integers(0, 2**16), normalize=st.booleans())
def test_row_invariant_and_matches_transformers(rows, data, seed, normalize):
    n_group, size, topk_group, k = shape(data.draw)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, n_group * size, generator=gen) * 2
    bias = torch.randn(n_group * size, generator=gen) * 0.3
    args = dict(n_group=n_group, topk_group=topk_group, normalize=normalize, scaling=2.5)
    ids, w = ops.moe_route_grouped_sigmoid(logits, bias, k, **args)
    perm = torch.randperm(rows, generator=gen)
    ids_p, w_p = ops.moe_route_grouped_sigmoid(logits[perm], bias, k, **args)
    assert torch.equal(ids[perm], ids_p)
    assert_bitwise_equal(w[perm], w_p, "rows permuted")
    row = data.draw(st.integers(0, rows - 1))
    ids1, w1 = ops.moe_route_grouped_sigmoid(logits[row:row + 1], bias, k, **args)
    assert torch.equal(ids[row:row + 1], ids1)
    assert_bitwise_equal(w[row:row + 1], w1, "a row routed alone")
    ref_ids, ref_w = reference(logits, bias, k, n_group, topk_group, normalize, 2.5)
    order, ref_order = torch.sort(ids, -1), torch.sort(ref_ids, -1)
    assert torch.equal(order.values, ref_order.values)
    assert_close_report(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices), 1e-6, 1e-6, "weights")
    native_ids, native_w = ops.moe_route_grouped_sigmoid(logits, bias, k, profile="native", **args)
    assert torch.equal(torch.sort(native_ids, -1).values, order.values)


def test_ties_go_to_the_lower_group_then_the_lower_expert():
    args = dict(n_group=2, topk_group=1, normalize=False, scaling=1.0)
    zeros = torch.zeros(4)
    ids, _ = ops.moe_route_grouped_sigmoid(torch.zeros(1, 4), zeros, 1, **args)
    assert ids.tolist() == [[0]]                                     # both groups equal: group 0, its expert 0
    ids, _ = ops.moe_route_grouped_sigmoid(torch.tensor([[0.0, 1.0, 1.0, 0.0]]), zeros, 1, **args)
    assert ids.tolist() == [[1]]                                     # group scores equal: group 0 kept
    ids, _ = ops.moe_route_grouped_sigmoid(torch.tensor([[1.0, 1.0, 5.0, -9.0]]), zeros, 2,
                                           **dict(args, topk_group=2))
    assert ids.tolist() == [[2, 0]]                                  # equal experts 0 and 1: 0 first


def test_bias_changes_the_choice_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    ids, w = ops.moe_route_grouped_sigmoid(logits, bias, 1, n_group=1, topk_group=1, normalize=False, scaling=3.0)
    assert ids.tolist() == [[3]]
    assert_bitwise_equal(w, (1.0 / (1.0 + torch.exp(-logits[:, 3:]))) * 3.0, "unbiased score x scaling")


def test_gradients_match_float64_autograd():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 8, generator=gen) * 2).requires_grad_(True)
    bias, g = torch.randn(8, generator=gen) * 0.2, torch.randn(6, 3, generator=gen)
    args = dict(n_group=4, topk_group=2, normalize=True, scaling=2.5)
    ids, w = ops.moe_route_grouped_sigmoid(logits, bias, 3, **args)
    (w * g).sum().backward()
    ref = logits.detach().double().requires_grad_(True)
    s = ref.sigmoid().gather(1, ids)
    ((s / s.sum(-1, keepdim=True)) * 2.5 * g.double()).sum().backward()
    assert_close_report(logits.grad, ref.grad, 1e-6, 1e-5, "d logits")


@pytest.mark.parametrize("experts, k, n_group, topk_group, match", [
    (6, 2, 4, 1, "do not split into n_group=4"),
    (4, 1, 4, 1, "do not split into n_group=4 groups of >= 2"),
    (8, 5, 2, 1, "top_k=5 must be between 1 and the 4 experts"),
    (8, 1, 2, 3, "topk_group=3"),
])
def test_refusals(experts, k, n_group, topk_group, match):
    with pytest.raises(RLAlignError, match=match):
        ops.moe_route_grouped_sigmoid(torch.zeros(2, experts), torch.zeros(experts), k, n_group=n_group,
                                      topk_group=topk_group, normalize=True, scaling=1.0)
    with pytest.raises(RLAlignError, match="router logits must be float32"):
        ops.moe_route_grouped_sigmoid(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8), 1, n_group=2,
                                      topk_group=1, normalize=True, scaling=1.0)
