"""On CUDA the strict finiteness checks are deferred to the next host sync. Under the per-op policy
(RLALIGN_CHECKS=per-op) they name the first op; under the boundary policy (the CUDA default) the final
hidden rows are checked where they leave for the host, plus the sites where a value could vanish."""

import pytest
import torch

from rlalign import ops
from rlalign.contract import ContractError
from rlalign.ops import _checks as chk

pytestmark = pytest.mark.cuda


def test_the_cuda_default_is_the_boundary_policy(monkeypatch):
    monkeypatch.delenv(chk.CHECKS_ENV, raising=False)
    assert chk.check_policy(torch.device("cuda")) == chk.BOUNDARY


def _nan_linear():
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    x[3, 5] = float("nan")
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    head = torch.randn(100, 32, device="cuda", dtype=torch.bfloat16)
    return x, w, head, torch.zeros(8, dtype=torch.int64, device="cuda")


def test_per_op_reports_the_first_op_at_the_next_sync():
    x, w, head, targets = _nan_linear()
    with ops.use_check_policy("per-op"):
        h = ops.linear(x, w)                       # no host sync here
        with pytest.raises(ContractError, match=r"rlalign.ops.linear: x contains NaN or inf"):
            ops.logprob_entropy(h, head, targets)
        ops.logprob_entropy(h.nan_to_num(), head, targets)  # queue was cleared


def test_boundary_reports_the_hidden_rows_and_how_to_localize():
    x, w, head, targets = _nan_linear()
    with ops.use_check_policy("boundary"):
        h = ops.linear(x, w)
        with pytest.raises(ContractError, match=r"logprob_entropy: hidden contains NaN or inf .*RLALIGN_CHECKS=per-op"):
            ops.logprob_entropy(h, head, targets)


@pytest.mark.parametrize("policy, message", [("per-op", "attention_paged: k_cache/v_cache contain NaN or inf"),
                                             ("boundary", "logprob_entropy: hidden contains NaN or inf")])
def test_nan_in_paged_cache_is_reported_at_the_next_sync(policy, message):
    hkv, d = 2, 64
    kc = torch.randn(4, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kc[1, 3, 0, 7] = float("nan")                 # inside the context of the only sequence
    q = torch.randn(1, 4, d, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor([[0, 1]], device="cuda")
    head = torch.randn(100, d * 4, device="cuda", dtype=torch.bfloat16)
    with ops.use_check_policy(policy):
        out = ops.attention_paged(q, kc, vc, table, torch.tensor([30], device="cuda"),
                                  torch.tensor([0, 1], device="cuda"))   # no host sync here
        with pytest.raises(ContractError, match=message):
            ops.logprob_entropy(out.reshape(1, -1), head, torch.zeros(1, dtype=torch.int64, device="cuda"))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_bad_key_written_to_the_cache_is_reported_under_the_boundary_policy(value):
    k = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    k[1, 0, 9] = value
    kc = torch.zeros(4, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    with ops.use_check_policy("boundary"):
        ops.write_kv_cache(k, k.clone(), kc, kc.clone(), torch.tensor([0, 1, 2], device="cuda"))
        with pytest.raises(ContractError, match="write_kv_cache: k contains NaN or inf"):
            ops.flush_deferred_checks()
