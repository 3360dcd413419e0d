"""CUDA: fused logprob + entropy and lm_logits on the Triton backend.

Bitwise: a token's logprob, entropy and hidden-state gradient do not depend on the number of
tokens in the call (1..600), its position, the other tokens' content, token_chunk/vocab_chunk,
or the run; lm_logits rows are batch invariant. V is not a multiple of the 256-column vocab tile.
Accuracy vs float64 (naive log_softmax on the same rounded inputs): logprob/entropy abs err < 2e-3
(bf16 inputs, fp32 math), grads ||.||-relative < 2e-2 (they are rounded to bf16).
"""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from tests.bitwise import assert_bitwise_equal
from tests.cuda.conftest import rand, rel_err

pytestmark = pytest.mark.cuda

H, V = 512, 50000 + 17


@pytest.fixture(scope="module")
def data(triton_backend):
    h = rand(600, H, seed=1)
    w = rand(V, H, seed=2, scale=2.5 / H ** 0.5)
    tgt = torch.randint(0, V, (600,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    return h, w, tgt


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tokens_do_not_depend_on_the_batch(data, temperature):
    h, w, tgt = data
    lp, ent = ops.logprob_entropy(h, w, tgt, temperature=temperature)
    for m in (1, 2, 63, 64, 65, 127, 129, 300):
        lp_m, ent_m = ops.logprob_entropy(h[:m], w, tgt[:m], temperature=temperature)
        assert_bitwise_equal(lp_m, lp[:m], f"logprob, T={m}")
        assert_bitwise_equal(ent_m, ent[:m], f"entropy, T={m}")
    perm = torch.randperm(600, device="cuda")
    lp_p, ent_p = ops.logprob_entropy(h[perm], w, tgt[perm], temperature=temperature)
    assert_bitwise_equal(lp_p, lp[perm], "permuted tokens")
    other = h.clone()
    other[1:] = rand(599, H, seed=9, scale=3.0)
    assert_bitwise_equal(ops.logprob_entropy(other, w, tgt, temperature=temperature)[0][0], lp[0], "other rows")
    for tc, vc in ((64, 1024), (1024, 8192), (4096, 65536)):
        lp_c, ent_c = ops.logprob_entropy(h, w, tgt, temperature=temperature, token_chunk=tc, vocab_chunk=vc)
        assert_bitwise_equal(lp_c, lp, f"chunks {tc}/{vc}")
        assert_bitwise_equal(ent_c, ent, f"chunks {tc}/{vc}")
    lp_only, none = ops.logprob_entropy(h, w, tgt, temperature=temperature, with_entropy=False)
    assert none is None
    assert_bitwise_equal(lp_only, lp, "with_entropy=False")


def test_lm_logits_rows_batch_invariant(data):
    h, w, _ = data
    full = ops.lm_logits(h[:130], w, temperature=0.8)
    for i in (0, 64, 129):
        assert_bitwise_equal(ops.lm_logits(h[i:i + 1], w, temperature=0.8), full[i:i + 1], f"row {i}")


def test_backward_deterministic_and_rows_invariant(data):
    h, w, tgt = data
    g_lp, g_ent = rand(600, dtype=torch.float32, seed=4), rand(600, dtype=torch.float32, seed=5)
    runs = []
    for _ in range(2):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = ops.logprob_entropy(hh, ww, tgt, temperature=0.9)
        torch.autograd.backward([lp, ent], [g_lp, g_ent])
        runs.append((hh.grad, ww.grad))
    assert_bitwise_equal(runs[0][0], runs[1][0], "dh run to run")
    assert_bitwise_equal(runs[0][1], runs[1][1], "dW run to run")
    for m in (1, 65):
        hh = h[:m].clone().requires_grad_()
        lp, ent = ops.logprob_entropy(hh, w, tgt[:m], temperature=0.9)
        torch.autograd.backward([lp, ent], [g_lp[:m], g_ent[:m]])
        assert_bitwise_equal(hh.grad, runs[0][0][:m], f"dh rows of T={m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accuracy_vs_float64(triton_backend, dtype):
    h = rand(200, 256, dtype=dtype, seed=6)
    w = rand(3000, 256, dtype=dtype, seed=7, scale=2.5 / 16)
    tgt = torch.randint(0, 3000, (200,), device="cuda")
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = ops.logprob_entropy(hh, ww, tgt, temperature=0.8)
    g_lp, g_ent = rand(200, dtype=torch.float32, seed=8), rand(200, dtype=torch.float32, seed=9)
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    logp = torch.log_softmax(hd @ wd.T / 0.8, -1)
    rlp = logp.gather(1, tgt[:, None]).squeeze(1)
    rent = -(logp.exp() * logp).sum(-1)
    torch.autograd.backward([rlp, rent], [g_lp.double(), g_ent.double()])
    tol = 2e-3 if dtype == torch.bfloat16 else 2e-4
    assert float((lp.double() - rlp).abs().max()) < tol
    assert float((ent.double() - rent).abs().max()) < tol
    gtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert rel_err(hh.grad, hd.grad) < gtol
    assert rel_err(ww.grad, wd.grad) < gtol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 2, 255, 256, 257, 513, 1025, 8193])
def test_vocab_tile_edges(triton_backend, vocab, dtype):
    """A last vocab tile of one entry (257, 513, 1025 and 8193 also end a 1024-column torch block and an
    8192-column chunk with one entry), two, a whole tile, and V = 1: with and without entropy, vs
    float64, and the same bits for every split of the batch."""
    h = rand(70, 128, dtype=dtype, seed=10)
    w = rand(vocab, 128, dtype=dtype, seed=11, scale=2.5 / 128 ** 0.5)
    tgt = torch.randint(0, vocab, (70,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(12))
    lp, ent = ops.logprob_entropy(h, w, tgt, temperature=0.8)
    lp_only, none = ops.logprob_entropy(h, w, tgt, temperature=0.8, with_entropy=False)
    assert none is None
    assert_bitwise_equal(lp_only, lp, f"V={vocab}: logprob without vs with entropy")
    logp = torch.log_softmax(h.double() @ w.double().T / 0.8, -1)
    tol = 2e-3 if dtype == torch.bfloat16 else 2e-4
    assert float((lp.double() - logp.gather(1, tgt[:, None]).squeeze(1)).abs().max()) < tol, f"V={vocab}: logprob"
    assert float((ent.double() + (logp.exp() * logp).sum(-1)).abs().max()) < tol, f"V={vocab}: entropy"
    for rows in (slice(0, 1), slice(1, 65), slice(65, 70)):
        lp_r, ent_r = ops.logprob_entropy(h[rows], w, tgt[rows], temperature=0.8)
        assert_bitwise_equal(lp_r, lp[rows], f"V={vocab}: logprob of rows {rows.start}:{rows.stop} alone")
        assert_bitwise_equal(ent_r, ent[rows], f"V={vocab}: entropy of rows {rows.start}:{rows.stop} alone")
