"""Routing replay (R3) in the sparse block, native profile (:class:`rlalign.models.moe.RoutingReplay`).

- Forced experts: inside ``replay_routing`` every replayed (row, sparse layer) uses the recorded experts, the
  other rows the router's own top-k; the routing record says which the router itself would have chosen; the loss
  is finite and the router gets a finite, non-zero gradient (the gate weights come from the current logits).
- Replaying the router's own choice changes no bit: forward, log-probs and every gradient (the replay weights are
  ``moe_route``'s native weights gathered instead of taken by topk), with and without activation checkpointing.
- ``ops.moe_route_replay`` refuses the strict profile in one line.
Shapes by hypothesis: 1-3 sequences of 1-6 tokens (a sequence of one token included).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from rlalign import ops
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import use_profile
from rlalign.models.batch import ForwardBatch
from rlalign.models.moe import RoutingReplay, record_routing, replay_routing, sparse_layer_indices
from rlalign.models.testing import tiny_model
from rlalign.train.layer_recompute import recompute_layers
from tests.bitwise import assert_bitwise_equal

EXPERTS, TOP_K = 4, 2
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.function_scoped_fixture])


def moe_model():
    return tiny_model("qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                      norm_topk_prob=True, init_std=0.1).train()


@pytest.fixture(scope="module")
def model():
    return moe_model()


sequences = st.lists(st.integers(1, 6), min_size=1, max_size=3).flatmap(
    lambda lens: st.tuples(*[st.lists(st.integers(3, 300), min_size=n, max_size=n) for n in lens]))


def loss_and_grads(model, batch: ForwardBatch, replay: "RoutingReplay | None"):
    """(hidden rows, mean log-prob of each next token, routing record, gradients by name) of one forward and
    backward, replayed by ``replay`` (None: fresh routing)."""
    model.zero_grad(set_to_none=True)
    with replay_routing(replay):   # the backward too: activation checkpointing recomputes layers in it
        with record_routing(keep_logits=False) as record:
            hidden = model.forward_hidden(batch)
            lp, _ = model.head_logprobs(hidden, torch.roll(batch.input_ids, -1))
        lp.mean().backward()
    return hidden.detach(), lp.detach(), record, {n: p.grad.clone() for n, p in model.named_parameters()
                                                  if p.grad is not None}


@SETTINGS
@given(seqs=sequences, data=st.data())
def test_replayed_rows_use_the_recorded_experts_and_the_router_still_learns(model, seqs, data):
    batch = ForwardBatch.packed([list(s) for s in seqs])
    rows, layers = batch.input_ids.shape[0], sparse_layer_indices(model.config)
    recorded = torch.stack([torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(data.draw(
        st.integers(0, 2**31 - 1))))[:TOP_K] for _ in range(rows * len(layers))]).reshape(rows, len(layers), TOP_K)
    replayed = torch.tensor(data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))
    with use_profile("native"):
        _, lp, record, grads = loss_and_grads(model, batch, RoutingReplay(recorded.to(torch.int16), replayed,
                                                                          tuple(layers)))
    used, own = record.expert_ids().long(), record.router_choice_ids().long()
    assert torch.equal(used[replayed], recorded[replayed])   # every replayed (row, layer): the record's experts
    assert torch.equal(used[~replayed], own[~replayed])      # the others: the router's own top-k
    assert bool(torch.isfinite(lp).all())
    for i in layers:
        g = grads[f"model.layers.{i}.mlp.gate.weight"]
        assert bool(torch.isfinite(g).all()) and bool(g.abs().sum() > 0), f"layer {i}'s router got no gradient"


@SETTINGS
@given(seqs=sequences, data=st.data())
def test_replaying_the_routers_own_choice_changes_no_bit(model, seqs, data):
    batch = ForwardBatch.packed([list(s) for s in seqs])
    rows, layers = batch.input_ids.shape[0], tuple(sparse_layer_indices(model.config))
    replayed = torch.tensor(data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))
    with use_profile("native"):
        hidden, lp, record, grads = loss_and_grads(model, batch, None)
        replay = RoutingReplay(record.expert_ids(), replayed, layers)
        hidden_r, lp_r, record_r, grads_r = loss_and_grads(model, batch, replay)
    assert_bitwise_equal(hidden_r, hidden, "hidden")
    assert_bitwise_equal(lp_r, lp, "log-probs")
    assert torch.equal(record_r.expert_ids(), record.expert_ids())
    assert grads_r.keys() == grads.keys()
    for name in grads:
        assert_bitwise_equal(grads_r[name], grads[name], name)


def test_the_backwards_recomputed_layers_replay_too():
    """Activation checkpointing recomputes each layer in backward: still inside the replay, so the gradients are
    those of the replayed forward (recorded experts the router would not choose on every row)."""
    plain, recomputed = moe_model(), moe_model()
    recompute_layers(recomputed)
    batch = ForwardBatch.packed([[5, 6, 7, 8, 9], [10]])
    layers = tuple(sparse_layer_indices(plain.config))
    with use_profile("native"):
        own = loss_and_grads(plain, batch, None)[2].expert_ids().long()
        # the experts the router ranked last: differ from its own choice on every (row, layer)
        flipped = torch.stack([torch.tensor([e for e in range(EXPERTS) if e not in r.tolist()])
                               for r in own.reshape(-1, TOP_K)]).reshape(own.shape)
        replay = RoutingReplay(flipped, torch.ones(own.shape[0], dtype=torch.bool), layers)
        _, lp, _, grads = loss_and_grads(plain, batch, replay)
        _, lp_c, record_c, grads_c = loss_and_grads(recomputed, batch, replay)
    assert torch.equal(record_c.expert_ids().long(), flipped)
    assert_bitwise_equal(lp_c, lp, "log-probs")
    for name in grads:
        assert_bitwise_equal(grads_c[name], grads[name], name)


def test_moe_route_replay_is_native_only_and_checks_its_experts():
    logits = torch.randn(3, EXPERTS)
    experts = torch.tensor([[0, 1], [2, 3], [1, 0]])
    with pytest.raises(RLAlignError, match="moe_route_replay.*native profile only"):
        ops.moe_route_replay(logits, experts, normalize=True, profile="strict")
    with pytest.raises(RLAlignError, match="do not fit"):
        ops.moe_route_replay(logits, experts[:2], normalize=True, profile="native")
    own, weights = ops.moe_route(logits, TOP_K, normalize=False, profile="native")
    assert_bitwise_equal(ops.moe_route_replay(logits, own, normalize=False, profile="native"), weights)
