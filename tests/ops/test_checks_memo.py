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
