"""The compiled CPU kernels (rlalign/ops/torch_backend/csrc) give the bits of the torch formulation
they replace: attention (paged and packed, with the log-sum-exp) and RMSNorm.

Both paths are called directly and compared bit for bit (rlalign.contract.bits); on a failure the
first differing index and both values are printed. Skipped where the kernels cannot be built (no C
compiler): the formulation then runs everywhere, and the other tests cover it.
"""

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlalign import ops
from rlalign.ops.torch_backend.attention import compiled as C, formula as F
from rlalign.ops.torch_backend import clib, norm
from tests.bitwise import assert_bitwise_equal
from tests.ops.test_cpu_speedpaths import _paged_case as paged_case

pytestmark = pytest.mark.skipif(clib.library() is None, reason="the CPU kernels could not be built here")


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert_bitwise_equal(got, want, f"{what} (compiled vs formulation)")


def _paged_case(gen, lens, n_new, hq, hkv, d, ps, dtype):
    return paged_case(gen, lens, n_new, hq, hkv, d, ps, dtype, garbage=False)


_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(data=st.data(), d=st.sampled_from([16, 32, 64, 128]), groups=st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3)]),
       ps=st.sampled_from([1, 5, 16, 64]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_paged_compiled_equals_formula(data, d, groups, ps, dtype):
    if not C.compiled_matches(d, torch.get_num_threads()):
        pytest.skip(f"the kernels do not reproduce the library's GEMM tiles for head_dim {d} on this machine")
    hq, hkv = groups
    lens = data.draw(st.lists(st.integers(1, 200), min_size=1, max_size=6))
    n_new = [data.draw(st.integers(1, n)) if data.draw(st.booleans()) else 1 for n in lens]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    case = _paged_case(gen, lens, n_new, hq, hkv, d, ps, dtype)
    args = (*case, d ** -0.5)
    assert_same_bits(C.paged_compiled(*args), F.paged_formula(*args), f"paged lens={lens} n_new={n_new}")


@_SETTINGS
@given(data=st.data(), d=st.sampled_from([16, 32, 64, 128]), groups=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_varlen_compiled_equals_formula(data, d, groups, dtype):
    if not C.compiled_matches(d, torch.get_num_threads()):
        pytest.skip(f"the kernels do not reproduce the library's GEMM tiles for head_dim {d} on this machine")
    hq, hkv = groups
    lens = data.draw(st.lists(st.integers(1, 150), min_size=1, max_size=5))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    (out_c, lse_c), (out_f, lse_f) = (f(q, k, v, cu, d ** -0.5) for f in (C.varlen_compiled, F.varlen_formula))
    assert_same_bits(out_c, out_f, f"varlen out lens={lens}")
    assert_same_bits(lse_c, lse_f, f"varlen lse lens={lens}")


def test_the_op_runs_the_kernels_for_a_matching_head_dim(monkeypatch):
    """ops.attention_paged on the CPU goes through the compiled path when it applies (the self-check
    runs first, so that its own calls are not counted)."""
    if not C.compiled_matches(32, torch.get_num_threads()):
        pytest.skip("this machine's library orders head_dim 32's GEMM tiles otherwise: the formulation runs")
    calls = []
    real = C.paged_compiled
    monkeypatch.setattr(C, "paged_compiled", lambda *a: calls.append(1) or real(*a))
    case = _paged_case(torch.Generator().manual_seed(0), [5, 70], [1, 2], 4, 2, 32, 16, torch.float32)
    ops.attention_paged(*case, profile="strict")
    assert calls == [1]


def test_a_head_dim_whose_bits_differ_runs_the_formulation(monkeypatch):
    """The self-check refuses kernels that disagree with the formulation by a single bit; the op then
    runs the formulation (the same bits as everywhere else)."""
    def off_by_one_ulp(*args):
        res = real(*args)
        return (res.view(torch.int32) + 1).view(torch.float32) if res.numel() else res

    real = C.paged_compiled
    monkeypatch.setattr(C, "paged_compiled", off_by_one_ulp)
    C.compiled_matches.cache_clear()
    try:
        assert not C.compiled_matches(32, torch.get_num_threads())
        assert not C.compiled_applies(torch.device("cpu"), 32)
        case = _paged_case(torch.Generator().manual_seed(1), [9, 64], [1, 1], 2, 1, 32, 16, torch.float32)
        assert_same_bits(ops.attention_paged(*case, profile="strict"), F.paged_formula(*case, 32 ** -0.5), "op")
    finally:
        C.compiled_matches.cache_clear()


@pytest.mark.parametrize("h", [1, 2, 3, 7, 32, 100, 128, 129, 1024, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_compiled_equals_formula(h, dtype):
    gen = torch.Generator().manual_seed(h)
    for scale, eps in ((1e-3, 1e-6), (1.0, 1e-5), (30.0, 0.1)):
        x = (torch.randn(37, h, generator=gen) * scale).to(dtype)
        w = torch.randn(h, generator=gen).to(dtype)
        compiled = norm.compiled_rms_norm(x, w, eps)
        assert compiled is not None
        assert_same_bits(compiled, norm.rms_norm_formula(x, w, eps), f"rms_norm h={h} scale={scale} eps={eps}")


def test_rms_norm_with_autograd_runs_the_formulation_and_agrees():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10, 64, generator=gen, requires_grad=True)
    w = torch.randn(64, generator=gen)
    assert norm.compiled_rms_norm(x, w, 1e-6) is None            # a graph to record: torch ops
    y = norm.rms_norm(x, w, 1e-6)
    y.sum().backward()
    assert x.grad is not None
    assert_same_bits(y.detach(), norm.compiled_rms_norm(x.detach(), w, 1e-6), "rms_norm with/without autograd")


def test_disabled_or_no_compiler_runs_the_formulation(monkeypatch, tmp_path):
    from rlalign.ops._dispatch import refresh_env
    monkeypatch.setenv("RLALIGN_CPU_KERNELS", "0")
    refresh_env()
    try:
        assert clib.library() is None
    finally:
        monkeypatch.delenv("RLALIGN_CPU_KERNELS")
        refresh_env()
    assert clib.library() is not None
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("RLALIGN_CACHE_DIR", str(tmp_path / "cache"))
    clib._load.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert clib.library() is None
        assert any("could not be built" in str(w.message) for w in caught)
        case = _paged_case(torch.Generator().manual_seed(2), [5, 70], [1, 3], 4, 2, 32, 16, torch.float32)
        assert not C.compiled_applies(torch.device("cpu"), 32)
        ops.attention_paged(*case, profile="strict")       # runs (the formulation)
    finally:
        clib._load.cache_clear()


def test_library_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RLALIGN_CACHE_DIR", str(tmp_path))
    path = clib._build()
    assert path.parent == tmp_path and path.exists()
    stamp = path.stat().st_mtime_ns
    assert clib._build() == path and path.stat().st_mtime_ns == stamp   # cached: not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [path.name]          # no temporary left behind
    assert os.access(path, os.R_OK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_silu_mul_compiled_equal_formula(dtype):
    from rlalign.ops.torch_backend import elementwise as E
    gen = torch.Generator().manual_seed(4)
    for t, h, d in ((1, 1, 2), (37, 3, 32), (5, 8, 128)):
        x = (torch.randn(t, h, d, generator=gen) * 5).to(dtype)
        cos, sin = torch.randn(t, d // 2, generator=gen), torch.randn(t, d // 2, generator=gen)
        gate = (torch.randn(t, h * d, generator=gen) * 20).to(dtype)
        up = torch.randn(t, h * d, generator=gen).to(dtype)
        assert_same_bits(E.rope(x, cos, sin), E.rope_formula(x, cos, sin), f"rope {t}x{h}x{d}")
        assert_same_bits(E.silu_mul(gate, up), E.silu_mul_formula(gate, up), f"silu_mul {t}x{h * d}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finiteness_check_finds_every_nonfinite_value(dtype, bad):
    from rlalign.contract.errors import ContractError
    from rlalign.ops import _checks as chk
    for n, at in ((1, 0), (17, 16), (1000, 3), (1000, 999)):
        x = torch.randn(n).to(dtype)
        chk.finite("op", "x", x)                        # finite: no error
        x[at] = bad
        with pytest.raises(ContractError, match=rf"first at index \[{at}\]"):
            chk.finite("op", "x", x)
    big = torch.full((1000,), 3e38)                     # finite values whose sum overflows: not an error
    chk.finite("op", "x", big)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_tree_merge_compiled_equals_the_adds(p):
    from rlalign.ops.torch_backend import primitives as P
    gen = torch.Generator().manual_seed(p)
    stacked = torch.randn(p, 70, 130, generator=gen) * torch.logspace(-3, 3, 130)
    for parts in (stacked, stacked[:, :33]):              # whole parts, and a row prefix of each
        merged = P.tree_merge_compiled(parts)
        assert merged is not None
        assert_same_bits(merged, P.tree_merge(list(parts.unbind(0))), f"tree_merge p={p}")


@pytest.mark.parametrize("k,n,ks", [(128, 384, None), (128, 15, None), (128, 128, 8), (384, 128, 8), (96, 40, 2)])
def test_few_rows_without_padding_equal_the_padded_tile(k, n, ks):
    """linear_fp32's rows past the last whole 64-row block (up to SMALL_ROWS), and every row of a K
    partition, come from csrc/gemm.c when the shape passed its check: the same bits as the zero-padded
    64-row tiles."""
    from rlalign.ops.torch_backend import primitives as P
    from rlalign.ops.torch_backend.linear import _blocks, linear_fp32, segment_count
    p = segment_count(k, ks) if ks else 1
    if not P.gemm_matches(k, n, p, torch.get_num_threads()):
        pytest.skip(f"the library orders ({k}, {n}, {p}) otherwise on this machine: the padded tile runs")
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=gen)
    for m in (1, 3, 8, 64 + 1, 128 + 7, 9, 64, 512 + 13):
        x = torch.randn(m, k, generator=gen) * 3
        assert_same_bits(linear_fp32(x, w, ks), _blocks(x, w, p), f"linear m={m} k={k} n={n} segments={p}")


def test_few_rows_check_refuses_a_kernel_that_differs(monkeypatch):
    from rlalign.ops.torch_backend import primitives as P
    real = P.compiled_gemm
    monkeypatch.setattr(P, "compiled_gemm", lambda *a: (real(*a).view(torch.int32) ^ 1).view(torch.float32))
    P.gemm_matches.cache_clear()
    try:
        assert not P.gemm_matches(128, 64, 1, torch.get_num_threads())
        x, w = torch.randn(3, 128), torch.randn(64, 128)
        assert P.compiled_rows(x, w, 1) is None           # refused: linear pads the rows instead
    finally:
        P.gemm_matches.cache_clear()
