"""Triton backend kernels under the CPU interpreter (TRITON_INTERPRET=1): indexing and masking.

The interpreter runs the kernels' Python semantics on numpy, in fp32 (it mis-rounds bf16, so
only fp32 is checked, and fp32 operands take an exact fp32 dot there instead of the GPU's bf16x3
split). What this covers: tile/segment/page/row index arithmetic, masks at every ragged edge,
TMA-descriptor and pointer paths, the segment-tree stack (registers and scratch), chunked
accumulation, every output element written (outputs pre-filled with NaN), pages outside a
context holding NaN never reaching the math. Each check compares with a float64 reference.
Bitwise invariance is a property of the GPU's instructions and is tested in tests/cuda.

All checks run in ONE subprocess (the interpreter must be switched on before triton is
imported); each test below reports one check's result.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import traceback

import pytest

TOL = 2e-5  # fp32 kernels vs float64 (relative to the reference's max magnitude)


# ---- worker side (runs in the subprocess) ------------------------------------------------------------

def _patch_interpreter():
    """numpy >= 2.3 refuses int() of a 1-element 1-d array, which Triton 3.6's interpreter uses for
    program ids in ``range``; give its tensors an __index__ that works."""
    import numpy as np
    import triton.runtime.interpreter as interp
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def _rel(a, ref):
    import torch
    a, ref = a.double(), ref.double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def _check_gemm():
    import torch
    from rlalign.ops.triton_backend.gemm import GemmConfig, gemm
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    cases = [  # m, n, k, segments, a_trans, b_trans, config, use_tma, bias
        (5, 70, 96, 1, False, True, GemmConfig(64, 32, 4, 2), None, True),
        (130, 70, 256, 8, False, True, GemmConfig(64, 32, 4, 2, reg_levels=1), None, False),
        (130, 72, 256, 4, False, True, GemmConfig(64, 64, 4, 2), False, True),
        (70, 40, 96, 2, False, True, GemmConfig(64, 32, 4, 2), None, False),   # seg_k 48: pointer path
        (70, 48, 128, 1, True, False, GemmConfig(64, 32, 4, 2), None, False),  # dW layout
        (70, 48, 128, 1, False, False, GemmConfig(64, 32, 4, 2), False, False),  # dX layout
        (1, 33, 64, 1, False, True, GemmConfig(128, 64, 8, 2, flatten=True), None, True),
    ]
    for m, n, k, seg, at, bt, cfg, tma, has_bias in cases:
        a = torch.randn((k, m) if at else (m, k), generator=g)
        b = torch.randn((n, k) if bt else (k, n), generator=g)
        bias = torch.randn(n, generator=g) if has_bias else None
        out = torch.full((m, n), float("nan"))
        gemm(a, b, a_trans=at, b_trans=bt, bias=bias, segments=seg, config=cfg, use_tma=tma, out=out)
        ref = (a.double().T if at else a.double()) @ (b.double().T if bt else b.double())
        if bias is not None:
            ref = ref + bias.double()
        worst = max(worst, _rel(out, ref))
    # a reduction split across calls at multiples of 64 (acc_in) equals one call
    a, b = torch.randn(40, 320, generator=g), torch.randn(320, 24, generator=g)
    acc = torch.zeros(40, 24)
    for k0 in (0, 128, 192):
        k1 = {0: 128, 128: 192, 192: 320}[k0]
        gemm(a[:, k0:k1], b[k0:k1], out=acc, acc_in=True, config=GemmConfig(64, 32, 4, 2))
    worst = max(worst, _rel(acc, a.double() @ b.double()))
    return worst


def _attn_ref(q, k, v, lens, scale):
    import torch
    outs, st, g = [], 0, q.shape[1] // k.shape[1]
    for n in lens:
        qq = q[st:st + n].double()
        kk = k[st:st + n].double().repeat_interleave(g, 1)
        vv = v[st:st + n].double().repeat_interleave(g, 1)
        s = torch.einsum("thd,uhd->htu", qq, kk) * scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
        outs.append(torch.einsum("htu,uhd->thd", s.softmax(-1), vv))
        st += n
    return torch.cat(outs)


def _check_attention():
    import torch
    from rlalign.ops.triton_backend import attention as A
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for hq, hkv, d, lens in ((4, 2, 64, [1, 70, 130]), (3, 3, 48, [65, 2])):
        t = sum(lens)
        q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        scale = d ** -0.5
        ref = _attn_ref(q, k, v, lens, scale)
        worst = max(worst, _rel(A.varlen_forward(q, k, v, cu, scale, tile=(64, 4, 1))[0], ref))
        # the longest sequence through a paged cache (NaN outside its context), in chunks
        ps, n, s0 = 16, max(lens), sum(lens[:lens.index(max(lens))])
        pages = -(-n // ps)
        perm = torch.randperm(pages + 3, generator=g)[:pages]
        kc = torch.full((pages + 3, ps, hkv, d), float("nan"))
        vc = kc.clone()
        for p in range(n):
            kc[perm[p // ps], p % ps], vc[perm[p // ps], p % ps] = k[s0 + p], v[s0 + p]
        table = torch.cat([perm, torch.zeros(2, dtype=perm.dtype)]).to(torch.int32).unsqueeze(0)
        for a, b in ((0, n // 2), (n // 2, n // 2 + 1), (n // 2 + 1, n)):
            out = A.paged_forward(q[s0 + a:s0 + b], kc, vc, table, torch.tensor([b], dtype=torch.int32),
                                  torch.tensor([0, b - a], dtype=torch.int32), scale, tile=(64, 4, 1))
            worst = max(worst, _rel(out, ref[s0 + a:s0 + b]))
        # backward against float64 autograd
        qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
        r = _attn_ref(qd, kd, vd, lens, scale)
        go = torch.randn(r.shape, generator=g)
        r.backward(go.double())
        out, lse = A.varlen_forward(q, k, v, cu, scale, store_lse=True, tile=(64, 4, 1))
        grads = A.varlen_backward(q, k, v, out, lse, cu, go, scale, tile=(64, 4, 1))
        for got, want in zip(grads, (qd.grad, kd.grad, vd.grad)):
            worst = max(worst, _rel(got, want))
    return worst


def _check_logprob():
    import torch
    from rlalign.ops.triton_backend import logprob as L
    g = torch.Generator().manual_seed(2)
    L.GRAD_CHUNK = 256     # three backward vocab chunks (256, 256, 188): dh carried across them
    t, h, v = 70, 64, 700  # v: the last vocab tile is partial; t: the last token tile too
    hid, w = torch.randn(t, h, generator=g), torch.randn(v, h, generator=g) * 0.3
    tgt = torch.randint(0, v, (t,), generator=g)
    worst = 0.0
    for temp in (1.0, 0.7):
        lp, ent, lse, mu = L.forward_stats(hid, w, tgt, temp, True)
        hd, wd = hid.double().requires_grad_(), w.double().requires_grad_()
        logp = torch.log_softmax(hd @ wd.T / temp, -1)
        rlp = logp.gather(1, tgt[:, None]).squeeze(1)
        rent = -(logp.exp() * logp).sum(-1)
        worst = max(worst, float((lp.double() - rlp.detach()).abs().max()), float((ent.double() - rent.detach()).abs().max()))
        g_lp, g_ent = torch.randn(t, generator=g), torch.randn(t, generator=g)
        (rlp * g_lp.double() + rent * g_ent.double()).sum().backward()
        dh, dw = L.backward_grads(hid, w, tgt, lse, mu, temp, g_lp, g_ent, True, True)
        worst = max(worst, _rel(dh, hd.grad), _rel(dw, wd.grad))
        worst = max(worst, _rel(L.lm_logits(hid, w, temp, 8192), hd.detach() @ wd.detach().T / temp))
        lp2, ent2, _, _ = L.forward_stats(hid, w, tgt, temp, False)
        worst = max(worst, float((lp2.double() - rlp.detach()).abs().max()))
        assert ent2 is None
    return worst


def _check_elementwise():
    import torch
    from rlalign.ops.triton_backend import elementwise as E
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for rows, hdim in ((37, 100), (5, 1024)):
        x, w = torch.randn(rows, hdim, generator=g), torch.randn(hdim, generator=g)
        y, inv = E.rms_forward(x, w, 1e-6)
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        ref = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * wd
        worst = max(worst, _rel(y, ref))
        dy = torch.randn(rows, hdim, generator=g)
        ref.backward(dy.double())
        dx, dw = E.rms_backward(x, w, dy, inv)
        worst = max(worst, _rel(dx, xd.grad), _rel(dw, wd.grad))
    t, heads, d = 9, 3, 64
    x = torch.randn(t, heads, d, generator=g)
    ang = torch.rand(t, d // 2, generator=g).double() * 10
    cos, sin = ang.cos().float(), ang.sin().float()
    xd = x.double().requires_grad_()
    c, s = cos.double()[:, None], sin.double()[:, None]
    ref = torch.cat([xd[..., :d // 2] * c - xd[..., d // 2:] * s, xd[..., d // 2:] * c + xd[..., :d // 2] * s], -1)
    worst = max(worst, _rel(E._rope_launch(x, cos, sin, 1.0), ref))
    dy = torch.randn(t, heads, d, generator=g)
    ref.backward(dy.double())
    worst = max(worst, _rel(E._rope_launch(dy, cos, sin, -1.0), xd.grad))
    gt, up = torch.randn(3001, generator=g), torch.randn(3001, generator=g)
    gd, ud = gt.double().requires_grad_(), up.double().requires_grad_()
    ref = gd / (1 + torch.exp(-gd)) * ud
    worst = max(worst, _rel(E.silu_mul(gt, up), ref))
    dy = torch.randn(3001, generator=g)
    ref.backward(dy.double())
    dg, du = E._SiluMul.backward(type("Ctx", (), {"saved_tensors": (gt, up)})(), dy)
    worst = max(worst, _rel(dg, gd.grad), _rel(du, ud.grad))
    return worst


def _check_sample():
    import torch
    from rlalign.ops.torch_backend import sample as reference
    from rlalign.ops.triton_backend import sample as S
    g = torch.Generator().manual_seed(4)
    rows, vocab = 6, 5000  # vocab: the last 2048-block is partial
    logits = torch.randn(rows, vocab, generator=g) * 3
    args = (torch.full((rows,), 1234), torch.arange(rows), torch.arange(rows) * 7,
            torch.tensor([0.9, 0.0, 1.0, 0.7, 0.9, 1.3]))
    for top_k, top_p in ((torch.tensor([0, 0, 50, 0, 10, 0]), torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 1.0])),
                         (torch.zeros(rows, dtype=torch.int64), torch.ones(rows))):
        got = S.sample(logits, *args, top_k, top_p)
        want = reference.sample(logits, *args, top_k, top_p)
        if not torch.equal(got, want):
            return f"tokens {got.tolist()} != torch backend {want.tolist()}"
    return 0.0


CHECKS = {"gemm": _check_gemm, "attention": _check_attention, "logprob": _check_logprob,
          "elementwise": _check_elementwise, "sample": _check_sample}


def _worker() -> None:
    _patch_interpreter()
    results = {}
    for name, fn in CHECKS.items():
        try:
            results[name] = fn()
        except Exception:  # report, go on with the other checks
            results[name] = "error: " + traceback.format_exc()
    print("RESULTS " + json.dumps(results))


# ---- pytest side --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def interpreter_results():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"interpreter worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("name", list(CHECKS))
def test_kernel_under_interpreter(interpreter_results, name):
    result = interpreter_results[name]
    assert not isinstance(result, str), f"{name}: {result}"
    assert result <= TOL, f"{name}: worst relative error {result:.3g} vs float64 > {TOL}"


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
