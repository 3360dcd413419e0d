"""On CUDA the strict finiteness check is deferred to the next host sync, and still names the op."""

import pytest
import torch

from rlalign import ops
from rlalign.contract import ContractError

pytestmark = pytest.mark.cuda


def test_nan_input_is_reported_at_the_next_sync_naming_the_first_op():
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    x[3, 5] = float("nan")
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    h = ops.linear(x, w)                       # no host sync here
    head = torch.randn(100, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ContractError, match=r"rlalign.ops.linear: x contains NaN or inf"):
        ops.logprob_entropy(h, head, torch.zeros(8, dtype=torch.int64, device="cuda"))
    ops.logprob_entropy(h.nan_to_num(), head, torch.zeros(8, dtype=torch.int64, device="cuda"))  # queue was cleared


def test_nan_in_paged_cache_is_reported_at_the_next_sync():
    hkv, d = 2, 64
    kc = torch.randn(4, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kc[1, 3, 0, 7] = float("nan")                 # inside the context of the only sequence
    q = torch.randn(1, 4, d, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor([[0, 1]], device="cuda")
    out = ops.attention_paged(q, kc, vc, table, torch.tensor([30], device="cuda"),
                              torch.tensor([0, 1], device="cuda"))   # no host sync here
    head = torch.randn(100, d * 4, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ContractError, match=r"attention_paged: k_cache/v_cache contain NaN or inf"):
        ops.logprob_entropy(out.reshape(1, -1), head, torch.zeros(1, dtype=torch.int64, device="cuda"))
