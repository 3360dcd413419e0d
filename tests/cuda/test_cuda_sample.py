"""CUDA: strict sampling on the Triton backend -- a row's token does not depend on the batch, and
equals the torch backend's token for the same logits (same hash, libdevice logf == torch's log)."""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from tests.bitwise import assert_bitwise_equal
from tests.cuda.conftest import rand

pytestmark = pytest.mark.cuda


def _kwargs(n, filtered):
    kw = dict(seeds=torch.full((n,), 1234, device="cuda"), seq_ids=torch.arange(n, device="cuda"),
              positions=torch.arange(n, device="cuda") * 7,
              temperature=torch.where(torch.arange(n, device="cuda") % 5 == 1, 0.0, 0.9).float())
    if filtered:
        kw.update(top_k=torch.where(torch.arange(n, device="cuda") % 3 == 0, 50, 0),
                  top_p=torch.where(torch.arange(n, device="cuda") % 2 == 0, 0.9, 1.0).float())
    return kw


@pytest.mark.parametrize("filtered", [False, True])
def test_rows_do_not_depend_on_the_batch(triton_backend, filtered):
    n, vocab = 64, 151936
    logits = rand(n, vocab, dtype=torch.float32, seed=1, scale=3.0)
    kw = _kwargs(n, filtered)
    full = ops.sample(logits, **kw)
    for i in (0, 1, 31, 63):
        one = ops.sample(logits[i:i + 1], **{k: v[i:i + 1] for k, v in kw.items()})
        assert_bitwise_equal(one, full[i:i + 1], f"row {i}")
    assert_bitwise_equal(ops.sample(logits, **kw), full, "run to run")


@pytest.mark.parametrize("filtered", [False, True])
def test_same_tokens_as_torch_backend(triton_backend, filtered):
    from rlalign.ops.torch_backend.sample import sample as torch_sample
    from rlalign.ops.triton_backend.sample import sample as triton_sample
    n, vocab = 64, 32000
    logits = rand(n, vocab, dtype=torch.float32, seed=2, scale=3.0)
    kw = _kwargs(n, filtered)
    k = kw.get("top_k", torch.zeros(n, dtype=torch.int64, device="cuda"))
    p = kw.get("top_p", torch.ones(n, device="cuda"))
    args = (logits, kw["seeds"], kw["seq_ids"], kw["positions"], kw["temperature"], k, p)
    assert_bitwise_equal(triton_sample(*args), torch_sample(*args), "triton vs torch backend tokens")
