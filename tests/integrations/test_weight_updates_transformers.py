"""A transformers model patched with rlalign computes with the current weights after optimizer steps that
do not bump the version counter (fused AdamW, transformers' Trainer default) or ``.data`` updates: from
step 2 its log-probs once came from step-0 copies of part of every layer. After each step the patched
model's log-probs must have the bits of a fresh patched model loaded with the updated weights."""

from __future__ import annotations

import pytest
import torch

from tests.bitwise import assert_bitwise_equal

transformers = pytest.importorskip("transformers")

from rlalign.integrations.transformers import from_pretrained, token_logprobs  # noqa: E402
from rlalign.models.testing import make_tiny_checkpoint  # noqa: E402


def _fused_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _foreach_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


class _DataSgd:
    """p.data.add_(-lr * grad): an update that autograd's version counter never sees."""

    def __init__(self, model):
        self.params = list(model.parameters())

    def step(self):
        for p in self.params:
            if p.grad is not None:
                p.data.add_(p.grad, alpha=-1e-2)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


@pytest.mark.parametrize("make_optimizer", [_fused_adamw, _foreach_adamw, _DataSgd], ids=["fused-adamw", "foreach-adamw",
                                                                                        "data-sgd"])
def test_patched_model_uses_updated_weights(tmp_path, make_optimizer):
    transformers.utils.logging.set_verbosity_error()
    path = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3", dtype="float32")
    model = from_pretrained(path)
    ids = torch.randint(3, 300, (3, 70), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    optimizer = make_optimizer(model)
    for step in range(3):
        out = token_logprobs(model, ids, mask)
        (-out.logprobs.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
        fresh = from_pretrained(path)
        fresh.load_state_dict(model.state_dict())
        with torch.no_grad():
            got = token_logprobs(model, ids, mask).logprobs
            want = token_logprobs(fresh, ids, mask).logprobs
        assert_bitwise_equal(got, want, f"after optimizer step {step + 1}: patched model vs fresh copy")
