"""The varlen attention backward's launch variants (attention.BackwardLaunch) under the CPU interpreter.

Each launch that is not the default (test_triton_interpret.py checks the default: heavy-first grids, 128-row dQ
tiles, 128-key dK/dV programs) runs its own kernel code: the light-first grids with 64-row dQ tiles and 64-key
dK/dV programs (the previous default), and 128-key dQ steps. Per launch,
hypothesis draws packed batches of 1-2 sequences of 1-90 tokens (and an explicit example: a sequence of
1 token and one of 67, not a multiple of the 64 / 128 tiles) with GQA 4/2 or 2/2 heads and d 16, and checks:

* dq, dk, dv within TOL of float64 autograd (relative to the reference's largest magnitude, at least 1);
* the same bits run to run;
* per-sequence (packing) invariance: the batch packs its first sequence twice, first and last, so its
  gradients must have the same bits at both places, whatever is packed between.

fp32 only (the interpreter mis-rounds bf16; its fp32 dot is exact BLAS, not the GPU's bf16x3 split, so bits
here say nothing about the GPU: tests/cuda/test_cuda_attention.py checks the same properties in bf16 there).
One subprocess runs everything (the interpreter must be on before triton is imported); about 20 s.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import pytest

from tests.workers import run_worker

TOL = 2e-5
# (label, BackwardLaunch keyword arguments): every kernel variant the non-default launches compile
LAUNCHES = (("light-first (the previous default)", dict(heavy_first=False)),
            ("wide", dict(dq_tile=(128, 8, 2), dq_keys=128, dkdv_keys=128)))


def _check_launch(kwargs) -> str | None:
    """None, or the first failure (hypothesis' falsifying example included)."""
    import torch
    from hypothesis import example, given, settings, strategies as st

    from rlalign.contract.bits import bits_equal, describe_difference
    from rlalign.ops.triton_backend import attention as A
    from tests.references import causal_attention_float64
    launch = A.BackwardLaunch(**kwargs)

    @settings(max_examples=1, deadline=None, derandomize=True, database=None)
    @given(lens=st.lists(st.integers(1, 90), min_size=1, max_size=2), heads=st.sampled_from([(4, 2), (2, 2)]))
    @example(lens=[1, 67], heads=(4, 2))
    def check(lens, heads):
        hq, hkv = heads
        lens = lens + [lens[0]]                      # the first sequence again, last
        g = torch.Generator().manual_seed(sum(lens))
        first = [torch.randn(lens[0], h, 16, generator=g) for h in (hq, hkv, hkv, hq)]
        rest = [torch.randn(sum(lens[1:-1]), h, 16, generator=g) for h in (hq, hkv, hkv, hq)]
        q, k, v, go = (torch.cat([a, b, a]) for a, b in zip(first, rest))
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        scale = 16 ** -0.5
        out, lse = A.varlen_forward(q, k, v, cu, scale, store_lse=True, tile=(64, 4, 1))
        grads = A.varlen_backward(q, k, v, out, lse, cu, go, scale, launch=launch)
        again = A.varlen_backward(q, k, v, out, lse, cu, go, scale, launch=launch)
        qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
        causal_attention_float64(qd, kd, vd, lens, scale).backward(go.double())
        n0, t = lens[0], sum(lens)
        for name, got, rerun, want in zip(("dq", "dk", "dv"), grads, again, (qd.grad, kd.grad, vd.grad)):
            # relative to the largest reference magnitude, floored at 1 (unit-scale inputs): a batch of 1-token
            # sequences has dq = dk = 0 exactly, which fp32 gives as dp - delta rounding (~1e-7)
            err = float((got.double() - want).abs().max() / want.abs().max().clamp(min=1.0))
            assert err <= TOL, f"{name} {lens} {heads}: relative error {err:.3g} vs float64 > {TOL}"
            assert bits_equal(got, rerun), f"{name} {lens} run to run: {describe_difference(got, rerun)}"
            assert bits_equal(got[:n0], got[t - n0:]), \
                f"{name} {lens}: sequence 0 first vs last in the pack: {describe_difference(got[:n0], got[t - n0:])}"
    try:
        check()
    except Exception:  # noqa: BLE001 - reported to the test
        return traceback.format_exc(limit=2)[-2000:]
    return None


def _worker() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_triton_interpret import _patch_interpreter
    _patch_interpreter()
    print("RESULTS " + json.dumps({label: _check_launch(kwargs) for label, kwargs in LAUNCHES}))


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    return run_worker([os.path.abspath(__file__), "--worker"], interpret=True, timeout=600)


@pytest.mark.parametrize("label", [label for label, _ in LAUNCHES])
def test_backward_launch_accurate_deterministic_packing_invariant(results, label):
    assert results[label] is None, f"{label}: {results[label]}"


def test_every_new_kernel_variant_is_covered():
    """The launches here compile every backward kernel variant a BackwardLaunch field selects (a constexpr)."""
    fields = set().union(*(kwargs for _, kwargs in LAUNCHES))
    assert {"heavy_first", "dq_tile", "dq_keys", "dkdv_keys"} <= fields, fields


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
