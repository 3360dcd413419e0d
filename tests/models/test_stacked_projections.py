"""Stacked projections: q/k/v and gate/up weights laid back to back (modules.stack_rows) and run through
ops.linear_group without grad. The layout is a speed choice only: outputs, gradients, checkpoints and the
optimizer's view of the parameters are those of separate tensors, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract.bits import bits_equal, describe_difference
from rlalign.models.batch import ForwardBatch
from rlalign.models.checkpoint import load_model, save_model, weights_hash
from rlalign.models.modules import Linear, stack_rows
from rlalign.models.testing import tiny_model


def _qkv(model, layer=0):
    a = model.model.layers[layer].self_attn
    return [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]


def _gate_up(model, layer=0):
    m = model.model.layers[layer].mlp
    return [m.gate_proj.weight, m.up_proj.weight]


def _unstacked(model):
    """A copy of ``model`` with every parameter in a tensor of its own."""
    apart = copy.deepcopy(model)
    for p in apart.parameters():
        p.data = p.data.clone()
    assert ops.stacked_rows(_qkv(apart)) is None
    return apart


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_decoder_stacks_its_projections(family):
    model = tiny_model(family)
    for layer in range(len(model.model.layers)):
        assert ops.stacked_rows(_qkv(model, layer)) is not None
        assert ops.stacked_rows(_gate_up(model, layer)) is not None
    if family == "qwen2":   # q/k/v biases are stacked too
        a = model.model.layers[0].self_attn
        assert ops.stacked_rows([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) is not None


def test_stacking_survives_dtype_moves_save_and_load(tmp_path):
    model = tiny_model("qwen3")
    before = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)   # nn.Module._apply gives each parameter a new tensor: CausalLM restacks
    assert ops.stacked_rows(_qkv(model)) is not None and ops.stacked_rows(_gate_up(model)) is not None
    assert all(bits_equal(p, b.to(torch.bfloat16)) for p, b in zip(model.parameters(), before))
    save_model(model, tmp_path / "ckpt")   # safetensors refuses shared memory: each tensor is written on its own
    loaded = load_model(tmp_path / "ckpt")[0]   # config.json names the dtype the model was moved to
    assert loaded.dtype == torch.bfloat16 and loaded.config.dtype == "bfloat16"
    assert ops.stacked_rows(_qkv(loaded)) is not None
    assert weights_hash(loaded) == weights_hash(model) == weights_hash(_unstacked(model))


def test_stacked_rows_detects_only_back_to_back_views():
    w = torch.randn(10, 4)
    parts = [w[0:3], w[3:5], w[5:10]]
    assert bits_equal(ops.stacked_rows(parts), w)
    assert ops.stacked_rows([w[3:5], w[0:3]]) is None             # out of order
    assert ops.stacked_rows([w[0:3], w[4:6]]) is None             # a gap
    assert ops.stacked_rows([w[0:3], w[3:5].clone()]) is None     # another storage
    assert ops.stacked_rows([w[0:3], w[3:5].to(torch.bfloat16)]) is None
    assert ops.stacked_rows([w[0:3], None]) is None
    assert ops.stacked_rows([torch.randn(6, 8)[:, :4]]) is None   # not contiguous


def test_stack_rows_keeps_parameter_objects_and_values():
    lins = [Linear(8, n, True, torch.float32, "cpu") for n in (4, 2, 2)]
    for lin in lins:
        torch.nn.init.normal_(lin.weight)
        torch.nn.init.normal_(lin.bias)
    params = [(lin.weight, lin.weight.detach().clone(), lin.bias, lin.bias.detach().clone()) for lin in lins]
    stack_rows(*lins)
    stack_rows(*lins)   # idempotent
    for lin, (w, w0, b, b0) in zip(lins, params):
        assert lin.weight is w and lin.bias is b and bits_equal(w, w0) and bits_equal(b, b0)
    assert ops.stacked_rows([lin.weight for lin in lins]).shape == (8, 8)
    lins[1].weight.data = lins[1].weight.data.clone()   # a reallocation undoes the stacking, nothing else
    assert ops.stacked_rows([lin.weight for lin in lins]) is None


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 70), widths=st.lists(st.integers(1, 24), min_size=1, max_size=4), k=st.integers(1, 40),
       bias=st.booleans(), stacked=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_linear_group_bits_equal_one_linear_each(m, widths, k, bias, stacked, dtype):
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(sum(widths), k, generator=g).to(dtype)
    b = torch.randn(sum(widths), generator=g).to(dtype)
    cuts = [sum(widths[:i]) for i in range(len(widths) + 1)]
    weights = [w[a:z] if stacked else w[a:z].clone() for a, z in zip(cuts, cuts[1:])]
    biases = [b[a:z] for a, z in zip(cuts, cuts[1:])] if bias else None
    outs = ops.linear_group(x, weights, biases)
    for i, (wi, out) in enumerate(zip(weights, outs)):
        ref = ops.linear(x, wi, biases[i] if bias else None)
        assert bits_equal(out, ref), f"output {i}: {describe_difference(out, ref)}"


def test_linear_group_refuses_bad_input_by_name():
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(Exception, match="linear.*as many biases"):
        ops.linear_group(x, [w, w], [None])
    with pytest.raises(Exception, match="linear.*input features"):
        ops.linear_group(x, [w, torch.randn(5, 3)])
    with pytest.raises(Exception, match="linear.*one or more weights"):
        ops.linear_group(x, [])
    native = ops.linear_group(x, [w], profile="native")
    assert torch.allclose(native[0], torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_forward_and_gradients_bits_equal_unstacked(family):
    """The decoder's forward (no grad: one linear_group per projection set) and a training step's loss and every
    gradient (with grad: one linear per projection) equal those of the same weights in separate tensors."""
    model = tiny_model(family, norm_jitter=0.1)
    apart = _unstacked(model)
    tokens = [[1, 5, 9, 3], [7, 2], [4, 4, 8, 1, 6]]
    with torch.no_grad():
        h, r = (m.forward_hidden(ForwardBatch.packed(tokens)) for m in (model, apart))
    assert bits_equal(h, r), describe_difference(h, r)
    losses = []
    for m in (model, apart):
        out = m.forward_hidden(ForwardBatch.packed(tokens))
        loss = out.float().pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
    assert bits_equal(*losses)
    compared = 0
    for (name, p), q in zip(model.named_parameters(), apart.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert bits_equal(p.grad, q.grad), f"{name}: {describe_difference(p.grad, q.grad)}"
            compared += 1
    assert compared >= 10


def test_linear_and_linear_group_share_a_backend():
    """RLALIGN_TRITON_DISABLE=linear (or linear_group) sends both to the torch backend: a group's outputs must be
    the linear's bits."""
    from rlalign.ops._registry import disabled_ops
    assert disabled_ops("linear") == disabled_ops("linear_group") == {"linear", "linear_group"}
