"""CUDA: the adversarial classes of the CPU suite on the Triton backend.

- linear with narrow outputs (N = 1..9, the PPO value head is N = 1) and odd K (17, 127, 1000, 4099), with and
  without the canonical K partition: a row's bits do not depend on M, its position, or a row permutation;
- logprob / entropy with a one-entry last vocab tile and tiny vocabularies (V = 1, 2, 257, 1025): with entropy
  equals without, a token alone equals the token in a batch, and the values are finite and accurate;
- weights updated in place by fused AdamW or a ``.data`` op: the next strict call sees the new weights.
"""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from rlalign.contract import spec
from tests.bitwise import assert_bitwise_equal
from tests.cuda.conftest import rand

pytestmark = pytest.mark.cuda

NARROW = [(n, k, seg) for n in (1, 2, 3, 5, 7, 9) for k in (17, 127, 1000, 4099) for seg in (None, spec.K_SEGMENTS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k,segments", NARROW)
def test_narrow_and_odd_linear_rows_are_invariant(triton_backend, n, k, segments, dtype):
    x, w = rand(300, k, dtype=dtype, seed=n * 7 + k), rand(n, k, dtype=dtype, seed=k)
    full = ops.linear(x, w, k_segments=segments)
    for m in (1, 63, 64, 65, 129):
        assert_bitwise_equal(ops.linear(x[:m], w, k_segments=segments), full[:m], f"N={n} K={k} M={m}")
    perm = torch.randperm(300, device="cuda")
    assert_bitwise_equal(ops.linear(x[perm], w, k_segments=segments), full[perm], f"N={n} K={k} rows permuted")


@pytest.mark.parametrize("vocab", [1, 2, 257, 1025, 4097])
def test_logprob_tiny_and_one_entry_last_tile(triton_backend, vocab):
    h, w = rand(130, 64, seed=vocab), rand(vocab, 64, seed=vocab + 1)
    targets = torch.randint(0, vocab, (130,), device="cuda")
    lp, ent = ops.logprob_entropy(h, w, targets)
    lp_only, _ = ops.logprob_entropy(h, w, targets, with_entropy=False)
    assert_bitwise_equal(lp, lp_only, f"V={vocab}: logprob with entropy vs without")
    assert bool(torch.isfinite(lp).all() and torch.isfinite(ent).all())
    one_lp, one_ent = ops.logprob_entropy(h[7:8], w, targets[7:8])
    assert_bitwise_equal(one_lp, lp[7:8], f"V={vocab}: token alone")
    assert_bitwise_equal(one_ent, ent[7:8], f"V={vocab}: entropy alone")
    ref = torch.log_softmax(h.double() @ w.double().T, -1)
    ref_lp = ref.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    assert float((lp.double() - ref_lp).abs().max()) < 5e-2 and float((ent.double() - ref_ent).abs().max()) < 5e-2


@pytest.mark.parametrize("update", ["fused_adamw", "foreach_adamw", "data_op"])
def test_in_place_weight_updates_are_seen(triton_backend, update):
    w = torch.nn.Parameter(rand(256, 512, dtype=torch.float32, seed=3))
    x = rand(40, 512, dtype=torch.float32, seed=4)
    for _ in range(3):
        before = ops.linear(x, w)
        if update == "data_op":
            w.data.mul_(0.5)
        else:
            opt = torch.optim.AdamW([w], lr=1e-2, fused=update == "fused_adamw", foreach=update == "foreach_adamw")
            w.grad = torch.ones_like(w)
            opt.step()
        after = ops.linear(x, w)
        fresh = ops.linear(x, w.detach().clone())
        assert_bitwise_equal(after, fresh, f"{update}: the call after the update vs a fresh copy of the weights")
        assert not torch.equal(after, before)


def test_moe_ops_are_batch_invariant(triton_backend):
    hidden, inter, n_experts, top_k = 256, 128, 16, 4
    x = rand(300, hidden, seed=5)
    router = rand(n_experts, hidden, seed=6, scale=hidden ** -0.5)
    gate, up = rand(n_experts, inter, hidden, seed=7, scale=0.06), rand(n_experts, inter, hidden, seed=8, scale=0.06)
    down = rand(n_experts, hidden, inter, seed=9, scale=0.09)

    def block(rows):
        experts, weights = ops.moe_route(ops.router_logits(rows, router), top_k, normalize=True)
        return ops.moe_combine(ops.moe_experts(rows, experts, gate, up, down, down_segments=spec.K_SEGMENTS),
                               weights, experts), experts

    full, experts = block(x)
    for i in (0, 150, 299):
        one, e_one = block(x[i:i + 1])
        assert torch.equal(e_one, experts[i:i + 1])
        assert_bitwise_equal(one, full[i:i + 1], f"token {i} alone")
    perm = torch.randperm(300, device="cuda")
    out_perm, _ = block(x[perm])
    assert_bitwise_equal(out_perm, full[perm], "tokens permuted")
