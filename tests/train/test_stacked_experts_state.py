"""Run checkpoints across the MoE expert layout change: a checkpoint written while experts were one parameter
per expert and projection (weights, masters and AdamW state per expert) is restacked on resume/export."""

from __future__ import annotations

import pytest
import torch

from rlalign.contract.errors import RLAlignError
from rlalign.models.layout import checkpoint_entries, checkpoint_split, entry_view
from rlalign.models.testing import tiny_model
from rlalign.train.master import ROUNDED_KEY
from rlalign.train.parallel import clip_grad_norm_, restack_run_state
from tests.bitwise import assert_bitwise_equal

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, num_hidden_layers=2)


def _trained(seed: int = 0):
    """A tiny MoE policy and its AdamW after two steps of random gradients on every parameter."""
    model = tiny_model("qwen3_moe", seed=seed, init_std=0.1, **MOE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return model, optimizer


def _per_expert(model, state: dict) -> dict:
    """``state`` as the per-expert layout wrote it: tensors by checkpoint name, AdamW state per checkpoint
    tensor (indices in checkpoint order)."""
    entries = checkpoint_entries(model)
    params = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    old = dict(state)
    for key in ("model", "master"):
        old[key] = {n: t.clone() for n, t in checkpoint_split(model, state[key])}
    old[ROUNDED_KEY] = {e.checkpoint_name: state[ROUNDED_KEY][e.param_name] for e in entries}
    opt = state["optimizer"]
    old_state = {}
    for i, e in enumerate(entries):
        s = opt["state"][params[e.param_name]]
        old_state[i] = {k: v if k == "step" else entry_view(v, e).clone() for k, v in s.items()}
    old["optimizer"] = {"state": old_state, "param_groups": [dict(opt["param_groups"][0],
                                                                  params=list(range(len(entries))))]}
    return old


def _state(model, optimizer) -> dict:
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"model": weights, "master": weights, ROUNDED_KEY: {n: "bfloat16" for n in weights},
            "optimizer": optimizer.state_dict()}


def test_a_per_expert_run_checkpoint_restacks_to_the_stacked_state_bit_for_bit():
    model, optimizer = _trained()
    new = _state(model, optimizer)
    old = _per_expert(model, new)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in old["model"]
    got = restack_run_state(model, old)
    for key in ("model", "master"):
        assert list(got[key]) != [] and set(got[key]) == set(new[key])
        for name, t in new[key].items():
            assert_bitwise_equal(got[key][name], t, f"{key} {name}")
    assert got[ROUNDED_KEY] == new[ROUNDED_KEY]
    assert got["optimizer"]["param_groups"] == new["optimizer"]["param_groups"]
    for i, s in new["optimizer"]["state"].items():
        for k, v in s.items():
            assert_bitwise_equal(got["optimizer"]["state"][i][k], v, f"optimizer state {i} {k}")
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    fresh.load_state_dict(got["optimizer"])          # torch accepts it as this policy's state
    assert restack_run_state(model, new) is new      # a stacked checkpoint passes as it is


def test_experts_that_took_different_numbers_of_steps_are_refused_in_one_line():
    model, optimizer = _trained(1)
    old = _per_expert(model, _state(model, optimizer))
    old["optimizer"]["state"][next(i for i, e in enumerate(checkpoint_entries(model)) if e.index == 2)]["step"] = \
        torch.tensor(1.0)
    with pytest.raises(RLAlignError, match="took different numbers of optimizer steps"):
        restack_run_state(model, old)
    del old["model"]["model.layers.1.mlp.experts.1.up_proj.weight"]
    with pytest.raises(RLAlignError, match=r"experts.up_proj: piece 1 of 4 is missing"):
        restack_run_state(model, old)


def test_the_gradient_norm_is_the_norm_over_the_checkpoint_tensors():
    """Clipping takes the norm of the per-expert gradient slices in checkpoint order: the bits of the norm the
    per-expert parameters had (torch's norm of each, then of the norms), not the stacked tensors' norm."""
    model, _ = _trained(2)
    gen = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    pieces = [g.clone() for _, g in checkpoint_split(model, {n: p.grad for n, p in model.named_parameters()})]
    want = torch.nn.utils.get_total_norm(pieces, foreach=False)
    assert_bitwise_equal(clip_grad_norm_(model, 1e9), want)
