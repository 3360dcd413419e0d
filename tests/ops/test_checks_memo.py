"""The per-forward memo of index-tensor validation: once per tensor object and version, never stale."""

import pytest
import torch

from rlalign import ops
from rlalign.contract import ContractError
from rlalign.ops import _checks as chk


def test_memo_computes_once_per_tensor_and_again_after_an_in_place_change():
    t = torch.tensor([0, 3, 5])
    calls = []
    compute = lambda: calls.append(1) or len(calls)  # noqa: E731
    assert chk.memo("test", compute, t) == 1
    assert chk.memo("test", compute, t) == 1          # same object, same version: cached
    t[1] = 4                                           # in place: the version counter moves
    assert chk.memo("test", compute, t) == 2
    assert chk.memo("test", compute, t.clone()) == 3   # an equal but different tensor is validated anew


def test_a_failing_check_is_not_cached():
    t = torch.tensor([0])
    def bad():
        raise ValueError("no")
    with pytest.raises(ValueError):
        chk.memo("test-bad", bad, t)
    assert chk.memo("test-bad", lambda: "ok", t) == "ok"


def test_block_table_edited_in_place_between_layers_is_checked_again():
    kc = torch.randn(4, 16, 2, 8)
    vc = torch.randn_like(kc)
    q = torch.randn(1, 4, 8)
    table, lens, cu = torch.tensor([[0, 1]]), torch.tensor([30]), torch.tensor([0, 1])
    ops.attention_paged(q, kc, vc, table, lens, cu)
    table[0, 1] = 9                                    # not a page of a 4-page cache
    with pytest.raises(ContractError, match=r"block_table\[0, 1\]=9 is not a page id"):
        ops.attention_paged(q, kc, vc, table, lens, cu)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_finiteness_check_finds_every_nonfinite_element(bad, dtype):
    for index in [(0, 0), (3, 7), (4, 12)]:
        t = torch.randn(5, 13).to(dtype)
        t[index] = bad
        with pytest.raises(ContractError, match=rf"x contains NaN or inf \(first at index \[{index[0]}, {index[1]}\]"):
            chk.finite("op", "x", t)


def test_cpu_finiteness_check_accepts_finite_values_whose_sum_overflows():
    chk.finite("op", "x", torch.full((8,), 3e38))               # the quick sum is inf; the exact check passes
    chk.finite("op", "x", torch.tensor([3e38, -3e38, 3e38, 3e38]))


def test_capture_mode_records_verdicts_and_skips_validation():
    """While a graph is captured: memo'd validations are skipped, finiteness verdicts are collected (not
    queued, not raised), and a missing host hint is a clear error."""
    t = torch.tensor([1.0, float("nan")])
    with chk.capturing_graph(max_query_len=1) as verdicts:
        assert chk.is_capturing()
        assert chk.memo("validate", lambda: 1 / 0, t) is None
        assert chk.memo("derive", lambda: 1 / 0, t, capturing=lambda: "captured") == "captured"
        assert chk.capture_hint("max_query_len") == 1
        with pytest.raises(ContractError, match="needs the host value 'other'"):
            chk.capture_hint("other")
        chk.finite("op", "x", t)                                 # recorded, not raised
    assert not chk.is_capturing() and len(verdicts) == 1
    chk.requeue(verdicts)
    with pytest.raises(ContractError, match="x contains NaN or inf"):
        chk.flush()


def test_inference_tensors_are_validated_on_every_call():
    """No version counter under torch.inference_mode: the memo must not cache (an in-place change
    would go unseen), and must not fail."""
    with torch.inference_mode():
        t = torch.tensor([0, 3, 5])
    calls = []
    compute = lambda: calls.append(1) or len(calls)  # noqa: E731
    assert chk.memo("test-inference", compute, t) == 1
    assert chk.memo("test-inference", compute, t) == 2
    with torch.inference_mode():
        ops.embedding(t, torch.zeros(6, 2))   # the embedding's id check goes through the memo
