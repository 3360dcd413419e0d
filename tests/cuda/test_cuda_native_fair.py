"""CUDA: the native profile's fast paths for training.

The flash varlen kernel is selected for bf16 packed batches on an sm80+ GPU (no padded fallback),
and it and the token-chunked native log-prob agree with float64 within bf16 tolerance, forward
and backward (GQA 32/8 heads, ragged lengths including a one-token sequence).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlalign import ops
from rlalign.ops.attention import flash_varlen_unavailable
from tests.cuda.conftest import rand, rel_err
from tests.references import causal_attention_float64

pytestmark = pytest.mark.cuda

LENS = (1, 129, 700, 2048)


def test_flash_varlen_is_selected_and_accurate():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t, d = sum(LENS), 128
    q, k, v = rand(t, 32, d, seed=0), rand(t, 8, d, seed=1), rand(t, 8, d, seed=2)
    assert flash_varlen_unavailable(q, k) is None
    cu = torch.tensor([0, *LENS], device="cuda").cumsum(0).to(torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ops.attention_varlen(*leaves, cu, profile="native")
    grad = rand(*out.shape, seed=3)
    got = torch.autograd.grad(out, leaves, grad)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = causal_attention_float64(*ref_leaves, LENS, d ** -0.5)
    want = torch.autograd.grad(ref, ref_leaves, grad.double())
    assert rel_err(out, ref) < 1e-2
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and rel_err(g, w) < 2e-2, name


def test_native_logprob_bf16_accurate_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tokens, hidden, vocab = 1500, 256, 5000
    h, w = rand(tokens, hidden, seed=0).requires_grad_(), rand(vocab, hidden, seed=1, scale=0.05).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    lp, ent = ops.logprob_entropy(h, w, targets, token_chunk=512, profile="native")
    (lp.sum() + ent.sum()).backward()
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logp = F.log_softmax(hd @ wd.T, -1)
    ref_lp, ref_ent = logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert float((lp.double() - ref_lp).abs().max()) < 1e-3
    assert float((ent.double() - ref_ent).abs().max()) < 1e-3
    assert rel_err(h.grad, hd.grad) < 2e-2 and rel_err(w.grad, wd.grad) < 2e-2
