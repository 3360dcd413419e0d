"""algos.routing_mismatch: (token, sparse layer) pairs whose top-k expert SETS differ, over every shape."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.algos import routing_mismatch


def random_routing(rows: int, layers: int, k: int, experts: int, seed: int) -> torch.Tensor:
    """Distinct expert ids per (row, layer), in a random order (as a top-k in rank order would be)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, layers, experts, generator=g)
    return scores.argsort(dim=-1)[..., :k].to(torch.int16)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 40), layers=st.integers(1, 4), k=st.integers(1, 4), extra=st.integers(0, 5),
       seed=st.integers(0, 2**31 - 1), data=st.data())
def test_counts_exactly_the_pairs_whose_sets_differ(rows, layers, k, extra, seed, data):
    experts = k + extra
    rollout = random_routing(rows, layers, k, experts, seed)
    # the same sets in another order: no mismatch
    shuffled = rollout.flip(-1).to(torch.int64)
    same = routing_mismatch(shuffled, rollout)
    assert same == {"tokens": rows * layers, "count": 0, "first": None}
    if rows == 0 or extra == 0:
        return   # nothing to plant (every set is all the experts)
    planted = data.draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, layers - 1)), min_size=1,
                                 max_size=6, unique=True))
    trainer = shuffled.clone()
    for row, layer in planted:   # swap one chosen expert for one not chosen: a different set
        chosen = set(trainer[row, layer].tolist())
        trainer[row, layer, data.draw(st.integers(0, k - 1))] = next(e for e in range(experts) if e not in chosen)
    got = routing_mismatch(trainer, rollout)
    assert got["tokens"] == rows * layers and got["count"] == len(planted)
    assert got["first"] == min(planted)


def test_an_unrecorded_row_is_a_mismatch_and_shapes_must_agree():
    rollout = random_routing(3, 2, 2, 4, 0)
    trainer = rollout.clone()
    rollout[1, 0] = -1
    assert routing_mismatch(trainer, rollout) == {"tokens": 6, "count": 1, "first": (1, 0)}
    with pytest.raises(ValueError, match="routing_mismatch"):
        routing_mismatch(trainer[:2], rollout)
