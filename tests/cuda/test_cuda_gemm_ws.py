"""The warp-specialized Gluon K-partition GEMM (gemm_ws.py) against the default kernel, in raw bits.

Written before the kernel ever ran on a GPU: each test collects EVERY failing case (shape, P, layout,
bias, output dtype, config, first differing index and both values) before it fails, so one run says
everything; a launch that does not finish within WATCHDOG_S (a pipeline deadlock) ends the process with the
case named instead of hanging the suite.
"""

from __future__ import annotations


import pytest
import torch

from rlalign.contract.bits import describe_difference, bits_equal
from tests.cuda.conftest import rand

pytestmark = pytest.mark.cuda

WATCHDOG_S = 120.0   # includes a first call's compile
M_VALUES = (1, 63, 64, 65, 462, 1000, 4096)


def watched(what: str, fn):
    """fn() followed by a device synchronize; if that takes over WATCHDOG_S, print ``what`` and exit."""
    from rlalign.bench.cuda_timing import watched as watch
    return watch(what, fn, WATCHDOG_S)


def _case_failures(gemm, cfg, m, n, k, segments, b_trans, has_bias, out_dtype, seed):
    x = rand(m, k, seed=seed)
    w = rand(n, k, seed=seed + 1) if b_trans else rand(k, n, seed=seed + 1)
    bias = rand(n, seed=seed + 2) if has_bias else None
    what = (f"M={m} N={n} K={k} P={segments} b_trans={b_trans} bias={has_bias} out={out_dtype} "
            f"config={cfg}")
    from rlalign.ops.triton_backend.gemm_ws import triton_kernel_only
    with triton_kernel_only():   # the reference: the Triton kernel (the Gluon kernel is the dispatcher's default)
        ref = gemm(x, w, b_trans=b_trans, segments=segments, bias=bias, out_dtype=out_dtype)
    try:
        out = watched(what, lambda: gemm(x, w, b_trans=b_trans, segments=segments, bias=bias, out_dtype=out_dtype,
                                         ws=cfg))
    except Exception as exc:  # noqa: BLE001 - every failing case is reported, then the test fails
        return [f"{what}: raised {exc!r}"[:400]]
    return [] if bits_equal(out, ref) else [f"{what}: {describe_difference(out, ref)}"]


@pytest.mark.parametrize("segments", (1, 2, 4, 8))
def test_ws_forward_bits_equal_default(triton_backend, segments):
    """y = x W^T (+ bias) for the linear forward's layout: every candidate config, M in M_VALUES, N a multiple
    of 64 and not (200), K with one and several k-steps per segment, bias or not, bf16 or fp32 output. Every
    case for the launches the dispatcher takes (gemm.ws_default: DEFAULT_WS, 128x128 tiles with the output tile in
    level 1's buffer and 32-column stages; SMALL_GRID_WS; NARROW_WS); one variant on the large shape for the
    others."""
    from rlalign.ops.triton_backend.gemm import gemm
    from rlalign.ops.triton_backend.gemm_ws import DEFAULT_WS, NARROW_WS, SMALL_GRID_WS, WS_CANDIDATES
    bad = []
    for cfg in WS_CANDIDATES:
        every_case = cfg in (DEFAULT_WS, SMALL_GRID_WS, NARROW_WS)   # the launches the dispatcher takes
        for m in M_VALUES:
            for n, k in ((200, segments * 64), (4096, 4096 if segments != 8 else 12288), (1000, segments * 192)):
                for has_bias, out_dtype in ((False, torch.bfloat16), (True, torch.bfloat16), (True, torch.float32)):
                    if not every_case and ((n, k) != (4096, 4096 if segments != 8 else 12288) or not has_bias
                                           or out_dtype != torch.bfloat16):
                        continue   # the other configs: one variant on the large shape (compiles: test time)
                    bad += _case_failures(gemm, cfg, m, n, k, segments, True, has_bias, out_dtype, m + n + k)
    assert not bad, f"{len(bad)} case(s) differ from the default kernel:\n" + "\n".join(bad)


@pytest.mark.parametrize("segments", (1, 8))
def test_ws_dx_layout_bits_equal_default(triton_backend, segments):
    """dX = dY @ W (B row-major [K, N], the trainer's backward; P = 1 as linear.py runs it, and P = 8): the default
    on every case, the other candidates (WS_CANDIDATES) on the large shape with an fp32 output (their largest
    shared-memory footprint)."""
    from rlalign.ops.triton_backend.gemm import gemm
    from rlalign.ops.triton_backend.gemm_ws import DEFAULT_WS, WS_CANDIDATES
    bad = []
    for m in M_VALUES:
        for n, k in ((4096, 4096), (200, 1024)):
            for out_dtype in (torch.bfloat16, torch.float32):
                bad += _case_failures(gemm, DEFAULT_WS, m, n, k, segments, False, False, out_dtype, 7 * m + k)
        for cfg in WS_CANDIDATES[1:]:
            bad += _case_failures(gemm, cfg, m, 4096, 4096, segments, False, False, torch.float32, 7 * m + 4096)
    assert not bad, f"{len(bad)} case(s) differ from the default kernel:\n" + "\n".join(bad)


def test_ws_is_deterministic_and_row_invariant(triton_backend):
    """Run to run and batch size: a row's bits do not depend on the other rows of the call."""
    from rlalign.ops.triton_backend.gemm import gemm
    from rlalign.ops.triton_backend.gemm_ws import DEFAULT_WS
    x, w = rand(1000, 4096, seed=11), rand(4096, 4096, seed=12)
    full = watched("row invariance M=1000", lambda: gemm(x, w, b_trans=True, segments=8, ws=DEFAULT_WS))
    again = gemm(x, w, b_trans=True, segments=8, ws=DEFAULT_WS)
    part = gemm(x[:65].clone(), w, b_trans=True, segments=8, ws=DEFAULT_WS)
    assert bits_equal(full, again), describe_difference(again, full)
    assert bits_equal(part, full[:65]), describe_difference(part, full[:65])


def test_ws_unsupported_shapes_raise(triton_backend):
    from rlalign.ops.triton_backend.gemm import gemm
    from rlalign.ops.triton_backend.gemm_ws import DEFAULT_WS, GemmWsUnsupported
    x, w = rand(64, 1000), rand(256, 1000)
    with pytest.raises(GemmWsUnsupported, match="K=1000"):
        gemm(x, w, b_trans=True, segments=8, ws=DEFAULT_WS)
    with pytest.raises(GemmWsUnsupported, match="bf16 only"):
        gemm(x.float()[:, :512], w.float()[:, :512], b_trans=True, segments=8, ws=DEFAULT_WS)


# one case per WS_CANDIDATES launch (an index past its end fails: IndexError; 0 is the default)
@pytest.mark.parametrize("which", (0, 1, 2, 3, 4, 5))
def test_ws_shape_class_bits_equal_default(triton_backend, which):
    """The shape class, not instances: random M (1..2,100), N (multiples of 8, 8..1,032: the output's 16-byte rows),
    k-steps per segment (1..4) and P, with bias and a bf16 output (M, N and the k-steps are not specialisations: no
    new compile), for each WS_CANDIDATES launch (the default first). Every failing example is collected before
    the test fails."""
    from hypothesis import Phase, given, settings, strategies as st
    from rlalign.ops.triton_backend.gemm import gemm
    from rlalign.ops.triton_backend.gemm_ws import WS_CANDIDATES
    cfg = WS_CANDIDATES[which]
    bad = []

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate))
    @given(m=st.integers(1, 2100), n8=st.integers(1, 129), steps=st.integers(1, 4), segments=st.sampled_from([1, 2, 4, 8]))
    def check(m, n8, steps, segments):
        bad.extend(_case_failures(gemm, cfg, m, 8 * n8, segments * steps * 64, segments, True, True,
                                  torch.bfloat16, m * 7 + n8))

    check()
    assert not bad, f"{len(bad)} example(s) differ from the default kernel:\n" + "\n".join(bad)


def test_level2_slot_bits_equal_default(triton_backend):
    """DEFAULT_WS keeps P = 8's level 2 in a per-program global slot (WsConfig.level2_global), which moves exact fp32
    values only: the forward (bias, bf16 / fp32 out) and the dX layout at P = 8, M across the tile edges and far past
    one wave of programs (each program reuses its slot for every one of its tiles; 16,384 x 4,096 is 4,096 tiles on
    132 programs), launches back to back; then the shape class (random M, N, k-steps, P: other P have no level 2)."""
    from hypothesis import Phase, given, settings, strategies as st
    from rlalign.ops.triton_backend.gemm import gemm
    from rlalign.ops.triton_backend.gemm_ws import DEFAULT_WS
    assert DEFAULT_WS.level2_global
    bad = []
    for m in (1, 127, 128, 129, 1000, 4096, 16384):
        for n, k in ((4096, 4096), (4096, 12288), (200, 1024)):
            for b_trans, has_bias, out_dtype in ((True, True, torch.bfloat16), (True, False, torch.float32),
                                                 (False, False, torch.float32), (False, False, torch.bfloat16)):
                if m == 16384 and (k != 4096 or not b_trans):
                    continue
                bad += _case_failures(gemm, DEFAULT_WS, m, n, k, 8, b_trans, has_bias, out_dtype,
                                      m + n + k + b_trans)

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate))
    @given(m=st.integers(1, 3000), n8=st.integers(1, 300), steps=st.integers(1, 4), segments=st.sampled_from([2, 4, 8]))
    def check(m, n8, steps, segments):
        bad.extend(_case_failures(gemm, DEFAULT_WS, m, 8 * n8, segments * steps * 64, segments, True, True,
                                  torch.bfloat16, m * 7 + n8))

    check()
    assert not bad, f"{len(bad)} case(s) differ from the default kernel:\n" + "\n".join(bad)
