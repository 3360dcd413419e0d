"""Tier 1: bitwise invariance of the dense strict ops (linear, rms_norm, rope, silu_mul)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract import spec
from rlalign.ops.torch_backend.linear import segment_count
from tests.bitwise import assert_bitwise_equal

DTYPES = [torch.float32, torch.bfloat16]
SETTINGS = dict(max_examples=25, deadline=None)


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@settings(**SETTINGS)
@given(rows=st.integers(1, 512), pos=st.data(), k=st.sampled_from([64, 96, 256, 1024]),
       n=st.sampled_from([32, 200, 512]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_linear_row_is_batch_invariant(rows, pos, k, n, dtype, seed):
    w = _rand(n, k, dtype=dtype, seed=seed)
    x = _rand(rows, k, dtype=dtype, seed=seed + 1)
    i = pos.draw(st.integers(0, rows - 1))
    alone = ops.linear(x[i:i + 1], w)
    in_batch = ops.linear(x, w)[i:i + 1]
    assert_bitwise_equal(in_batch, alone, f"row {i} of {rows}")


@settings(**SETTINGS)
@given(rows=st.integers(2, 300), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_linear_row_ignores_other_rows_content(rows, dtype, seed):
    w = _rand(128, 256, dtype=dtype, seed=seed)
    x = _rand(rows, 256, dtype=dtype, seed=seed + 1)
    y = x.clone()
    y[1:] = _rand(rows - 1, 256, dtype=dtype, seed=seed + 2) * 100
    assert_bitwise_equal(ops.linear(x, w)[0], ops.linear(y, w)[0])


@settings(max_examples=60, deadline=None)
@given(rows=st.one_of(st.sampled_from([1, 63, 64, 65, 129]), st.integers(1, 200)), data=st.data(),
       k=st.one_of(st.sampled_from([1, 2, 3, 17, 127, 128, 1000, 3000, 4099]), st.integers(1, 300)),
       n=st.one_of(st.integers(1, 9), st.sampled_from([15, 16, 17, 64, 130])),
       k_segments=st.sampled_from([None, spec.K_SEGMENTS]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_linear_row_invariant_for_every_shape(rows, data, k, n, k_segments, dtype, seed):
    """Narrow N (the value head is N = 1), odd and prime K, the canonical partition's fallback shapes
    (K = 1000, 3000 with 8 segments): a row's bits are the same alone, in the batch, at another position
    (rows permuted) and among other rows (the batch cut at another row count)."""
    w = _rand(n, k, dtype=dtype, seed=seed)
    x = _rand(rows, k, dtype=dtype, seed=seed + 1)
    full = ops.linear(x, w, k_segments=k_segments)
    i = data.draw(st.integers(0, rows - 1), label="row")
    assert_bitwise_equal(ops.linear(x[i:i + 1], w, k_segments=k_segments), full[i:i + 1], f"row {i} alone vs in {rows}")
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    assert_bitwise_equal(ops.linear(x[perm], w, k_segments=k_segments), full[perm], f"{rows} rows permuted")
    cut = data.draw(st.integers(1, rows), label="cut")
    assert_bitwise_equal(ops.linear(x[:cut], w, k_segments=k_segments), full[:cut], f"first {cut} of {rows} rows")


def test_linear_bias_and_leading_dims():
    w, b = _rand(48, 64), _rand(48, seed=3)
    x = _rand(3, 5, 64, seed=4)
    out = ops.linear(x, w, b)
    assert out.shape == (3, 5, 48)
    assert_bitwise_equal(out[1, 2], ops.linear(x[1, 2:3], w, b)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [512, 1024, 96])
def test_canonical_partition_equals_tree_of_segment_partials(dtype, k):
    """linear(k_segments=P) == each K segment reduced alone, merged ((s0+s1)+(s2+s3))+... in fp32."""
    w, x = _rand(64, k, dtype=dtype, seed=5), _rand(37, k, dtype=dtype, seed=6)
    p = segment_count(k, spec.K_SEGMENTS)
    seg = k // p
    # per-segment partials from the strict op itself, so the test checks the merge, not the GEMM
    partials = [ops.linear(x[:, i * seg:(i + 1) * seg].float(), w[:, i * seg:(i + 1) * seg].float()) for i in range(p)]
    while len(partials) > 1:
        partials = [partials[i] + partials[i + 1] for i in range(0, len(partials), 2)]
    assert_bitwise_equal(ops.linear(x, w, k_segments=spec.K_SEGMENTS), partials[0].to(dtype))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_canonical_partition_tp_shards_merge_to_same_bits(tp):
    """A TP rank reduces its own subtree (P/tp segments); merging rank results in rank order by the
    top of the same tree gives the TP=1 bits."""
    k, dtype = 1024, torch.bfloat16
    w, x = _rand(32, k, dtype=dtype, seed=7), _rand(19, k, dtype=dtype, seed=8)
    full = ops.linear(x, w, k_segments=spec.K_SEGMENTS)
    shard = k // tp
    rank_partials = []
    for r in range(tp):
        xs, ws = x[:, r * shard:(r + 1) * shard].float(), w[:, r * shard:(r + 1) * shard].float()
        rank_partials.append(ops.linear(xs, ws, k_segments=spec.K_SEGMENTS // tp))
    while len(rank_partials) > 1:
        rank_partials = [rank_partials[i] + rank_partials[i + 1] for i in range(0, len(rank_partials), 2)]
    assert_bitwise_equal(rank_partials[0].to(dtype), full)


@settings(**SETTINGS)
@given(rows=st.integers(1, 400), h=st.sampled_from([64, 100, 1024]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), with_residual=st.booleans())
def test_rms_norm_row_is_batch_invariant(rows, h, dtype, seed, with_residual):
    x, w = _rand(rows, h, dtype=dtype, seed=seed), _rand(h, dtype=dtype, seed=seed + 1)
    res = _rand(rows, h, dtype=dtype, seed=seed + 2) if with_residual else None
    full = ops.rms_norm(x, w, 1e-6, residual=res)
    alone = ops.rms_norm(x[-1:], w, 1e-6, residual=None if res is None else res[-1:])
    if with_residual:
        assert_bitwise_equal(full[0][-1:], alone[0])
        assert_bitwise_equal(full[1][-1:], alone[1])
    else:
        assert_bitwise_equal(full[-1:], alone)


@settings(**SETTINGS)
@given(t=st.integers(1, 300), heads=st.integers(1, 4), d=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_rope_and_silu_are_position_invariant(t, heads, d, dtype, seed):
    x = _rand(t, heads, d, dtype=dtype, seed=seed)
    pos = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(seed))
    cos, sin = ops.rope_cos_sin(pos, ops.rope_inv_freq(d, 1e6))
    full = ops.rope(x, cos, sin)
    assert_bitwise_equal(full[t // 2:t // 2 + 1], ops.rope(x[t // 2:t // 2 + 1], cos[t // 2:t // 2 + 1], sin[t // 2:t // 2 + 1]))
    g, u = x.reshape(t, -1), _rand(t, heads * d, dtype=dtype, seed=seed + 1)
    assert_bitwise_equal(ops.silu_mul(g, u)[-1], ops.silu_mul(g[-1:], u[-1:])[0])


def test_linear_forward_backward_run_to_run():
    w = _rand(96, 128, seed=9).requires_grad_()
    x = _rand(70, 128, seed=10).requires_grad_()
    outs = []
    for _ in range(2):
        w.grad = x.grad = None
        y = ops.linear(x, w, k_segments=8)
        (y.float() ** 2).sum().backward()
        outs.append((y.detach().clone(), x.grad.clone(), w.grad.clone()))
    for a, b in zip(*outs):
        assert_bitwise_equal(a, b)


def test_rms_norm_backward_run_to_run():
    x = _rand(33, 64, seed=11).requires_grad_()
    w = _rand(64, seed=12).requires_grad_()
    grads = []
    for _ in range(2):
        x.grad = w.grad = None
        ops.rms_norm(x, w, 1e-5).pow(2).sum().backward()
        grads.append((x.grad.clone(), w.grad.clone()))
    for a, b in zip(*grads):
        assert_bitwise_equal(a, b)


@settings(**SETTINGS)
@given(rows=st.integers(0, 70), h=st.sampled_from([1, 64, 100, 1024]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_rms_norm_residual_without_grad_equals_the_add_first(rows, h, dtype, seed):
    """Without autograd the backend adds the residual itself (the Triton kernel in the norm's launch): the stream and
    the normed rows are those of ``x + residual`` followed by the norm, raw bits, empty batches included."""
    x, r, w = _rand(rows, h, dtype=dtype, seed=seed), _rand(rows, h, dtype=dtype, seed=seed + 1), _rand(h, seed=seed + 2)
    w = w.to(dtype)
    with torch.no_grad():
        out, stream = ops.rms_norm(x, w, 1e-6, residual=r)
    assert_bitwise_equal(stream, x + r, "stream")
    assert_bitwise_equal(out, ops.rms_norm(x + r, w, 1e-6), "normed rows")
    grad_out, grad_stream = ops.rms_norm(x.clone().requires_grad_(), w, 1e-6, residual=r)
    assert_bitwise_equal(grad_out.detach(), out, "with autograd")
    assert_bitwise_equal(grad_stream.detach(), stream, "stream with autograd")
