"""CUDA: rms_norm, rope, silu_mul on the Triton backend -- row invariance (bitwise), determinism,
accuracy vs float64 (bf16 outputs: ||.||-relative < 4e-3; fp32 < 1e-6)."""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from tests.bitwise import assert_bitwise_equal
from tests.cuda.conftest import rand, rel_err

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("h", [128, 1024, 4096, 5120])
def test_rms_norm_rows_invariant(triton_backend, h):
    x, w, r = rand(512, h, seed=1), rand(h, seed=2), rand(512, h, seed=3)
    full, resid = ops.rms_norm(x, w, 1e-6, residual=r)
    for m in (1, 7, 64, 65, 300):
        out, res = ops.rms_norm(x[:m], w, 1e-6, residual=r[:m])
        assert_bitwise_equal(out, full[:m], f"rows of T={m}")
        assert_bitwise_equal(res, resid[:m])
    perm = torch.randperm(512, device="cuda")
    assert_bitwise_equal(ops.rms_norm(x[perm], w, 1e-6, residual=r[perm])[0], full[perm], "permuted")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h", [16, 48, 128, 1000, 4096])
def test_rms_norm_bits_do_not_depend_on_where_the_rows_live(triton_backend, dtype, h):
    """A row's norm has the same bits whether the rows are a fresh tensor, a view starting at an odd element (a
    pointer Triton cannot prove 16-byte aligned: another load vectorisation, another register layout) or q/k rows of
    a stacked projection copied out: the sum of squares is a fixed pairwise tree, not a layout-ordered tl.sum."""
    w = rand(h, dtype=dtype, seed=5)
    flat = rand(65 * h + 1, dtype=dtype, seed=6)
    shifted = flat[1:].view(65, h)                    # data_ptr one element past an aligned base
    ref = ops.rms_norm(shifted.clone(), w, 1e-6)
    assert_bitwise_equal(ops.rms_norm(shifted, w, 1e-6), ref, f"rows at an odd offset, H={h}")
    for m in (1, 3, 64):
        assert_bitwise_equal(ops.rms_norm(flat[1:1 + m * h].view(m, h), w, 1e-6), ref[:m], f"first {m} rows")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h", [64, 1000, 4096])
def test_rms_norm_residual_in_kernel_equals_add_first(triton_backend, dtype, h):
    """Without autograd the residual add runs inside the norm's kernel: the stream == torch's x + r (one rounding)
    and the normed rows == the norm of that sum, raw bits; with autograd (the add done first) the same bits."""
    from rlalign.ops.triton_backend import elementwise as E
    for m in (1, 33, 244, 1000):
        x, w, r = rand(m, h, seed=m, dtype=dtype), rand(h, seed=2, dtype=dtype), rand(m, h, seed=m + 1, dtype=dtype)
        with torch.no_grad():
            out, stream = ops.rms_norm(x, w, 1e-6, residual=r)
            ref = E.rms_forward(x + r, w, 1e-6)[0]
        assert_bitwise_equal(stream, x + r, f"stream m={m}")
        assert_bitwise_equal(out, ref, f"normed m={m}")
        xg = x.clone().requires_grad_()
        out_g, stream_g = ops.rms_norm(xg, w, 1e-6, residual=r)
        assert_bitwise_equal(out_g.detach(), out, f"with autograd m={m}")
        assert_bitwise_equal(stream_g.detach(), stream)


def test_rms_norm_backward_deterministic_and_accurate(triton_backend):
    x, w, g = rand(300, 1024, seed=4), rand(1024, seed=5), rand(300, 1024, seed=6)
    runs = []
    for _ in range(2):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        ops.rms_norm(xx, ww, 1e-6).backward(g)
        runs.append((xx.grad, ww.grad))
    for a, b in zip(*runs):
        assert_bitwise_equal(a, b, "run to run")
    xs = x[:1].clone().requires_grad_()
    ops.rms_norm(xs, w, 1e-6).backward(g[:1])
    assert_bitwise_equal(xs.grad, runs[0][0][:1], "dx of a row alone")
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * wd).backward(g.double())
    assert rel_err(runs[0][0], xd.grad) < 1e-2
    assert rel_err(runs[0][1], wd.grad) < 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 4e-3), (torch.float32, 1e-6)])
def test_rope_silu_invariant_and_accurate(triton_backend, dtype, tol):
    t, heads, d = 333, 8, 128
    x = rand(t, heads, d, dtype=dtype, seed=7)
    pos = torch.randint(0, 32768, (t,), device="cuda")
    cos, sin = ops.rope_cos_sin(pos, ops.rope_inv_freq(d, 1e6))
    full = ops.rope(x, cos, sin)
    assert_bitwise_equal(ops.rope(x[100:101], cos[100:101], sin[100:101]), full[100:101])
    c, s = cos.double()[:, None], sin.double()[:, None]
    xd = x.double()
    ref = torch.cat([xd[..., :d // 2] * c - xd[..., d // 2:] * s, xd[..., d // 2:] * c + xd[..., :d // 2] * s], -1)
    assert rel_err(full, ref) < tol
    gt, up = rand(t, 3072, dtype=dtype, seed=8), rand(t, 3072, dtype=dtype, seed=9)
    y = ops.silu_mul(gt, up)
    assert_bitwise_equal(ops.silu_mul(gt[5:6], up[5:6]), y[5:6])
    gd = gt.double()
    assert rel_err(y, gd / (1 + torch.exp(-gd)) * up.double()) < tol


def test_rope_silu_backward(triton_backend):
    t, heads, d = 64, 4, 64
    x = rand(t, heads, d, dtype=torch.float32, seed=10).requires_grad_()
    cos, sin = ops.rope_cos_sin(torch.arange(t, device="cuda"), ops.rope_inv_freq(d, 1e4))
    g = rand(t, heads, d, dtype=torch.float32, seed=11)
    ops.rope(x, cos, sin).backward(g)
    xd = x.detach().double().requires_grad_()
    c, s = cos.double()[:, None], sin.double()[:, None]
    torch.cat([xd[..., :d // 2] * c - xd[..., d // 2:] * s, xd[..., d // 2:] * c + xd[..., :d // 2] * s], -1).backward(g.double())
    assert rel_err(x.grad, xd.grad) < 1e-6
    gt = rand(100, 256, dtype=torch.float32, seed=12).requires_grad_()
    up = rand(100, 256, dtype=torch.float32, seed=13).requires_grad_()
    dy = rand(100, 256, dtype=torch.float32, seed=14)
    ops.silu_mul(gt, up).backward(dy)
    gd, ud = gt.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    (gd / (1 + torch.exp(-gd)) * ud).backward(dy.double())
    assert rel_err(gt.grad, gd.grad) < 1e-5
    assert rel_err(up.grad, ud.grad) < 1e-5
