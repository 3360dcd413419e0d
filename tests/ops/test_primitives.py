"""The torch backend's reduction primitives (tree_sum, tree_merge) return new tensors, never views of
their inputs: callers reuse an input in place after reducing it (the logprob block statistics multiply
``e`` in place after ``tree_sum(e)``), which must not rewrite a result already taken. Hypothesis over
shapes, degenerate sizes (one entry, one part, no rows) included; each result is also checked against
a float64 sum.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from rlalign.ops.torch_backend.primitives import tree_merge
from rlalign.reductions import tree_sum
from tests.bitwise import assert_bitwise_equal, assert_close_report

HYP = settings(max_examples=60, deadline=None)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the two use one storage (empty tensors hold no memory to share)."""
    return bool(a.numel() and b.numel()) and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@HYP
@given(rows=st.integers(0, 5), length=st.one_of(st.just(1), st.integers(1, 70)), seed=st.integers(0, 2**31 - 1))
def test_tree_sum_is_a_new_tensor_and_a_sum(rows, length, seed):
    x = torch.randn(rows, length, generator=torch.Generator().manual_seed(seed))
    total = tree_sum(x)
    kept = total.clone()
    assert not _shares_memory(total, x), f"tree_sum of [{rows}, {length}] is a view of its input"
    x.mul_(3.0).add_(1.0)    # what a caller may do with its input afterwards
    assert_bitwise_equal(total, kept, f"tree_sum of [{rows}, {length}] after its input was written")
    assert_close_report(kept, (x.double() - 1.0).div(3.0).sum(-1), atol=1e-5 * length, rtol=1e-5, what="tree_sum")


@HYP
@given(parts=st.sampled_from([1, 2, 4, 8]), rows=st.integers(1, 5), cols=st.integers(1, 9),
       stacked=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_tree_merge_is_a_new_tensor_and_a_sum(parts, rows, cols, stacked, seed):
    x = torch.randn(parts, rows, cols, generator=torch.Generator().manual_seed(seed))
    merged = tree_merge(x if stacked else list(x.unbind(0)))
    kept = merged.clone()
    assert not _shares_memory(merged, x), f"tree_merge of {parts} parts is a view of an input"
    x.mul_(3.0)
    assert_bitwise_equal(merged, kept, f"tree_merge of {parts} parts after its input was written")
    assert_close_report(kept, x.double().div(3.0).sum(0), atol=1e-5, rtol=1e-5, what="tree_merge")
