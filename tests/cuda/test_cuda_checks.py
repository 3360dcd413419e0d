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
