"""The compiled varlen attention backward (csrc/attention.c, rl_attn_bwd_*) gives the formulation's dq, dk, dv
bits, and the route never changes a bit: buckets outside the kernel's shapes, head dims whose self-check fails
and a failed self-check all run the formulation (rlalign.ops.torch_backend.attention.compiled_backward)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlalign import ops
from rlalign.ops.torch_backend import clib
from rlalign.ops.torch_backend.attention import compiled_backward as CB
from rlalign.ops.torch_backend.attention.backward import varlen_backward
from tests.bitwise import assert_bitwise_equal

pytestmark = pytest.mark.skipif(clib.library() is None, reason="the CPU kernels could not be built here")

_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _case(seed: int, lens: list[int], hq: int, hkv: int, d: int, dtype=torch.float32):
    """varlen_backward's arguments on random inputs (lse as a forward would leave it: finite, near the scores')."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, dout, out = (torch.randn(t, hq, d, generator=gen).to(dtype) for _ in range(3))
    k, v = (torch.randn(t, hkv, d, generator=gen).to(dtype) for _ in range(2))
    lse = torch.randn(t, hq, generator=gen) + 3.0
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, out, lse, cu, dout, d ** -0.5


def _unchecked(taken: list):
    """The kernel route without its self-check (records which buckets it took)."""
    def route(seqs, start, length, src, grads, hq, hkv, scale, window):
        taken.append(CB._fits(seqs, length, src, hq, hkv, window))
        if taken[-1]:
            CB._run_bucket(seqs, start, length, src, grads, hq, hkv, scale)
        return taken[-1]
    return route


def _assert_grads_equal(got, want, what):
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], want[:3]):
        assert_bitwise_equal(a, b, f"{name} {what}")


_LENS = st.lists(st.one_of(st.integers(1, 20), st.integers(60, 100)), min_size=1, max_size=6)


@_SETTINGS
@given(lens=_LENS, groups=st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 2), (8, 1)]),
       d=st.sampled_from([16, 32, 64, 128]), seed=st.integers(0, 2**31))
def test_kernel_equals_formulation_on_the_buckets_it_takes(lens, groups, d, seed):
    hq, hkv = groups
    if not CB.bwd_matches(d, hq // hkv, torch.get_num_threads()):
        pytest.skip(f"the kernel does not reproduce the library's GEMMs for head_dim {d} on this machine")
    args = _case(seed, lens, hq, hkv, d)
    taken = []
    _assert_grads_equal(varlen_backward(*args, bucket_route=_unchecked(taken)), varlen_backward(*args),
                        f"lens={lens} hq={hq} hkv={hkv} d={d} buckets taken={taken}")


@_SETTINGS
@given(lens=_LENS, groups=st.sampled_from([(2, 1), (4, 2), (16, 1)]), d=st.sampled_from([8, 16, 32, 64, 256]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31))
def test_the_route_never_changes_a_bit(lens, groups, d, dtype, seed):
    """The route as the op uses it (self-check included): head dims it refuses fall back (8 and 256 here)."""
    hq, hkv = groups
    args = _case(seed, lens, hq, hkv, d, dtype)
    _assert_grads_equal(varlen_backward(*args, bucket_route=CB.bucket_compiled), varlen_backward(*args),
                        f"lens={lens} hq={hq} hkv={hkv} d={d} {dtype}")


def test_bucket_shapes_outside_12_to_192_rows_are_refused():
    assert CB.bucket_shapes_fit(15, 2) and CB.bucket_shapes_fit(96, 2) and CB.bucket_shapes_fit(76, 1)
    assert not CB.bucket_shapes_fit(5, 2)          # 10 rows
    assert not CB.bucket_shapes_fit(97, 2)         # 194 rows at block 0
    assert not CB.bucket_shapes_fit(66, 2)         # 4 rows at block 1
    args = _case(0, [3, 1], 2, 1, 32)
    taken = []
    _assert_grads_equal(varlen_backward(*args, bucket_route=_unchecked(taken)), varlen_backward(*args), "[3, 1]")
    assert taken == [False]


def _op_grads(args):
    q, k, v, _, _, cu, dout, scale = args
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    ops.attention_varlen(q, k, v, cu, scale=scale).backward(dout)
    return q.grad, k.grad, v.grad


def test_the_op_falls_back_when_the_self_check_fails(monkeypatch):
    CB.bwd_matches.cache_clear()
    monkeypatch.setattr(CB, "bwd_agrees", lambda d, g, gen: False)

    def never(*a):
        raise AssertionError("the kernel ran although its self-check failed")

    monkeypatch.setattr(CB, "_run_bucket", never)
    args = _case(1, [15, 9, 1, 12], 4, 2, 32)
    try:
        got = _op_grads(args)
    finally:
        CB.bwd_matches.cache_clear()
    monkeypatch.undo()
    _assert_grads_equal(got, _op_grads(args), "self-check failed")


def test_the_op_runs_the_kernel_on_the_default_models_shapes(monkeypatch):
    """4 query / 2 kv heads of dim 32, short sequences: where the self-check passes the kernel runs them."""
    if not CB.bwd_matches(32, 2, torch.get_num_threads()):
        pytest.skip("the kernel does not reproduce the library's GEMMs for head_dim 32 on this machine")
    ran = []
    run = CB._run_bucket
    monkeypatch.setattr(CB, "_run_bucket", lambda *a: ran.append(1) or run(*a))
    args = _case(2, [15, 9, 1, 12, 14, 7], 4, 2, 32)
    got = _op_grads(args)
    assert ran
    monkeypatch.setattr(CB, "bucket_compiled", lambda *a: False)
    _assert_grads_equal(got, _op_grads(args), "default shapes")
