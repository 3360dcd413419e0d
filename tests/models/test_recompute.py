"""Activation recomputation (rlalign.models.recompute): the gradients keep their bits, the saved bytes drop
by exactly the rebuilt tensors, and misuse fails closed.

Models run in fp32 on the CPU torch backend: there its norm and silu_mul save their own inputs (``.float()``
of an fp32 tensor is the tensor), so every recipe applies. In bf16 they save fp32 copies and nothing is
rebuilt (checked too). The Triton backend runs the same checks under the interpreter (fp32), in a subprocess."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.checkpoint import checkpoint

from rlalign import ops
from rlalign.contract import use_profile
from rlalign.contract.errors import RLAlignError
from rlalign.models import ForwardBatch, recompute
from rlalign.models.testing import tiny_model
from tests.bitwise import assert_bitwise_equal
from tests.models.test_three_paths import FAMILIES

DENSE_PACKS = 6   # per dense layer: q/k/v_proj and gate/up_proj read a rebuilt norm output, down_proj silu_mul's
QK_NORM_PACKS = 2   # and with a q/k norm: attention's roped q and k


def packs_per_layer(model) -> int:
    return DENSE_PACKS + (QK_NORM_PACKS if model.config.qk_norm else 0)


def make_model(family="qwen3", dtype=torch.float32, device="cpu", **overrides):
    return tiny_model(family, seed=3, dtype=dtype, init_std=0.15, norm_jitter=0.2, device=device,
                      **{**FAMILIES[family], **overrides})


def batch_of(model, lengths, seed=5):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    targets = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=gen)
    return ForwardBatch.packed(seqs, model.device), targets.to(model.device)


def forward_loss(model, batch, targets, layer_wrap=None):
    """forward_hidden from a leaf embedding output (so its gradient is seen), then the fused log-prob."""
    cos, sin = ops.rope_cos_sin(batch.positions, model.inv_freq.to(batch.positions.device))
    h = model.model.embed_tokens(batch.input_ids).detach().requires_grad_(True)
    out, residual = h, None
    for layer in model.model.layers:
        call = layer if layer_wrap is None else layer_wrap(layer)
        out, residual = call(out, residual, cos, sin, batch)
    hidden = ops.rms_norm(out, model.model.norm.weight, model.model.norm.eps, residual=residual)[0]
    lp, _ = ops.logprob_entropy(hidden, model.lm_head_weight, targets)
    return h, (lp * torch.linspace(-1.0, 1.0, lp.shape[0], device=lp.device)).sum()


def saved_bytes_and_grads(model, batch, targets, on: bool, layer_wrap=None):
    """(bytes of the distinct storages saved for backward, recipes packed, {name: grad} incl. the input's)."""
    storages = {}

    def count(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    before = recompute.pack_count()
    with (contextlib.nullcontext() if on else recompute.disabled()), torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        h, loss = forward_loss(model, batch, targets, layer_wrap)
    packs = recompute.pack_count() - before
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}   # (an untied embedding: none)
    grads["input"] = h.grad.clone()
    return sum(storages.values()), packs, grads


def assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert_bitwise_equal(a[name], b[name], name)


def rebuilt_bytes_per_dense_layer(model, tokens: int) -> int:
    """Two norm outputs and silu_mul's output; with a q/k norm also the roped q and k."""
    c, size = model.config, model.dtype.itemsize
    qk = (c.num_heads + c.num_kv_heads) * c.head_dim if c.qk_norm else 0
    return tokens * (2 * c.hidden_size + c.intermediate_size + qk) * size


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradients_bitwise_equal_and_bytes_drop(family):
    model = make_model(family)
    batch, targets = batch_of(model, (9, 66, 1, 23))
    on_bytes, on_packs, on = saved_bytes_and_grads(model, batch, targets, True)
    off_bytes, off_packs, off = saved_bytes_and_grads(model, batch, targets, False)
    assert_same_grads(on, off)
    assert off_packs == 0
    if family == "qwen3_moe":   # layer 0 sparse: its post-norm output is saved by the router (and rebuilt)
        assert on_packs > DENSE_PACKS and off_bytes > on_bytes
        return
    assert on_packs == packs_per_layer(model) * model.config.num_layers
    assert off_bytes - on_bytes == model.config.num_layers * rebuilt_bytes_per_dense_layer(model, 99)


def test_bf16_on_the_torch_backend_rebuilds_nothing():
    """The torch backend's bf16 norm and silu_mul save fp32 copies, not their inputs: a recipe would keep
    its inputs alive for nothing, so none is used (and the gradients are of course unchanged)."""
    model = make_model("qwen3", torch.bfloat16)
    batch, targets = batch_of(model, (17, 30))
    on_bytes, on_packs, on = saved_bytes_and_grads(model, batch, targets, True)
    off_bytes, _, off = saved_bytes_and_grads(model, batch, targets, False)
    assert on_packs == 0 and on_bytes == off_bytes
    assert_same_grads(on, off)


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=4))
def test_any_packing(lengths):
    model = _HYPOTHESIS_MODEL
    batch, targets = batch_of(model, lengths, seed=len(lengths))
    on_bytes, on_packs, on = saved_bytes_and_grads(model, batch, targets, True)
    off_bytes, _, off = saved_bytes_and_grads(model, batch, targets, False)
    assert_same_grads(on, off)
    assert on_packs == packs_per_layer(model) * model.config.num_layers
    assert off_bytes - on_bytes == model.config.num_layers * rebuilt_bytes_per_dense_layer(model, sum(lengths))


_HYPOTHESIS_MODEL = make_model("qwen3")


def _checkpointed(layer):
    return lambda *args: checkpoint(layer, *args, use_reentrant=False)


def test_layer_checkpointing_composes():
    """Under torch.utils.checkpoint (the trainer's optim.activation_checkpointing) nothing is rebuilt by
    recompute (the checkpoint keeps only the layer's inputs); the gradients are the same bits either way."""
    model = make_model("qwen3")
    batch, targets = batch_of(model, (9, 40))
    _, _, plain = saved_bytes_and_grads(model, batch, targets, True)
    _, packs, ckpt_on = saved_bytes_and_grads(model, batch, targets, True, _checkpointed)
    _, _, ckpt_off = saved_bytes_and_grads(model, batch, targets, False, _checkpointed)
    assert packs == 0
    assert_same_grads(plain, ckpt_on)
    assert_same_grads(plain, ckpt_off)


def test_in_place_change_of_a_recipe_input_fails_closed():
    model = make_model("qwen3")
    batch, targets = batch_of(model, (12,))
    _, loss = forward_loss(model, batch, targets)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight.mul_(1.0)   # same values, a new version
    with pytest.raises(RLAlignError, match="rms_norm was modified in place"):
        loss.backward()


def test_double_backward_is_refused():
    model = make_model("qwen3")
    batch, targets = batch_of(model, (12,))
    _, loss = forward_loss(model, batch, targets)
    with pytest.raises(RLAlignError, match="double backward"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)


def test_retained_graph_rebuilds_again():
    model = make_model("qwen3")
    batch, targets = batch_of(model, (12, 5))
    _, loss = forward_loss(model, batch, targets)
    params = list(model.parameters())
    first = torch.autograd.grad(loss, params, retain_graph=True)
    second = torch.autograd.grad(loss, params)
    for a, b in zip(first, second):
        assert_bitwise_equal(a, b)


def test_inactive_without_grad_or_outside_strict():
    model = make_model("qwen3")
    batch, targets = batch_of(model, (12,))
    before = recompute.pack_count()
    with torch.no_grad():
        forward_loss(model, batch, targets)
    with use_profile("native"):
        forward_loss(model, batch, targets)
    assert recompute.pack_count() == before


def test_switch_restores():
    assert recompute.is_enabled()
    with recompute.disabled():
        assert not recompute.is_enabled()
        recompute.set_enabled(True)
        assert recompute.is_enabled()
    assert recompute.is_enabled()


_TRITON_SCRIPT = r"""
import os
from tests.ops.test_triton_interpret import _patch_interpreter
_patch_interpreter()
from rlalign.ops._registry import register
from rlalign.ops.triton_backend import IMPLEMENTATIONS
for op, fn in IMPLEMENTATIONS.items():
    register(op, "triton")(fn)   # the triton kernels for CPU tensors: the interpreter runs them
from tests.models import test_recompute as t
model = t.make_model("qwen3")
batch, targets = t.batch_of(model, (9, 66))
on_bytes, on_packs, on = t.saved_bytes_and_grads(model, batch, targets, True)
off_bytes, _, off = t.saved_bytes_and_grads(model, batch, targets, False)
t.assert_same_grads(on, off)
assert on_packs == t.packs_per_layer(model) * model.config.num_layers, on_packs
assert off_bytes - on_bytes == model.config.num_layers * t.rebuilt_bytes_per_dense_layer(model, 75), (off_bytes, on_bytes)
print("TRITON-RECOMPUTE-OK")
"""


def test_triton_backend_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", RLALIGN_BACKEND="triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "TRITON-RECOMPUTE-OK" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
