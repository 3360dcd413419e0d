"""CUDA: strict attention on the Triton backend -- prefill == decode == packed, bitwise.

A query's output has the same bits (torch.equal, first difference reported) in: a packed varlen
training forward; the same sequence alone; a paged prefill of the batch; chunked prefill with
random chunk sizes; step-by-step decode (one sequence, and several sequences decoding together);
random page layouts and page sizes 16 / 64 / 128, unused pages full of NaN; every tile config.
GQA (8 query heads on 2 kv heads) and head_dim 64 / 128. Backward: deterministic run to run and
per sequence (alone == packed). Accuracy vs float64: ||out-ref||/||ref|| < 1e-2 (bf16).
"""

from __future__ import annotations


import pytest
import torch

from rlalign import ops
from tests.bitwise import assert_bitwise_equal
from tests.references import causal_attention_float64
from tests.cuda.conftest import rand, rel_err

pytestmark = pytest.mark.cuda

HQ, HKV = 8, 2
LENS = (1, 70, 130, 700)


def _batch(d, seed=0, lens=LENS, dtype=torch.bfloat16):
    t = sum(lens)
    q, k, v = rand(t, HQ, d, dtype=dtype, seed=seed), rand(t, HKV, d, dtype=dtype, seed=seed + 1), \
        rand(t, HKV, d, dtype=dtype, seed=seed + 2)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    return q, k, v, cu


def _paged_cache(k, v, lens, page_size, seed):
    """A NaN-filled cache holding every sequence's K/V in shuffled pages -> (k_cache, v_cache, table)."""
    pages = [-(-n // page_size) for n in lens]
    total = sum(pages) + 5
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(total, generator=g).tolist()
    width = max(pages) + 1
    table = torch.zeros((len(lens), width), dtype=torch.int32)
    kc = torch.full((total, page_size, HKV, k.shape[-1]), float("nan"), dtype=k.dtype, device="cuda")
    vc = kc.clone()
    start, used = 0, 0
    for s, n in enumerate(lens):
        ids = perm[used:used + pages[s]]
        used += pages[s]
        table[s, :len(ids)] = torch.tensor(ids)
        pos = torch.arange(n)
        slot = (torch.tensor(ids)[pos // page_size] * page_size + pos % page_size).cuda()
        ops.write_kv_cache(k[start:start + n], v[start:start + n], kc, vc, slot)
        start += n
    return kc, vc, table.cuda()


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("d", [64, 128])
def test_sequence_alone_equals_packed(triton_backend, d):
    q, k, v, cu = _batch(d)
    packed = ops.attention_varlen(q, k, v, cu)
    start = 0
    for n in LENS:
        alone = ops.attention_varlen(q[start:start + n], k[start:start + n], v[start:start + n], _i32([0, n]))
        assert_bitwise_equal(alone, packed[start:start + n], f"sequence of {n} alone")
        start += n
    assert_bitwise_equal(ops.attention_varlen(q, k, v, cu), packed, "run to run")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_paged_prefill_chunks_and_decode_equal_packed(triton_backend, d, page_size):
    q, k, v, cu = _batch(d, seed=10)
    packed = ops.attention_varlen(q, k, v, cu)
    kc, vc, table = _paged_cache(k, v, LENS, page_size, seed=page_size)
    lens = list(LENS)
    # whole prompts, all sequences in one call
    out = ops.attention_paged(q, kc, vc, table, _i32(lens), cu)
    assert_bitwise_equal(out, packed, f"paged prefill (page {page_size})")
    # chunked prefill of the longest sequence with uneven chunks
    s, n, s0 = 3, lens[3], sum(lens[:3])
    bounds = [0, 1, 64, 65, 200, 333, 600, n]
    for a, b in zip(bounds[:-1], bounds[1:]):
        out = ops.attention_paged(q[s0 + a:s0 + b], kc, vc, table[s:s + 1], _i32([b]), _i32([0, b - a]))
        assert_bitwise_equal(out, packed[s0 + a:s0 + b], f"chunk [{a}, {b}) of sequence {s}")
    # decode, one token at a time, of sequence 2
    s, n, s0 = 2, lens[2], sum(lens[:2])
    for t in range(n):
        out = ops.attention_paged(q[s0 + t:s0 + t + 1], kc, vc, table[s:s + 1], _i32([t + 1]), _i32([0, 1]))
        assert_bitwise_equal(out, packed[s0 + t:s0 + t + 1], f"decode step {t} of sequence {s}")


def test_batched_decode_equals_packed(triton_backend):
    """Four sequences decode together, each at its own length."""
    d = 128
    q, k, v, cu = _batch(d, seed=20)
    packed = ops.attention_varlen(q, k, v, cu)
    kc, vc, table = _paged_cache(k, v, LENS, 16, seed=3)
    ends = [n for n in LENS]
    for back in (0, 1, 5):
        rows = [sum(LENS[:s]) + max(ends[s] - 1 - back, 0) for s in range(len(LENS))]
        ctx = [max(ends[s] - back, 1) for s in range(len(LENS))]
        out = ops.attention_paged(q[rows], kc, vc, table, _i32(ctx), _i32(list(range(len(LENS) + 1))))
        assert_bitwise_equal(out, packed[rows], f"batched decode, {back} tokens before the end")


@pytest.mark.parametrize("d", [64, 128])
def test_tile_configs_are_interchangeable(triton_backend, d):
    from rlalign.ops.triton_backend import attention as A
    q, k, v, cu = _batch(d, seed=30)
    ref = A.varlen_forward(q, k, v, cu, d ** -0.5, tile=A.PREFILL_TILE)[0]
    for tile in ((64, 4, 3), (128, 4, 2), (64, 4, 1), (128, 8, 2)):
        assert_bitwise_equal(A.varlen_forward(q, k, v, cu, d ** -0.5, tile=tile)[0], ref, f"tile {tile}")
    kc, vc, table = _paged_cache(k, v, LENS, 64, seed=4)
    for tile in (A.DECODE_TILE, A.PREFILL_TILE):
        out = A.paged_forward(q, kc, vc, table, _i32(list(LENS)), cu, d ** -0.5, tile=tile)
        assert_bitwise_equal(out, ref, f"paged tile {tile}")


_reference = causal_attention_float64


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
def test_accuracy_vs_float64(triton_backend, dtype, tol):
    q, k, v, cu = _batch(128, seed=40, dtype=dtype)
    out = ops.attention_varlen(q, k, v, cu)
    err = rel_err(out, _reference(q, k, v, LENS, 128 ** -0.5))
    assert err < tol, f"rel err {err:.3g}"


def test_backward_deterministic_per_sequence_and_accurate(triton_backend):
    d = 128
    q, k, v, cu = _batch(d, seed=50, lens=(70, 130, 257))
    lens = (70, 130, 257)
    go = rand(*q.shape, seed=53)
    runs = []
    for _ in range(2):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        ops.attention_varlen(qq, kk, vv, cu).backward(go)
        runs.append((qq.grad, kk.grad, vv.grad))
    for a, b, name in zip(*runs, ("dq", "dk", "dv")):
        assert_bitwise_equal(a, b, f"{name} run to run")
    s0, n = lens[0] + lens[1], lens[2]
    qq, kk, vv = (x[s0:].clone().requires_grad_() for x in (q, k, v))
    ops.attention_varlen(qq, kk, vv, _i32([0, n])).backward(go[s0:])
    for a, b, name in zip((qq.grad, kk.grad, vv.grad), runs[0], ("dq", "dk", "dv")):
        assert_bitwise_equal(a, b[s0:], f"{name} of a sequence alone vs packed")
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    _reference(qd, kd, vd, lens, d ** -0.5).backward(go.double())
    for got, want, name in zip(runs[0], (qd.grad, kd.grad, vd.grad), ("dq", "dk", "dv")):
        err = rel_err(got, want)
        assert err < 2e-2, f"{name} rel err {err:.3g}"


def test_nonfinite_context_raises(triton_backend):
    from rlalign.contract.errors import ContractError
    from rlalign.ops import _checks as chk
    q, k, v, cu = _batch(64, seed=60, lens=(10,))
    kc, vc, table = _paged_cache(k, v, (10,), 16, seed=5)
    page, off = int(table[0, 0]), 3
    kc[page, off, 0, 0] = float("inf")
    # the op's own output check runs under the per-op policy (RLALIGN_CHECKS=per-op; the CUDA default checks
    # at the forward's boundaries: tests/cuda/test_cuda_check_policy.py)
    with ops.use_check_policy("per-op"), pytest.raises(ContractError, match="attention_paged"):
        ops.attention_paged(q, kc, vc, table, _i32([10]), cu)
        chk.flush()   # on CUDA the check is deferred to the next sync point (no host wait per layer)
