"""The packed layout helpers: per-sequence sums do not depend on the other sequences."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.algos import seq_ids_from_lengths
from rlalign.algos._segments import seg_sum, segments
from rlalign.reductions import tree_sum
from tests.bitwise import assert_bitwise_equal


def test_seq_ids_from_lengths():
    assert seq_ids_from_lengths([2, 0, 3]).tolist() == [0, 0, 2, 2, 2]


def test_layout_of_interleaved_ids():
    seg = segments(torch.tensor([1, 0, 1, 1, 0]), 3)
    assert seg.slot.tolist() == [0, 0, 1, 2, 1]
    assert seg.counts.tolist() == [2, 3, 0]
    assert seg.max_len == 3


@settings(max_examples=30, deadline=None)
@given(length=st.integers(1, 40), other=st.integers(1, 70), seed=st.integers(0, 2**31 - 1))
def test_sequence_sum_independent_of_neighbours(length, other, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, generator=gen)
    alone = seg_sum(x, segments(torch.zeros(length, dtype=torch.int64), 1))[0]
    mixed = torch.cat([torch.randn(other, generator=gen), x])
    ids = torch.cat([torch.ones(other, dtype=torch.int64), torch.zeros(length, dtype=torch.int64)])
    together = seg_sum(mixed, segments(ids, 2))[0]
    assert_bitwise_equal(together, alone)
    assert_bitwise_equal(tree_sum(torch.cat([x, torch.zeros(other)])), alone)
