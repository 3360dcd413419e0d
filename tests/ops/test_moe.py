"""MoE ops: routing, experts and combine -- bitwise invariance (tier 1) and float64 accuracy (tier 2)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.algos import load_balancing_loss
from rlalign.contract.errors import ContractError
from tests.bitwise import assert_bitwise_equal, assert_close_report

DTYPES = [torch.float32, torch.bfloat16]
SETTINGS = dict(max_examples=20, deadline=None)


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _weights(n_experts, inter, hidden, dtype, seed):
    return (_rand(n_experts, inter, hidden, dtype=dtype, seed=seed, scale=hidden ** -0.5),
            _rand(n_experts, inter, hidden, dtype=dtype, seed=seed + 1, scale=hidden ** -0.5),
            _rand(n_experts, hidden, inter, dtype=dtype, seed=seed + 2, scale=inter ** -0.5))


def _moe(x, router_w, gate, up, down, top_k, normalize=True, profile=None):
    logits = ops.router_logits(x, router_w, profile=profile)
    experts, weights = ops.moe_route(logits, top_k, normalize=normalize, profile=profile)
    y = ops.moe_experts(x, experts, gate, up, down, profile=profile)
    return ops.moe_combine(y, weights, experts), experts


# ---- tier 1: bitwise ----------------------------------------------------------------------------

@settings(**SETTINGS)
@given(tokens=st.integers(1, 150), n_experts=st.sampled_from([1, 2, 7, 8, 64, 128]), data=st.data(),
       normalize=st.booleans(), seed=st.integers(0, 2**16))
def test_route_row_is_batch_invariant(tokens, n_experts, data, normalize, seed):
    top_k = data.draw(st.integers(1, n_experts))
    logits = _rand(tokens, n_experts, seed=seed, scale=3.0)
    e_all, w_all = ops.moe_route(logits, top_k, normalize=normalize)
    perm = torch.randperm(tokens, generator=torch.Generator().manual_seed(seed))
    e_perm, w_perm = ops.moe_route(logits[perm], top_k, normalize=normalize)
    assert torch.equal(e_perm, e_all[perm])
    assert_bitwise_equal(w_perm, w_all[perm], "weights, rows permuted")
    i = data.draw(st.integers(0, tokens - 1))
    e_one, w_one = ops.moe_route(logits[i:i + 1], top_k, normalize=normalize)
    assert torch.equal(e_one, e_all[i:i + 1])
    assert_bitwise_equal(w_one, w_all[i:i + 1], f"row {i} alone vs in a batch of {tokens}")


def test_route_ties_go_to_the_lower_expert_index():
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    experts, weights = ops.moe_route(logits, 2, normalize=False)
    assert experts.tolist() == [[1, 2], [0, 1]]
    assert weights[0, 0] == weights[0, 1]


def test_route_weights_normalise_in_rank_order():
    logits = _rand(33, 16, seed=3, scale=2.0)
    experts, w = ops.moe_route(logits, 4, normalize=True)
    _, p = ops.moe_route(logits, 4, normalize=False)
    denom = ((p[:, 0] + p[:, 1]) + p[:, 2]) + p[:, 3]
    assert_bitwise_equal(w, p / denom.unsqueeze(-1))


@settings(**SETTINGS)
@given(tokens=st.integers(1, 90), n_experts=st.sampled_from([1, 3, 8]), data=st.data(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_expert_output_ignores_batch_order_and_expert_load(tokens, n_experts, data, dtype, seed):
    """A token's expert outputs are the same alone, in a batch, permuted, and when many other tokens
    were routed to the same experts (the group size changes; the row's bits must not)."""
    top_k = data.draw(st.integers(1, n_experts))
    hidden, inter = 32, 24
    x = _rand(tokens, hidden, dtype=dtype, seed=seed)
    gate, up, down = _weights(n_experts, inter, hidden, dtype, seed + 10)
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(tokens)])
    y = ops.moe_experts(x, experts, gate, up, down)
    perm = torch.randperm(tokens, generator=g)
    assert_bitwise_equal(ops.moe_experts(x[perm], experts[perm], gate, up, down), y[perm], "tokens permuted")
    i = data.draw(st.integers(0, tokens - 1))
    assert_bitwise_equal(ops.moe_experts(x[i:i + 1], experts[i:i + 1], gate, up, down), y[i:i + 1],
                         f"token {i} alone vs with {tokens - 1} others")
    # heavy load: the same token among 300 others that all chose its experts
    crowd = torch.cat([x[i:i + 1].expand(300, hidden), x[i:i + 1]])
    crowd_experts = experts[i:i + 1].expand(301, top_k)
    assert_bitwise_equal(ops.moe_experts(crowd, crowd_experts, gate, up, down)[-1:], y[i:i + 1], "crowded expert")


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_adds_in_expert_index_order_whatever_the_rank_order(dtype):
    y = _rand(20, 4, 16, dtype=dtype, seed=1)
    w = _rand(20, 4, seed=2).abs()
    experts = torch.stack([torch.randperm(9, generator=torch.Generator().manual_seed(i))[:4] for i in range(20)])
    out = ops.moe_combine(y, w, experts)
    flip = torch.arange(3, -1, -1)
    assert_bitwise_equal(ops.moe_combine(y[:, flip], w[:, flip], experts[:, flip]), out)
    order = torch.argsort(experts, dim=1)
    ys, ws = y.gather(1, order.unsqueeze(-1).expand_as(y)).float(), w.gather(1, order)
    acc = ys[:, 0] * ws[:, :1]
    for j in range(1, 4):
        acc = acc + ys[:, j] * ws[:, j:j + 1]
    assert_bitwise_equal(out, acc.to(dtype), "the stated formula")


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_block_prefill_equals_token_by_token(dtype):
    """Prefill (all tokens in one call) == decode (one token per call), bit for bit."""
    hidden, inter, n_experts, top_k = 48, 32, 8, 2
    x = _rand(37, hidden, dtype=dtype, seed=5)
    router = _rand(n_experts, hidden, dtype=dtype, seed=6, scale=hidden ** -0.5)
    gate, up, down = _weights(n_experts, inter, hidden, dtype, 7)
    full, experts = _moe(x, router, gate, up, down, top_k)
    for t in range(x.shape[0]):
        one, e_one = _moe(x[t:t + 1], router, gate, up, down, top_k)
        assert torch.equal(e_one, experts[t:t + 1]), f"token {t} routed differently alone"
        assert_bitwise_equal(one, full[t:t + 1], f"token {t}")


def test_backward_is_deterministic_and_rows_of_input_grad_are_batch_invariant():
    hidden, inter, n_experts, top_k = 32, 16, 6, 2
    router = _rand(n_experts, hidden, seed=1, scale=0.3).requires_grad_()
    gate, up, down = (t.requires_grad_() for t in _weights(n_experts, inter, hidden, torch.float32, 2))
    x = _rand(40, hidden, seed=3).requires_grad_()
    target = _rand(40, hidden, seed=4)

    def grads(xx, tt):
        out, _ = _moe(xx, router, gate, up, down, top_k)
        return torch.autograd.grad((out * tt).sum(), (xx, router, gate, up, down))

    first, second = grads(x, target), grads(x, target)
    for a, b, name in zip(first, second, ("x", "router", "gate", "up", "down")):
        assert_bitwise_equal(a, b, f"d{name} run to run")
    alone = grads(x[5:6], target[5:6])
    assert_bitwise_equal(alone[0], first[0][5:6], "dx of token 5 alone vs in the batch")


def test_degenerate_sizes():
    hidden, inter = 16, 8
    gate, up, down = _weights(4, inter, hidden, torch.float32, 0)
    router = _rand(4, hidden, seed=1)
    empty = torch.zeros(0, hidden)
    out, experts = _moe(empty, router, gate, up, down, 2)
    assert out.shape == (0, hidden) and experts.shape == (0, 2)
    one_expert = _weights(1, inter, hidden, torch.float32, 3)
    out1, e1 = _moe(_rand(5, hidden, seed=2), _rand(1, hidden, seed=3), *one_expert, 1)
    assert e1.eq(0).all() and out1.shape == (5, hidden)


def test_bad_inputs_fail_with_a_clear_message():
    logits = _rand(3, 4)
    with pytest.raises(ContractError, match="top_k=5"):
        ops.moe_route(logits, 5, normalize=True)
    with pytest.raises(ContractError, match="float32"):
        ops.moe_route(logits.bfloat16(), 2, normalize=True)
    bad = logits.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ContractError, match="NaN"):
        ops.moe_route(bad, 2, normalize=True)
    gate, up, down = _weights(4, 8, 16, torch.float32, 0)
    with pytest.raises(ContractError, match="expert id 7"):
        ops.moe_experts(_rand(2, 16), torch.tensor([[0, 7], [1, 2]]), gate, up, down)
    with pytest.raises(ContractError, match="do not fit"):
        ops.moe_experts(_rand(2, 15), torch.tensor([[0, 1], [1, 2]]), gate, up, down)


# ---- tier 2: accuracy against float64 -----------------------------------------------------------

def _reference(x, router, gate, up, down, top_k, normalize):
    """The Qwen3-MoE block in float64 (transformers' formulation)."""
    x, router, gate, up, down = (t.double() for t in (x, router, gate, up, down))
    probs = torch.softmax(x @ router.T, dim=-1)
    w, e = torch.topk(probs, top_k, dim=-1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            k = e[t, j]
            act = torch.nn.functional.silu(gate[k] @ x[t]) * (up[k] @ x[t])
            out[t] += w[t, j] * (down[k] @ act)
    return out, e


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_block_matches_float64_reference(normalize, dtype, atol):
    hidden, inter, n_experts, top_k = 64, 48, 16, 4
    x = _rand(50, hidden, dtype=dtype, seed=11)
    router = _rand(n_experts, hidden, dtype=dtype, seed=12, scale=hidden ** -0.5)
    gate, up, down = _weights(n_experts, inter, hidden, dtype, 13)
    out, experts = _moe(x, router, gate, up, down, top_k, normalize)
    ref, ref_experts = _reference(x, router, gate, up, down, top_k, normalize)
    assert torch.equal(experts.sort(-1).values, ref_experts.sort(-1).values)  # no near-ties in this draw
    assert_close_report(out, ref, atol=atol, rtol=atol, what=f"moe block {dtype}")
    native, _ = _moe(x, router, gate, up, down, top_k, normalize, profile="native")
    assert_close_report(native, ref, atol=atol, rtol=atol, what="native profile")


def test_load_balancing_loss_formula():
    logits = _rand(10, 4, seed=1)
    experts, _ = ops.moe_route(logits, 2, normalize=True)
    probs = torch.softmax(logits.double(), -1)
    frac = torch.bincount(experts.reshape(-1), minlength=4).double() / 20
    expected = 4 * (frac * probs.mean(0)).sum()
    assert abs(load_balancing_loss(logits, experts).item() - expected.item()) < 1e-6


def test_per_expert_weight_lists_equal_stacked_weights():
    gate, up, down = _weights(5, 12, 16, torch.float32, 4)
    x = _rand(9, 16, seed=1)
    experts = torch.tensor([[0, 4], [1, 2], [3, 0], [2, 1], [4, 3], [0, 1], [2, 3], [4, 0], [1, 3]])
    stacked = ops.moe_experts(x, experts, gate, up, down)
    lists = ops.moe_experts(x, experts, list(gate.unbind(0)), list(up.unbind(0)), list(down.unbind(0)))
    assert_bitwise_equal(lists, stacked)


# ---- stacked expert weights (the model's layout) --------------------------------------------------------

def _accumulate_edges(root, weight) -> int:
    """How many edges of ``root``'s autograd graph end in ``weight``'s AccumulateGrad node (one per gradient
    autograd accumulates into the tensor: a stacked weight read as E views would have E)."""
    seen, stack, count = set(), [root], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is weight:
                count += 1
            stack.append(nxt)
    return count


@settings(**SETTINGS)
@given(tokens=st.integers(0, 40), n_experts=st.sampled_from([1, 2, 5, 16]), data=st.data(),
       dtype=st.sampled_from(DTYPES), strided=st.booleans(), native=st.booleans(), seed=st.integers(0, 2**16))
def test_stacked_weights_give_the_per_expert_lists_bits_and_one_gradient_each(tokens, n_experts, data, dtype,
                                                                             strided, native, seed):
    """ops.moe_experts on stacked [E, ...] tensors (contiguous, or gate/up as the two halves of a fused
    [E, 2I, H] tensor: strided views) equals the per-expert lists bit for bit: y, dx, and each used expert's
    dW_e at [e] of the stacked gradient (idle experts: zeros there, no gradient in the list). The stacked
    tensor is one autograd input: exactly one gradient edge into it, whatever E (a list: one per used expert)."""
    top_k = data.draw(st.integers(1, n_experts))
    hidden, inter = 32, 24
    profile = "native" if native else None
    x = _rand(tokens, hidden, dtype=dtype, seed=seed)
    gate, up, down = _weights(n_experts, inter, hidden, dtype, seed + 10)
    g = torch.Generator().manual_seed(seed)
    experts = (torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens
               else torch.zeros((0, top_k), dtype=torch.long))
    grad_y = _rand(tokens, top_k, hidden, dtype=dtype, seed=seed + 3)

    lists = [[w.clone().requires_grad_(True) for w in t.unbind(0)] for t in (gate, up, down)]
    x_list = x.clone().requires_grad_(True)
    y_list = ops.moe_experts(x_list, experts, *lists, down_segments=4, profile=profile)

    fused = torch.cat([gate, up], dim=1).requires_grad_(True)          # [E, 2I, H]
    down_s = down.clone().requires_grad_(True)
    gate_s, up_s = ((fused[:, :inter], fused[:, inter:]) if strided
                    else (gate.clone().requires_grad_(True), up.clone().requires_grad_(True)))
    x_s = x.clone().requires_grad_(True)
    y_s = ops.moe_experts(x_s, experts, gate_s, up_s, down_s, down_segments=4, profile=profile)
    assert_bitwise_equal(y_s, y_list, "y stacked vs lists")
    if not tokens:
        return
    # one edge per stacked tensor, whatever E (the fused tensor holds two: gate and up)
    for w, edges in ((down_s, 1), (fused, 2) if strided else (gate_s, 1)):
        assert _accumulate_edges(y_s.grad_fn, w) == edges
    y_list.backward(grad_y)
    y_s.backward(grad_y)
    assert_bitwise_equal(x_s.grad, x_list.grad, "dx stacked vs lists")
    stacked_grads = ((fused.grad[:, :inter], fused.grad[:, inter:]) if strided else (gate_s.grad, up_s.grad)) \
        + (down_s.grad,)
    used = set(experts.reshape(-1).tolist())
    for name, got, per_expert in zip(("gate", "up", "down"), stacked_grads, lists):
        for e, w in enumerate(per_expert):
            if e in used:
                assert_bitwise_equal(got[e], w.grad, f"{name} dW of expert {e}")
            else:
                assert w.grad is None and not bool(got[e].any()), f"{name}: idle expert {e}"


def test_stacked_and_listed_weights_cannot_mix():
    gate, up, down = _weights(3, 24, 32, torch.float32, 0)
    with pytest.raises(ContractError, match="all be stacked"):
        ops.moe_experts(_rand(4, 32), torch.zeros(4, 1, dtype=torch.long), gate, list(up.unbind(0)), down)
    with pytest.raises(ContractError, match=r"want \[E, I, H\], \[E, I, H\], \[E, H, I\]"):
        ops.moe_experts(_rand(4, 32), torch.zeros(4, 1, dtype=torch.long), gate, up, down.transpose(1, 2))


# ---- the gated shared expert (Qwen3-Next) --------------------------------------------------------------------

@settings(**SETTINGS)
@given(tokens=st.integers(0, 70), hidden=st.sampled_from([1, 3, 8, 17, 64]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), data=st.data())
def test_shared_expert_gate_row_is_batch_invariant(tokens, hidden, dtype, seed, data):
    """Each row's bits are its own (the gate written 1 / (1 + exp(-l)): torch's CPU sigmoid differs between its
    vector body and its scalar tail), whatever the rows around it; the value is float64's within a few fp32 roundings
    (exp, add, div, mul) and the one rounding to the dtype."""
    shared, logits = _rand(tokens, hidden, dtype=dtype, seed=seed), _rand(tokens, 1, dtype=dtype, seed=seed + 1,
                                                                              scale=4.0)
    out = ops.shared_expert_gate(shared, logits, profile="strict")
    assert out.dtype == dtype and out.shape == shared.shape
    if tokens:
        i = data.draw(st.integers(0, tokens - 1))
        assert_bitwise_equal(ops.shared_expert_gate(shared[i:i + 1], logits[i:i + 1], profile="strict"), out[i:i + 1],
                             f"row {i} alone")
        perm = torch.randperm(tokens, generator=torch.Generator().manual_seed(seed))
        assert_bitwise_equal(ops.shared_expert_gate(shared[perm], logits[perm], profile="strict"), out[perm], "permuted")
    ref = shared.double() * torch.sigmoid(logits.double())
    rtol = torch.finfo(dtype).eps / 2 + 4 * torch.finfo(torch.float32).eps
    assert_close_report(out.double(), ref, atol=0.0, rtol=rtol, what="vs float64")


def test_shared_expert_gate_refusals():
    with pytest.raises(ContractError, match="gate_logits must be \\[T, 1\\] = \\[3, 1\\], got \\(3, 2\\)"):
        ops.shared_expert_gate(torch.ones(3, 4), torch.ones(3, 2))
    with pytest.raises(ContractError, match="not implemented in the portable profile"):
        ops.shared_expert_gate(torch.ones(3, 4), torch.ones(3, 1), profile="portable")
