"""No strict op computes with stale weights after an in-place update that bypasses the version counter.

fused AdamW (transformers' Trainer default, so TRL's GRPOTrainer), ``p.data.<op>_()`` and ``p.data = ...``
change a weight without bumping ``_version``; a cache keyed on (id, data_ptr, _version) once returned the
step-0 weight copies from then on. Each case: a call (which would fill any cache), the update, a second
call; the second must have the bits of the same call on a fresh copy of the updated weight (a tensor no
cache has seen), and differ from the first. Shapes: every route of the CPU linear (the canonical K
partition on the compiled kernel, 64-row tiles with a compiled tail, narrow N on the kernel) and the
fused logprob op.
"""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from rlalign.contract import spec
from tests.bitwise import assert_bitwise_equal

LINEAR_CASES = {  # name: (rows, K, N, k_segments)
    "partition-kernel": (3, 128, 128, spec.K_SEGMENTS),
    "tiles-and-tail": (70, 128, 96, None),
    "narrow-n-kernel": (5, 127, 1, None),
}


def _fused_adamw(p):
    opt = torch.optim.AdamW([p], lr=0.05, fused=True)
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
    opt.step()


def _foreach_adamw(p):
    opt = torch.optim.AdamW([p], lr=0.05, foreach=True)
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
    opt.step()


def _data_op(p):
    p.data.mul_(0.5).add_(0.25)


def _data_assign(p):
    p.data = p.data * 0.5 + 0.25   # a new storage: the allocator may hand back the old address


UPDATES = {"fused-adamw": _fused_adamw, "foreach-adamw": _foreach_adamw, "data-op": _data_op,
           "data-assign": _data_assign}


def _check_fresh(compute, p, before, what):
    after = compute(p)
    fresh = compute(torch.nn.Parameter(p.detach().clone()))
    assert_bitwise_equal(after, fresh, f"{what}: after the update vs a fresh copy of the updated weight")
    assert not torch.equal(after, before), f"{what}: the update changed nothing (the test would not see a stale cache)"


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "autograd"])
@pytest.mark.parametrize("update", sorted(UPDATES))
@pytest.mark.parametrize("case", sorted(LINEAR_CASES))
def test_linear_sees_every_update(case, update, grad):
    rows, k, n, k_segments = LINEAR_CASES[case]
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g)

    def compute(weight):
        with torch.set_grad_enabled(grad):
            return ops.linear(x, weight, k_segments=k_segments).detach()

    before = compute(p)
    assert_bitwise_equal(compute(p), before, "two calls before the update")
    UPDATES[update](p)
    _check_fresh(compute, p, before, f"{case}, {update}")


@pytest.mark.parametrize("update", sorted(UPDATES))
def test_logprob_sees_every_update(update):
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1025, 32, generator=g) * 0.3)
    h, t = torch.randn(70, 32, generator=g), torch.randint(0, 1025, (70,), generator=g)

    def compute(weight):
        return ops.logprob_entropy(h, weight, t)[0].detach()

    before = compute(p)
    UPDATES[update](p)
    _check_fresh(compute, p, before, f"logprob, {update}")
