"""Activation checkpointing through RecomputedLayer modules: the same parameters under the same names (state dict
and checkpoints unchanged), no patched ``forward``, each layer run again in backward, and the same bits."""

import copy

import pytest
import torch

from rlalign.models.batch import ForwardBatch
from rlalign.models.decoder import DecoderLayer
from rlalign.models.testing import tiny_model
from rlalign.train.layer_recompute import RecomputedLayer, recompute_layers
from tests.bitwise import assert_bitwise_equal


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model.forward_hidden(batch).float().square().mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _layer_runs(monkeypatch) -> list[int]:
    """The layer index of every decoder layer's forward from now on (recomputes included)."""
    runs, forward = [], DecoderLayer.forward

    def counted(layer, *args):
        runs.append(layer.layer_index)
        return forward(layer, *args)

    monkeypatch.setattr(DecoderLayer, "forward", counted)
    return runs


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_recomputed_layers_keep_names_recompute_in_backward_and_give_the_same_bits(family, monkeypatch):
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if family == "qwen3_moe" else {}
    plain = tiny_model(family, seed=3, init_std=0.2, num_hidden_layers=2, **extra).train()
    model = copy.deepcopy(plain)
    names, keys, params = [n for n, _ in model.named_parameters()], list(model.state_dict()), list(model.parameters())
    recompute_layers(model)
    assert all(isinstance(layer, RecomputedLayer) for layer in model.model.layers)
    assert all("forward" not in vars(layer) for layer in model.model.layers)   # a module, not a patched forward
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    assert all(a is b for a, b in zip(model.parameters(), params))              # the very same tensors
    assert [layer.layer_index for layer in model.model.layers] == [0, 1]

    batch = ForwardBatch.packed([[3, 4, 5, 6, 7], [8, 9, 10]])
    runs = _layer_runs(monkeypatch)
    want = _loss_and_grads(plain, batch)
    assert runs == [0, 1]
    runs.clear()
    got = _loss_and_grads(model, batch)
    # every layer run again in backward, the last one first (MoE layers twice: torch's non-reentrant checkpoint
    # recomputes them again for a second unpack, as it did when the trainer patched each layer's forward)
    assert runs[:2] == [0, 1] and runs[2] == 1 and set(runs[2:]) == {0, 1}
    assert_bitwise_equal(got[0], want[0], "loss")
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert_bitwise_equal(got[1][name], want[1][name], name)
    runs.clear()
    with torch.no_grad():
        model.forward_hidden(batch)
    assert runs == [0, 1]   # without grad: run once, nothing to recompute
