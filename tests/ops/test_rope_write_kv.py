"""ops.rope_write_kv: rope of q and k plus the KV-cache write of the rotated k and v, as one op.

* CPU (torch backend, and native): the same bits as ``rope`` + ``write_kv_cache`` (NaN-filled caches: the
  slots not written stay NaN), hypothesis over token counts, heads, head_dim, page sizes, shuffled slots; the
  same K check (write_kv_cache's message under per-op and boundary, its verdict in a capture, before the write);
  a NaN in q or v is not this op's check; argument errors name the op.
* The Triton kernel under the interpreter (fp32) against rope_kernel + write_kv_cache, the check included
  (tests/ops/rope_write_kv_worker.py, in a subprocess), with and without the fused q/k norm (against
  ops.rms_norm first: its checks and bits), and compiled for sm_90a: no spills, no fma.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract import ContractError
from rlalign.contract.bits import bits_equal
from rlalign.ops import _checks as chk
from tests.workers import run_worker


def _case(t, hq, hkv, d, page_size, extra_pages, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    pos = torch.randperm(4096, generator=g)[:t]
    cos, sin = ops.rope_cos_sin(pos, ops.rope_inv_freq(d, 10000.0))
    pages = -(-t // page_size) + extra_pages
    slots = torch.randperm(pages * page_size, generator=g)[:t]
    cache = torch.full((pages, page_size, hkv, d), float("nan"), dtype=dtype)
    return q, k, v, cos, sin, cache, slots


@settings(max_examples=60, deadline=None)
@given(t=st.integers(0, 40), hkv=st.integers(1, 4), group=st.sampled_from([1, 2, 4]), d=st.sampled_from([2, 6, 64]),
       page_size=st.sampled_from([1, 3, 16]), extra=st.integers(0, 3), bf16=st.booleans(),
       native=st.booleans(), int32=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_equals_rope_then_write_kv_cache(t, hkv, group, d, page_size, extra, bf16, native, int32, seed):
    q, k, v, cos, sin, cache, slots = _case(t, hkv * group, hkv, d, page_size, extra,
                                            torch.bfloat16 if bf16 else torch.float32, seed)
    slots = slots.to(torch.int32 if int32 else torch.int64)
    profile = "native" if native else "strict"
    kc_ref, vc_ref, kc, vc = (cache.clone() for _ in range(4))
    qr, kr = ops.rope(q, cos, sin, profile=profile), ops.rope(k, cos, sin, profile=profile)
    ops.write_kv_cache(kr, v, kc_ref, vc_ref, slots, profile=profile)
    qo, ko = ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots, profile=profile)
    for name, got, want in (("q", qo, qr), ("k", ko, kr), ("k_cache", kc, kc_ref), ("v_cache", vc, vc_ref)):
        assert bits_equal(got, want), name
    written = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool)
    written[slots.long()] = True
    assert bool(kc.view(written.shape[0], hkv * d)[~written].isnan().all()), "a slot not in slot_mapping was written"


@settings(max_examples=40, deadline=None)
@given(t=st.integers(0, 30), hkv=st.integers(1, 3), group=st.sampled_from([1, 2, 4]), d=st.sampled_from([2, 6, 64]),
       bf16=st.booleans(), native=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_qk_norm_equals_rms_norm_then_rope_write_kv(t, hkv, group, d, bf16, native, seed):
    """qk_norm = (q weight, k weight, eps): the bits of ops.rms_norm on q and k, then the op."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v, cos, sin, cache, slots = _case(t, hkv * group, hkv, d, 3, 1, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    wq, wk = (torch.randn(d, generator=g).to(dtype) for _ in range(2))
    profile = "native" if native else "strict"
    kc_ref, vc_ref, kc, vc = (cache.clone() for _ in range(4))
    qn, kn = ops.rms_norm(q, wq, 1e-6, profile=profile), ops.rms_norm(k, wk, 1e-6, profile=profile)
    want = ops.rope_write_kv(qn, kn, v, cos, sin, kc_ref, vc_ref, slots, profile=profile)
    got = ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots, qk_norm=(wq, wk, 1e-6), profile=profile)
    for name, a, b in (("q", got[0], want[0]), ("k", got[1], want[1]), ("k_cache", kc, kc_ref), ("v_cache", vc, vc_ref)):
        assert bits_equal(a, b), name


@pytest.mark.parametrize("where", ["q", "k"])
def test_qk_norm_checks_its_inputs_as_rms_norm(where):
    """A NaN in q (or k) with qk_norm: rms_norm's own error (per-op policy), before anything is written; a weight
    of the wrong size: rms_norm's message."""
    q, k, v, cos, sin, cache, slots = _planted(where, float("nan"))
    w = torch.ones(q.shape[-1])
    kc, vc = cache.clone(), cache.clone()
    with ops.use_check_policy("per-op"):
        with pytest.raises(ContractError) as want:
            ops.rms_norm({"q": q, "k": k}[where], w, 1e-6)
        with pytest.raises(ContractError) as got:
            ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots, qk_norm=(w, w, 1e-6))
    assert str(got.value) == str(want.value) and "rms_norm" in str(got.value)
    assert bool(kc.isnan().all()), "the cache was written before the norm's check failed"
    with pytest.raises(ContractError, match="rms_norm.*weight shape"):
        ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots, qk_norm=(w[:-1], w, 1e-6))


def _planted(where: str, value: float):
    q, k, v, cos, sin, cache, slots = _case(5, 4, 2, 8, 4, 1, torch.float32, 3)
    {"q": q, "k": k, "v": v}[where][3, 1, 5] = value
    return q, k, v, cos, sin, cache, slots


@pytest.mark.parametrize("policy", ["per-op", "boundary"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_key_gives_write_kv_cache_error(policy, value):
    q, k, v, cos, sin, cache, slots = _planted("k", value)
    kc, vc = cache.clone(), cache.clone()
    with ops.use_check_policy(policy), ops.check_scope("layers.7"):
        with pytest.raises(ContractError) as want:
            ops.write_kv_cache(ops.rope(k, cos, sin), v, kc, vc, slots)
        with pytest.raises(ContractError) as got:
            ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots)
    assert str(got.value) == str(want.value)
    assert str(got.value).startswith("rlalign.ops.write_kv_cache: k contains NaN or inf")
    if policy == "per-op":
        assert "first at index" in str(got.value) and "in layers.7" in str(got.value)
    assert bool(kc.isnan().all()) and bool(vc.isnan().all()), "the torch backend checks k before the write"
    ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots, profile="native")   # native: no check


@pytest.mark.parametrize("where", ["q", "v"])
def test_a_nonfinite_query_or_value_is_not_this_ops_check(where):
    q, k, v, cos, sin, cache, slots = _planted(where, float("nan"))
    with ops.use_check_policy("per-op"):
        ops.rope_write_kv(q, k, v, cos, sin, cache.clone(), cache.clone(), slots)


@pytest.mark.parametrize("where", ["k", "v"])
def test_a_capture_records_write_kv_cache_verdict(where):
    q, k, v, cos, sin, cache, slots = _planted(where, float("inf"))
    with ops.use_check_policy("boundary"):
        with chk.capturing_graph() as want:
            ops.write_kv_cache(ops.rope(k, cos, sin), v, cache.clone(), cache.clone(), slots)
        with chk.capturing_graph() as got:
            ops.rope_write_kv(q, k, v, cos, sin, cache.clone(), cache.clone(), slots)
    assert [(op, msg, bool(ok)) for op, msg, ok in got] == [(op, msg, bool(ok)) for op, msg, ok in want]
    assert [bool(ok) for _, _, ok in got] == [where != "k"]


def _with(**change):
    q, k, v, cos, sin, cache, slots = _case(3, 4, 2, 8, 4, 0, torch.float32, 1)
    args = dict(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=cache, v_cache=cache.clone(), slot_mapping=slots)
    args.update({name: fn(args) for name, fn in change.items()})
    return args


@pytest.mark.parametrize("change, message", [
    (dict(cos=lambda a: a["cos"][:2]), "cos/sin must be [T, D/2]"),
    (dict(q=lambda a: a["q"].double()), "dtype torch.float64 is not supported"),
    (dict(q=lambda a: a["q"][:, :, :6]), "cos/sin must be [T, D/2]"),
    (dict(k_cache=lambda a: a["k_cache"].bfloat16(), v_cache=lambda a: a["v_cache"].bfloat16()), "differs from the cache dtype"),
    (dict(v=lambda a: a["v"][:2]), "must match pairwise"),
    (dict(slot_mapping=lambda a: torch.tensor([0, 3, 3])), "writes the same slot twice"),
    (dict(slot_mapping=lambda a: torch.tensor([0, 3, 4])), "slot 4 is outside the cache's [0, 4) slots"),
    (dict(slot_mapping=lambda a: torch.tensor([0.0, 1.0, 2.0])), "must be an int32/int64 tensor"),
])
def test_bad_arguments_raise_naming_the_op(change, message):
    with pytest.raises(ContractError, match="rlalign.ops.rope_write_kv: .*" + re.escape(message)):
        ops.rope_write_kv(**_with(**change))


def test_no_token_writes_nothing():
    q, k, v, cos, sin, cache, slots = _case(0, 4, 2, 8, 4, 1, torch.float32, 1)
    kc = cache.clone()
    qo, ko = ops.rope_write_kv(q, k, v, cos, sin, kc, kc.clone(), slots)
    assert qo.shape == q.shape and ko.shape == k.shape and bool(kc.isnan().all())


def test_triton_kernel_under_the_interpreter():
    """rope_write_kv_kernel (fp32, interpreter) against rope_kernel + write_kv_cache: bits, caches, the K check
    under per-op / boundary / capture, hypothesis-chosen shapes (the worker's docstring)."""
    pytest.importorskip("triton")
    results = run_worker(["-m", "tests.ops.rope_write_kv_worker", "--interpret", "80"], interpret=True, timeout=1800)
    assert results["fixed_cases"] > 1


@pytest.fixture(scope="module")
def sm90_report():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: tests/cuda/test_cuda_rope_write_kv.py runs the kernel")
    return run_worker(["-m", "tests.ops.rope_write_kv_worker", "--sm90"], interpret=False, timeout=900)


def test_norm_sums_do_not_depend_on_the_register_layout(sm90_report):
    """rms_norm's sum of squares (and its backward's row sum) and the fused q/k norm of rope_write_kv reduce only
    pairs (elementwise._row_sum's tree): a tl.sum over a row adds in the order of the register layout, which Triton
    derives from each kernel's loads -- at head_dim 16 the fused norm's column-view loads got another layout than
    rms_fwd_kernel's contiguous rows, and fp32 paged prefill differed from the packed forward. Compiled at head dims
    16 / 48 / 128 through column views with an odd token stride, and at hidden sizes 1,000 and 4,096."""
    sums = sm90_report["norm_sums"]
    kinds = {r["kernel"] for r in sums}
    assert {"rms_fwd_kernel", "rms_bwd_kernel", "rope_write_kv_kernel+norm"} <= kinds, kinds
    # every variant's tree was found (>= 2 levels at every width compiled here): the check cannot pass by reading nothing
    empty = [(r["kernel"], r["args"]) for r in sums if len(r["widths"]) < 2]
    assert not empty, f"no float reductions found in the TTGIR of {empty} (did its format change?)"
    # rms_bwd_kernel's last reduction is dw's partial over its program's fixed rows (run-to-run deterministic, not a
    # quantity another kernel reproduces); every reduction before it, the row sum, must be a tree
    wide = [(r["kernel"], r["args"], r["widths"]) for r in sums
            if any(w > 2 for w in (r["widths"][:-1] if r["kernel"] == "rms_bwd_kernel" else r["widths"]))]
    assert not wide, f"float reductions over more than two values (layout-dependent order): {wide}"


def test_triton_kernel_compiles_for_sm90_without_spills(sm90_report):
    kernels = sm90_report["kernels"]
    assert {r["kernel"] for r in kernels} == {"rope_write_kv_kernel", "rope_kernel", "rope_write_kv_kernel+norm",
                                              "rms_fwd_kernel"}
    if any(r["ptxas"] is None for r in kernels):
        pytest.skip("Triton's ptxas could not be run here")
    for r in kernels:
        spills = [ln for ln in r["ptxas"].splitlines() if re.search(r"[1-9]\d* bytes spill", ln)]
        assert not spills, f"{r['kernel']} {r['dtype']}: {spills}"
        assert r["smem"] <= 232448
    # the rotation's roundings are spelled out (mul_rn / add_rn / sub_rn), so no kernel contracts x1 c - x2 s into
    # an fma (left to the compiler, the two kernels contracted it differently: fp32 k differed on the H200,
    # 2026-12-02); the fused kernel rotates in both branches: twice rope_kernel's products. The CUDA tier compares bits.
    by = {(r["kernel"], r["dtype"]): r for r in kernels}
    for dtype in ("torch.bfloat16", "torch.float32"):
        fused, alone = by[("rope_write_kv_kernel", dtype)], by[("rope_kernel", dtype)]
        assert fused["fma"] == alone["fma"] == 0, (fused, alone)
        assert fused["mul"] == 2 * alone["mul"] > 0, (fused, alone)
        # the fused q/k norm and rms_norm's kernel: the same sum of squares, neither contracted into an fma
        assert by[("rope_write_kv_kernel+norm", dtype)]["fma"] == by[("rms_fwd_kernel", dtype)]["fma"] == 0, by
    # (the CUDA tier compares the fused norm's bits with rms_norm + rope_write_kv's)


def test_disabling_one_of_the_rope_ops_disables_both():
    """RLALIGN_TRITON_DISABLE naming rope or rope_write_kv sends both to the torch backend: the packed forward's
    rope and the paged forward's rope_write_kv must come from one backend for their bits to agree."""
    from rlalign.ops._registry import disabled_ops
    assert disabled_ops("rope") == {"rope", "rope_write_kv"}
    assert disabled_ops(" attention_paged , rope_write_kv") == {"attention_paged", "rope", "rope_write_kv"}
    assert disabled_ops("sample") == {"sample"} and disabled_ops("") == frozenset()
