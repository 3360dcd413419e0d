"""Tier 2: accuracy of the dense ops against float64 references (strict and native).

Tolerances: fp32 inputs atol=rtol=1e-5 (fp32 accumulation over K <= 1024); bf16 inputs compare the
rounded output with the float64 result of the same bf16 inputs at 1 bf16 ulp (rtol=2**-7) plus a
small atol for cancellation.
"""

import pytest
import torch

from rlalign import ops
from rlalign.contract import ContractError
from tests.bitwise import assert_close_report

PROFILES = ["strict", "native"]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2 ** -7)}


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_segments", [None, 8])
def test_linear_matches_float64(profile, dtype, k_segments):
    x, w, b = _rand(70, 256, dtype=dtype), _rand(48, 256, dtype=dtype, seed=1), _rand(48, dtype=dtype, seed=2)
    kw = {"k_segments": k_segments} if profile == "strict" else {}
    out = ops.linear(x, w, b, profile=profile, **kw)
    ref = x.double() @ w.double().t() + b.double()
    atol, rtol = TOL[dtype]
    assert_close_report(out, ref, atol * 16 ** 0.5, rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_backward_matches_float64_autograd(dtype):
    x = _rand(40, 64, dtype=dtype).requires_grad_()
    w = _rand(24, 64, dtype=dtype, seed=1).requires_grad_()
    b = _rand(24, dtype=dtype, seed=2).requires_grad_()
    gy = _rand(40, 24, seed=3)
    ops.linear(x, w, b, k_segments=8).float().backward(gy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    (x64 @ w64.t() + b64).backward(gy.double())
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (5e-2, 2 ** -7)
    for got, ref, name in ((x.grad, x64.grad, "dx"), (w.grad, w64.grad, "dw"), (b.grad, b64.grad, "db")):
        assert_close_report(got, ref, atol, rtol, name)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_float64(profile, dtype):
    x, w = _rand(50, 100, dtype=dtype), _rand(100, dtype=dtype, seed=1)
    out = ops.rms_norm(x, w, 1e-6, profile=profile)
    x64 = x.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    atol, rtol = TOL[dtype]
    assert_close_report(out, ref, atol, rtol)


def test_rms_norm_backward_matches_float64_autograd():
    x, w = _rand(20, 64).requires_grad_(), _rand(64, seed=1).requires_grad_()
    gy = _rand(20, 64, seed=2)
    ops.rms_norm(x, w, 1e-6).backward(gy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64).backward(gy.double())
    assert_close_report(x.grad, x64.grad, 1e-5, 1e-5, "dx")
    assert_close_report(w.grad, w64.grad, 1e-5, 1e-5, "dw")


@pytest.mark.parametrize("profile", PROFILES)
def test_rope_matches_float64(profile):
    x = _rand(30, 4, 64)
    pos = torch.arange(100, 130)
    inv = ops.rope_inv_freq(64, 10000.0)
    cos, sin = ops.rope_cos_sin(pos, inv)
    out = ops.rope(x, cos, sin, profile=profile)
    ang = pos.double()[:, None] * inv[None]
    c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    x64 = x.double()
    ref = torch.cat([x64[..., :32] * c - x64[..., 32:] * s, x64[..., 32:] * c + x64[..., :32] * s], -1)
    assert_close_report(out, ref, 1e-5, 1e-5)


def test_llama3_rope_scaling_matches_reference_formula():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    inv = ops.rope_inv_freq(128, 500000.0, scaling)
    base = ops.rope_inv_freq(128, 500000.0)
    import math
    for f, b in zip(inv.tolist(), base.tolist()):
        wavelen = 2 * math.pi / b
        if wavelen < 8192 / 4.0:
            assert f == b
        elif wavelen > 8192 / 1.0:
            assert f == pytest.approx(b / 8.0, rel=1e-15)
        else:
            smooth = (8192 / wavelen - 1.0) / 3.0
            assert f == pytest.approx((1 - smooth) * b / 8.0 + smooth * b, rel=1e-12)


@pytest.mark.parametrize("profile", PROFILES)
def test_silu_mul_matches_float64(profile):
    g, u = _rand(40, 96) * 4, _rand(40, 96, seed=1)
    out = ops.silu_mul(g, u, profile=profile)
    g64 = g.double()
    assert_close_report(out, g64 / (1 + torch.exp(-g64)) * u.double(), 1e-6, 1e-6)


def test_embedding_is_exact_gather():
    w = _rand(50, 16)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(ops.embedding(ids, w), w[ids])


@pytest.mark.parametrize("call, match", [
    (lambda: ops.linear(torch.randn(4, 8).half(), torch.randn(3, 8).half()), "linear: dtype torch.float16"),
    (lambda: ops.linear(torch.randn(4, 8), torch.randn(3, 9)), "linear: x has 8 input features"),
    (lambda: ops.linear(torch.randn(4, 8), torch.randn(3, 8).bfloat16()), "linear: mixed dtypes"),
    (lambda: ops.linear(torch.tensor([[float("nan")] * 8]), torch.randn(3, 8)), "linear: x contains NaN"),
    (lambda: ops.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-6), "rms_norm: weight shape"),
    (lambda: ops.rms_norm(torch.tensor([[float("inf")] * 8]), torch.randn(8), 1e-6), "rms_norm: x contains NaN or inf"),
    (lambda: ops.rope(torch.randn(2, 1, 8), torch.randn(2, 4).double(), torch.randn(2, 4).double()), "rope: cos/sin tables must be float32"),
    (lambda: ops.rope_inv_freq(64, 1e4, {"rope_type": "longrope"}), "rope scaling type 'longrope'"),
    (lambda: ops.silu_mul(torch.randn(2, 3), torch.randn(2, 4)), "silu_mul: gate"),
    (lambda: ops.embedding(torch.tensor([0, 7]), torch.randn(5, 2)), "embedding: token id 7"),
    (lambda: ops.embedding(torch.tensor([0.0]), torch.randn(5, 2)), "embedding: ids must be"),
])
def test_bad_input_fails_closed_with_named_op(call, match):
    with pytest.raises(ContractError, match=match):
        call()


def test_profile_context_and_argument():
    from rlalign.contract import current_profile, use_profile
    assert current_profile().value == "strict"
    with use_profile("native"):
        assert current_profile().value == "native"
        # native takes the vendor path (fp16 included); strict refuses fp16 even inside it
        assert ops.linear(torch.randn(2, 4).half(), torch.randn(3, 4).half()).dtype == torch.float16
        with pytest.raises(ContractError):
            ops.linear(torch.randn(2, 4).half(), torch.randn(3, 4).half(), profile="strict")
    assert current_profile().value == "strict"
    with pytest.raises(ValueError, match="unknown profile"):
        ops.linear(torch.randn(2, 4), torch.randn(3, 4), profile="fast")
