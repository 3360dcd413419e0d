"""The compiled CPU kernels under MKL's COMPATIBLE branch (the cross-machine mode): built to that branch's GEMM
arithmetic (multiply-then-add chains, K cut every 112: csrc/common.h), they give the bits of the torch formulation
on MKL's tiles, so their self-checks pass and they run (docs/cpu.md, "Across machines").

MKL reads its branch once, at its first call, so the checks run in a child pytest process started with
``MKL_CBWR=COMPATIBLE``; in this process (MKL's native branch) only the parent test runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import mklmode
from tests.bitwise import assert_bitwise_equal as assert_same_bits

ROOT = Path(__file__).resolve().parents[2]
CHILD = os.environ.get("RLALIGN_TEST_MKL_CHILD") == "1"
child_only = pytest.mark.skipif(not CHILD, reason="runs in the child process of the test below (MKL_CBWR=COMPATIBLE)")


@pytest.mark.skipif(CHILD, reason="the parent test")
def test_kernels_equal_mkl_compatible_in_a_child_process():
    if not torch.backends.mkl.is_available():
        pytest.skip("torch has no MKL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "PYTEST_"))}
    env.update(MKL_CBWR="COMPATIBLE", RLALIGN_TEST_MKL_CHILD="1", PYTHONPATH=str(ROOT), RLALIGN_CPU_CROSS_MACHINE="1")
    done = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-p",
                           "no:randomly", "-n", "0", "-x"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert "8 passed" in last and "failed" not in last, done.stdout[-2000:]   # the child's tests all ran


@child_only
def test_child_runs_mkl_compatible_and_the_compatible_build():
    from rlalign.ops.torch_backend import clib
    assert mklmode.branch() == mklmode.PINNED
    assert clib.compatible() and clib.library() is not None


def _tiles(a, w, parts):
    from rlalign.ops.torch_backend import primitives as P
    return P._tile_mm(a, w) if parts == 1 else P.tree_merge(P.tile_mm_segments(a, w, parts))


@child_only
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 70), n16=st.integers(1, 12), seg=st.integers(1, 260), parts=st.sampled_from([1, 2, 4, 8]),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 31 - 1))
def test_gemm_kernel_equals_mkl_compatible_tiles(m, n16, seg, parts, threads, seed):
    """Every row and column of csrc/gemm.c equals MKL COMPATIBLE's 64-row tile wherever MKL's main micro-kernel
    computes every column (N a multiple of 16, a K segment of 1 to 3 or 8 and more k): chains of 1 to 260 k (0, 1
    and 2 cuts), 1 to 8 K segments. Segments of 4 to 7 k take another MKL micro-kernel: there the kernel's check
    fails (fail closed: the tiles run)."""
    from rlalign.ops.torch_backend import primitives as P
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    k, n = seg * parts, 16 * n16
    a, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    if 4 <= seg <= 7:
        assert not P.gemm_matches(k, n, parts, threads), f"k={k} n={n} parts={parts}"
        return
    assert_same_bits(P.compiled_gemm(a, w, parts), _tiles(a, w, parts), f"gemm m={m} k={k} n={n} parts={parts}")


@child_only
@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 70), k=st.integers(1, 300), cut=st.integers(0, 69),
       seed=st.integers(0, 2 ** 31 - 1))
def test_gemm_kernel_columns_do_not_depend_on_n_or_offset(m, n, k, cut, seed):
    """The kernel is the definition of every column it computes: a column's bits are the same in a call of any N
    and at any offset (what a column-parallel rank relies on), degenerate sizes included; MKL COMPATIBLE's own
    tiles are not (its last n % 16 columns take another order)."""
    from rlalign.ops.torch_backend import primitives as P
    gen = torch.Generator().manual_seed(seed)
    a, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    whole = P.compiled_gemm(a, w, 1)
    lo = min(cut, n - 1)
    assert_same_bits(P.compiled_gemm(a, w[lo:], 1), whole[:, lo:], f"columns {lo}: of n={n} k={k}")
    assert_same_bits(P.compiled_gemm(a, w[:lo + 1], 1), whole[:, :lo + 1], f"columns :{lo + 1} of n={n} k={k}")


@child_only
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_kernels_pass_their_checks_under_compatible(threads):
    """The forward and the backward kernels reproduce the formulation on MKL COMPATIBLE for the head dims whose
    chains are not cut (<= 112; 128 is, and runs the formulation), GQA groups 1, 2, 4."""
    from rlalign.ops.torch_backend.attention import compiled as C, compiled_backward as CB
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(threads)
    for d in (16, 32, 64, 112):
        assert C.compiled_agrees(d, gen, [1, 70, 150, 9, 64], [1, 6, 1, 9, 2]), f"forward d={d}"
        for g in (1, 2, 4):
            assert CB.bwd_agrees(d, g, gen), f"backward d={d} g={g}"
    assert not C.compiled_matches(128, threads)


@child_only
def test_linear_takes_the_kernel_route_and_keeps_its_bits():
    """Under COMPATIBLE the strict linear runs every row of the default model's shapes on the kernel (faster than
    MKL's COMPATIBLE GEMM), with the tiles' bits."""
    from rlalign.ops.torch_backend import primitives as P
    from rlalign.ops.torch_backend.linear import _blocks, linear_fp32, segment_count
    gen = torch.Generator().manual_seed(0)
    for k, n, ks in [(128, 384, None), (128, 128, None), (384, 128, 8), (128, 128, 8), (1024, 64, None)]:
        p = segment_count(k, ks) if ks else 1
        assert P.linear_route(k, n, p) == "kernel", (k, n, p)
        w = torch.randn(n, k, generator=gen)
        for m in (1, 7, 64, 129):
            x = torch.randn(m, k, generator=gen)
            tiles = P._tile_mm(x, w) if p == 1 else P.tree_merge(P.tile_mm_segments(x, w, p))
            assert_same_bits(linear_fp32(x, w, ks), tiles, f"linear m={m} k={k} n={n} segments={p}")


@child_only
@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 70), n=st.integers(1, 24), tp=st.sampled_from([1, 2, 4, 8]), k=st.integers(1, 300),
       segments=st.sampled_from([None, 8]), seed=st.integers(0, 2 ** 31 - 1))
def test_mode_linear_is_the_kernel_for_every_shape_and_rank(m, n, tp, k, segments, seed):
    """In the cross-machine mode csrc/gemm.c defines the strict linear at every width: forward, dX and weight
    gradient are the kernel's bits, and a column-parallel rank's N / tp columns (widths and offsets off the
    16-column blocks included) equal TP = 1's -- MKL COMPATIBLE's remainder columns are never used."""
    from rlalign import ops
    from rlalign.ops.torch_backend import primitives as P
    from rlalign.ops.torch_backend.linear import segment_count
    k = k * 8 if segments else k
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen, requires_grad=True)
    w = torch.randn(n * tp, k, generator=gen, requires_grad=True)
    g = torch.randn(m, n * tp, generator=gen)
    out = ops.linear(x, w, k_segments=segments, profile="strict")
    out.backward(g)
    p = segment_count(k, segments) if segments else 1
    assert_same_bits(out.detach(), P.compiled_gemm(x.detach(), w.detach(), p), f"forward m={m} n={n * tp} k={k}")
    assert_same_bits(x.grad, P.compiled_gemm(g, w.detach().t(), 1), f"dX m={m} n={n * tp} k={k}")
    assert_same_bits(w.grad, P.compiled_gemm(g.t(), x.detach().t(), 1), f"dW m={m} n={n * tp} k={k}")
    for r in range(tp):
        cols = slice(r * n, (r + 1) * n)
        rank = ops.linear(x.detach(), w.detach()[cols], k_segments=segments, profile="strict")
        assert_same_bits(rank, out.detach()[:, cols], f"rank {r} of tp={tp}, n={n} k={k}")
        assert_same_bits(P.weight_grad(g[:, cols], x.detach()), w.grad[cols], f"dW rank {r} of tp={tp}")


@child_only
def test_mode_without_the_kernels_refuses_the_linear_in_one_line(monkeypatch):
    """Fail closed: in the cross-machine mode a strict CPU linear with no compiled kernels raises one line."""
    from rlalign import ops
    from rlalign.contract.errors import RLAlignError
    from rlalign.ops._dispatch import refresh_env
    monkeypatch.setenv("RLALIGN_CPU_KERNELS", "0")
    refresh_env()
    try:
        with pytest.raises(RLAlignError) as caught:
            ops.linear(torch.randn(3, 32), torch.randn(15, 32), profile="strict")
    finally:
        monkeypatch.delenv("RLALIGN_CPU_KERNELS")
        refresh_env()
    assert "RLALIGN_CPU_CROSS_MACHINE" in str(caught.value) and "\n" not in str(caught.value)
