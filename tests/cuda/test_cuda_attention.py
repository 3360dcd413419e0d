"""CUDA: strict attention on the Triton backend -- prefill == decode == packed, bitwise.

A query's output has the same bits (torch.equal, first difference reported) in: a packed varlen
training forward; the same sequence alone; a paged prefill of the batch; chunked prefill with
random chunk sizes; step-by-step decode (one sequence, and several sequences decoding together);
random page layouts and page sizes 16 / 64 / 128, unused pages full of NaN; every tile config.
GQA (8 query heads on 2 kv heads) and head_dim 64 / 128. Backward: deterministic run to run and
per sequence (alone == packed). Accuracy vs float64: ||out-ref||/||ref|| < 1e-2 (bf16).

Key splits (spec.ATTN_KV_SPLIT, the production value: there is no override): contexts just below /
at / above multiples of the split, chunked prefill whose chunks start mid-split, decode with one
program per key split (+ the merge kernel) and with one program per (sequence, kv head), alone and
in batches of 8 / 64 / 256 other sequences, in a CUDA graph whose split grid comes from the table
width; decode at a 4,096 context vs float64. The fused merge (the item's last program folds the partials,
no merge kernel): equal to both launches and the packed forward over hypothesis batches 1..40 and contexts
around the split boundaries, twice on the same arrival counters, and in a CUDA graph replayed with other
contexts; the sweep's 3-programs-per-SM candidates (1 stage, 168-register cap) keep the bits. The streamed
decode launch (whole items in one pipelined loop per program): every op-level test above through it too (the
split_launch fixture), equal to the per-item launch and the packed forward over hypothesis batches 1..300 (bf16,
fp32), and in a CUDA graph replayed with other contexts.
The backward's --sweep-train candidates (attention.BackwardLaunch): accurate, deterministic run to run and per
sequence over hypothesis batches.
"""

from __future__ import annotations


import dataclasses

import pytest
import torch

from rlalign import ops
from rlalign.contract.spec import ATTN_KV_SPLIT as SPLIT
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
    vc = torch.full((total, page_size, HKV, v.shape[-1]), float("nan"), dtype=v.dtype, device="cuda")
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
        for split_programs in (False, True):
            out = A.paged_forward(q, kc, vc, table, _i32(list(LENS)), cu, d ** -0.5, tile=tile,
                                  split_programs=split_programs)
            assert_bitwise_equal(out, ref, f"paged tile {tile}, split programs {split_programs}")


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


# ---- key splits --------------------------------------------------------------------------------------

SPLIT_LENS = (SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT + 1, 4 * SPLIT + 3)


def _near_splits(n):
    """Positions < n on both sides of every split boundary, and the ends."""
    pos = {0, 1, n - 1}
    for b in range(SPLIT, n + 1, SPLIT):
        pos.update((b - 2, b - 1, b, b + 1))
    return sorted(p for p in pos if 0 <= p < n)


@pytest.fixture(params=[False, True, "stream"], ids=["item-launch", "split-launch", "stream-launch"])
def split_launch(request, monkeypatch):
    """Decode through the op with the per-item launch at every batch (no item count is <= 0 per SM, none is
    >= 10**9), with the split-program launch at every batch whose table holds several splits, and with the
    streamed launch at every batch; all must give the packed forward's bits (the op's own choice between them
    is a function of the shapes)."""
    from rlalign.ops.triton_backend import attention as A
    monkeypatch.setattr(A, "SPLIT_MAX_ITEMS_PER_SM", 10 ** 9 if request.param is True else 0)
    monkeypatch.setattr(A, "STREAM_MIN_ITEMS_PER_SM", 0 if request.param == "stream" else 10 ** 9)
    return request.param


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page_size", [16, 64])
def test_split_boundaries_prefill_chunks_and_decode_equal_packed(triton_backend, split_launch, d, page_size):
    """Every path around the split boundaries, with both launches (split programs forced on and off)."""
    from rlalign.ops.triton_backend import attention as A
    lens = SPLIT_LENS
    q, k, v, cu = _batch(d, seed=70, lens=lens)
    scale = d ** -0.5
    packed = ops.attention_varlen(q, k, v, cu)
    starts = [sum(lens[:s]) for s in range(len(lens))]
    kc, vc, table = _paged_cache(k, v, lens, page_size, seed=70 + page_size)
    s, n, s0 = 4, lens[4], starts[4]
    bounds = [0, 100, SPLIT - 1, SPLIT + 5, 2 * SPLIT, 3 * SPLIT - 7, n]   # chunks that start and end mid-split
    for split_programs in (False, True):
        how = f"page {page_size}, split programs {split_programs}"
        out = A.paged_forward(q, kc, vc, table, _i32(list(lens)), cu, scale, split_programs=split_programs)
        assert_bitwise_equal(out, packed, f"one-shot paged prefill ({how})")
        for a, b in zip(bounds[:-1], bounds[1:]):
            out = A.paged_forward(q[s0 + a:s0 + b], kc, vc, table[s:s + 1], _i32([b]), _i32([0, b - a]), scale,
                                  split_programs=split_programs)
            assert_bitwise_equal(out, packed[s0 + a:s0 + b], f"chunk [{a}, {b}) ({how})")
        for t in _near_splits(n):
            out = A.paged_forward(q[s0 + t:s0 + t + 1], kc, vc, table[s:s + 1], _i32([t + 1]), _i32([0, 1]), scale,
                                  split_programs=split_programs)
            assert_bitwise_equal(out, packed[s0 + t:s0 + t + 1], f"decode at position {t} ({how})")
        back = [max(n_ - 1, 0) for n_ in lens]   # every sequence decodes its last token together
        rows = [st + b_ for st, b_ in zip(starts, back)]
        out = A.paged_forward(q[rows], kc, vc, table, _i32(list(lens)), _i32(list(range(len(lens) + 1))), scale,
                              split_programs=split_programs)
        assert_bitwise_equal(out, packed[rows], f"batched decode ({how})")


def test_split_decode_through_the_op_every_position(triton_backend, split_launch):
    """Step-by-step decode of a 2 * SPLIT + 9 sequence through ops.attention_paged (the launch it picks)."""
    d = 128
    n = 2 * SPLIT + 9
    q, k, v, cu = _batch(d, seed=80, lens=(n,))
    packed = ops.attention_varlen(q, k, v, cu)
    kc, vc, table = _paged_cache(k, v, (n,), 16, seed=80)
    for t in range(n):
        out = ops.attention_paged(q[t:t + 1], kc, vc, table, _i32([t + 1]), _i32([0, 1]))
        assert_bitwise_equal(out, packed[t:t + 1], f"decode step {t}")


@pytest.mark.parametrize("others", [0, 7, 63, 255])
def test_split_decode_batch_invariant(triton_backend, split_launch, others):
    """One sequence's decode row alone and among 7 / 63 / 255 other sequences (random contexts up to
    1,500, random positions in the batch): the packed forward's bits, with the launch the op picks and
    with both launches forced."""
    from rlalign.ops.triton_backend import attention as A
    d = 128
    n = 3 * SPLIT + 17
    g = torch.Generator().manual_seed(90 + others)
    other_lens = torch.randint(1, 1500, (others,), generator=g).tolist()
    at = int(torch.randint(0, others + 1, (1,), generator=g))
    lens = other_lens[:at] + [n] + other_lens[at:]
    q, k, v, cu = _batch(d, seed=90 + others, lens=tuple(lens))
    start = sum(lens[:at])
    alone = ops.attention_varlen(q[start:start + n], k[start:start + n], v[start:start + n], _i32([0, n]))
    kc, vc, table = _paged_cache(k, v, lens, 16, seed=91 + others)
    rows = [sum(lens[:s]) + lens[s] - 1 for s in range(len(lens))]
    one_per_seq = _i32(list(range(len(lens) + 1)))
    want = alone[n - 1:n]
    out = ops.attention_paged(q[rows], kc, vc, table, _i32(lens), one_per_seq)
    assert_bitwise_equal(out[at:at + 1], want, f"decode among {others} others (the op's launch)")
    for split_programs, stream in ((False, False), (True, False), (False, True)):
        out = A.paged_forward(q[rows], kc, vc, table, _i32(lens), one_per_seq, d ** -0.5,
                              split_programs=split_programs, stream=stream)
        assert_bitwise_equal(out[at:at + 1], want, f"decode among {others} others, split programs {split_programs}, "
                                                   f"streamed {stream}")


def test_split_decode_page_layouts_agree(triton_backend, split_launch):
    """The same context in caches of page size 16 / 64 / 128 with different shuffles: the same bits."""
    d = 128
    n = 2 * SPLIT + 77
    q, k, v, cu = _batch(d, seed=100, lens=(n,))
    outs = []
    for page_size, seed in ((16, 1), (16, 2), (64, 3), (128, 4)):
        kc, vc, table = _paged_cache(k, v, (n,), page_size, seed=seed)
        outs.append(ops.attention_paged(q[n - 1:n], kc, vc, table, _i32([n]), _i32([0, 1])))
    for i, out in enumerate(outs[1:], 1):
        assert_bitwise_equal(out, outs[0], f"page layout {i} vs 0")


@pytest.mark.parametrize("split_launch", [True], indirect=True)
def test_split_decode_in_a_cuda_graph(triton_backend, split_launch):
    """A captured decode step of 4 sequences (split programs: the grid comes from the table width),
    replayed as the contexts grow across split boundaries: the packed forward's bits."""
    from rlalign.ops.triton_backend import attention as A
    lens = (SPLIT + 3, 2 * SPLIT + 2, 5, 3 * SPLIT)
    q, kc, vc, table, starts, packed = _decode_graph_case(lens, seed=110)
    items = A.decode_items(1, len(lens), q.shape[1], HKV)
    assert A.use_split_programs(items, table.shape[1] * 16, 0, A.device_sms(q)), "the capture would not split"
    _replays_equal_packed(q, kc, vc, table, lens, starts, packed, (0, 1, 2, 3, 4, SPLIT // 2), "graph replay")
    ops.flush_deferred_checks()


@pytest.mark.parametrize("split_launch", ["stream"], indirect=True)
def test_stream_decode_in_a_cuda_graph(triton_backend, split_launch):
    """A captured decode step of 6 sequences on the streamed launch (its work entries are derived inside the
    graph, every replay), replayed as the contexts move across split boundaries: the packed forward's bits."""
    from rlalign.ops.triton_backend import attention as A
    lens = (SPLIT + 3, 2 * SPLIT + 2, 5, 3 * SPLIT, 1, 4 * SPLIT + 1)
    q, kc, vc, table, starts, packed = _decode_graph_case(lens, seed=150)
    assert A.use_stream(A.decode_items(1, len(lens), q.shape[1], HKV), 1, A.device_sms(q)), "the capture would not stream"
    _replays_equal_packed(q, kc, vc, table, lens, starts, packed, (0, 1, 2, 3, 4, SPLIT // 2, SPLIT + 1),
                          "streamed graph replay")
    ops.flush_deferred_checks()


def test_stream_equals_item_and_packed(triton_backend):
    """Decode rows of batch 1..300 (contexts at / around split boundaries, 1 token, shuffled pages of 16 / 64,
    1 or 2 programs per SM -- so programs take one item, several, or none --, bf16 and fp32, head_dim 64 / 128):
    the streamed launch == the per-item launch == the packed forward, raw bits."""
    from hypothesis import Phase, given, settings, strategies as st

    from rlalign.ops.triton_backend import attention as A
    context = st.one_of(st.sampled_from([1, SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT, 4 * SPLIT + 1]),
                        st.integers(1, 5 * SPLIT))

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate])
    @given(lens=st.one_of(st.lists(context, min_size=1, max_size=40), st.lists(context, min_size=200, max_size=300)),
           page=st.sampled_from([16, 64]), per_sm=st.sampled_from([1, 2]), d=st.sampled_from([64, 128]),
           dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2 ** 16))
    def check(lens, page, per_sm, d, dtype, seed):
        q, k, v, cu = _batch(d, seed=seed, lens=tuple(lens), dtype=dtype)
        packed = ops.attention_varlen(q, k, v, cu)
        kc, vc, table = _paged_cache(k, v, lens, page, seed=seed)
        rows = [sum(lens[:s]) + n - 1 for s, n in enumerate(lens)]
        args = (q[rows], kc, vc, table, _i32(list(lens)), _i32(list(range(len(lens) + 1))), d ** -0.5)
        how = f"batch {len(lens)} page {page} {per_sm} programs/SM D={d} {dtype}"
        item = A.paged_forward(*args, split_programs=False, stream=False)
        streamed = A.paged_forward(*args, stream=True,
                                   launch=dataclasses.replace(A.STREAM_DECODE, programs_per_sm=per_sm))
        assert_bitwise_equal(item, packed[rows], f"per-item vs packed, {how}")
        assert_bitwise_equal(streamed, item, f"streamed vs per-item, {how}")
    check()


def _decode_graph_case(lens, seed):
    """Sequences of ``lens`` tokens (head_dim 128), their packed forward and a shuffled page-16 cache of their K/V
    -> (q, k_cache, v_cache, table, sequence starts, packed output)."""
    q, k, v, cu = _batch(128, seed=seed, lens=lens)
    kc, vc, table = _paged_cache(k, v, lens, 16, seed=seed)
    return q, kc, vc, table, [sum(lens[:s]) for s in range(len(lens))], ops.attention_varlen(q, k, v, cu)


def _replays_equal_packed(q, kc, vc, table, lens, starts, packed, backs, what, after_replay=lambda back: None):
    """One decode step of len(lens) sequences captured in a CUDA graph (after an eager warm-up call on each
    sequence's first token: compiles, allocates), then replayed with every context ``back`` tokens before the
    sequences' ends: each replay's rows must be the packed forward's bits; ``after_replay(back)`` checks more."""
    q_buf = q[starts].clone()
    ctx_buf = _i32([1] * len(lens))
    one_per_seq = _i32(list(range(len(lens) + 1)))
    ops.attention_paged(q_buf, kc, vc, table, ctx_buf, one_per_seq)   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with ops.capturing_graph(max_query_len=1), torch.cuda.graph(graph):
        out = ops.attention_paged(q_buf, kc, vc, table, ctx_buf, one_per_seq)
    for back in backs:
        ctx = [max(n - back, 1) for n in lens]
        rows = [st + c - 1 for st, c in zip(starts, ctx)]
        q_buf.copy_(q[rows])
        ctx_buf.copy_(_i32(ctx))
        graph.replay()
        assert_bitwise_equal(out, packed[rows], f"{what}, {back} tokens before the ends")
        after_replay(back)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
def test_split_decode_accuracy_vs_float64(triton_backend, split_launch, dtype, tol):
    """Decode rows of a 4,096-token context (16 splits) on both launches vs float64."""
    from rlalign.ops.triton_backend import attention as A
    d, n = 128, 4096
    q, k, v, cu = _batch(d, seed=120, lens=(n,), dtype=dtype)
    positions = [n - 1, 2 * SPLIT, 2 * SPLIT - 1, SPLIT, 3]
    ref = _reference(q[:, :, :], k, v, (n,), d ** -0.5)[positions]
    kc, vc, table = _paged_cache(k, v, (n,), 64, seed=120)
    for split_programs in (False, True):
        outs = [A.paged_forward(q[p:p + 1], kc, vc, table, _i32([p + 1]), _i32([0, 1]), d ** -0.5,
                                split_programs=split_programs) for p in positions]
        err = rel_err(torch.cat(outs), ref)
        assert err < tol, f"split programs {split_programs}: rel err {err:.3g}"


def test_split_backward_accurate_and_deterministic(triton_backend, split_launch):
    """The backward recomputes p from the merged lse: accurate vs float64 and deterministic across split
    boundaries (sequences of SPLIT + 1 and 3 * SPLIT + 5 tokens)."""
    d = 128
    lens = (SPLIT + 1, 3 * SPLIT + 5)
    q, k, v, cu = _batch(d, seed=130, lens=lens)
    go = rand(*q.shape, seed=133)
    grads = []
    for _ in range(2):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        ops.attention_varlen(qq, kk, vv, cu).backward(go)
        grads.append((qq.grad, kk.grad, vv.grad))
    for a, b, name in zip(*grads, ("dq", "dk", "dv")):
        assert_bitwise_equal(a, b, f"{name} run to run")
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    _reference(qd, kd, vd, lens, d ** -0.5).backward(go.double())
    for got, want, name in zip(grads[0], (qd.grad, kd.grad, vd.grad), ("dq", "dk", "dv")):
        err = rel_err(got, want)
        assert err < 2e-2, f"{name} rel err {err:.3g}"


# ---- the fused merge (DecodeLaunch.fused_merge: no merge kernel, the item's last program folds) ---------

def _fused_launch(**changes):
    import dataclasses

    from rlalign.ops.triton_backend import attention as A
    return dataclasses.replace(A.SPLIT_DECODE, fused_merge=True, **changes)


def _counters_zero():
    from rlalign.ops.triton_backend import _common as C
    torch.cuda.synchronize()
    return all(int(buf.abs().max()) == 0 for buf in C._ARRIVAL_COUNTERS.values())


def test_fused_merge_equals_both_launches(triton_backend):
    """bf16 decode rows of batch 1..40 (contexts at / around split boundaries, 1 token, shuffled pages, 1..8
    programs per item, fold widths / unrolls): fused split == two-kernel split == per-item == packed, raw
    bits; twice on the same arrival counters with other contexts (the last program resets them)."""
    from hypothesis import Phase, given, settings, strategies as st

    from rlalign.ops.triton_backend import attention as A
    context = st.one_of(st.sampled_from([1, SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT, 4 * SPLIT + 1]),
                        st.integers(1, 5 * SPLIT))

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate])
    @given(lens=st.lists(context, min_size=1, max_size=40), page=st.sampled_from([16, 64]),
           progs=st.sampled_from([None, 1, 3, 8]), fold=st.sampled_from([4, 16, 64]), unroll=st.sampled_from([1, 4, 8]),
           seed=st.integers(0, 2 ** 16))
    def check(lens, page, progs, fold, unroll, seed):
        d = 128
        q, k, v, cu = _batch(d, seed=seed, lens=tuple(lens))
        packed = ops.attention_varlen(q, k, v, cu)
        kc, vc, table = _paged_cache(k, v, lens, page, seed=seed)
        starts = [sum(lens[:s]) for s in range(len(lens))]
        one_per_seq = _i32(list(range(len(lens) + 1)))
        launch = _fused_launch(fold_rows=fold, merge_unroll=unroll)
        for back in (0, 1):   # the second launch reuses the counters, with other contexts
            ctx = [max(n - back, 1) for n in lens]
            rows = [st_ + c - 1 for st_, c in zip(starts, ctx)]
            how = f"batch {len(lens)} contexts {ctx} page {page} {progs} programs/item fold {fold} unroll {unroll}"
            call = dict(progs_per_item=progs)
            item = A.paged_forward(q[rows], kc, vc, table, _i32(ctx), one_per_seq, d ** -0.5, split_programs=False)
            two = A.paged_forward(q[rows], kc, vc, table, _i32(ctx), one_per_seq, d ** -0.5, split_programs=True,
                                  launch=dataclasses.replace(A.SPLIT_DECODE, fused_merge=False), **call)
            fused = A.paged_forward(q[rows], kc, vc, table, _i32(ctx), one_per_seq, d ** -0.5, split_programs=True,
                                    launch=launch, **call)
            assert_bitwise_equal(item, packed[rows], f"per-item vs packed, {how}")
            assert_bitwise_equal(two, item, f"two-kernel split vs per-item, {how}")
            assert_bitwise_equal(fused, item, f"fused split vs per-item, {how}")
            assert _counters_zero(), f"arrival counters not reset after {how}"
    check()


@pytest.mark.parametrize("split_launch", [True], indirect=True)
def test_fused_merge_in_a_cuda_graph(triton_backend, split_launch, monkeypatch):
    """The fused merge as the op's split launch, captured once and replayed as the contexts move across split
    boundaries (the counters, allocated by the warm-up call, are reset by every replay): the packed
    forward's bits; then an eager call on the same counters."""
    from rlalign.ops.triton_backend import attention as A
    monkeypatch.setattr(A, "SPLIT_DECODE", _fused_launch())
    lens = (SPLIT + 3, 2 * SPLIT + 2, 5, 3 * SPLIT, 1, 4 * SPLIT + 1)
    q, kc, vc, table, starts, packed = _decode_graph_case(lens, seed=140)

    def counters_reset(back):
        assert _counters_zero(), f"arrival counters not reset by the replay {back} tokens before the ends"
    # the warm-up call also allocates the counters (a capture never does)
    _replays_equal_packed(q, kc, vc, table, lens, starts, packed, (0, 1, 2, 3, 4, SPLIT // 2, SPLIT + 1),
                          "fused graph replay", counters_reset)
    one_per_seq = _i32(list(range(len(lens) + 1)))
    rows = [st + n - 1 for st, n in zip(starts, lens)]
    eager = ops.attention_paged(q[rows], kc, vc, table, _i32(list(lens)), one_per_seq)
    assert_bitwise_equal(eager, packed[rows], "eager fused call after the replays")
    ops.flush_deferred_checks()


@pytest.mark.parametrize("cap", [0, 168])
def test_three_programs_per_sm_candidates_keep_the_bits(triton_backend, cap):
    """The sweep's 3-programs-per-SM candidates (1 stage, a 168-register cap: spills, no other arithmetic),
    two-kernel and fused: the per-item launch's bits at a 4,096 context, batch 8."""
    import dataclasses

    from rlalign.ops.triton_backend import attention as A
    lens = (4096,) * 8
    q, k, v, cu = _batch(128, seed=150, lens=lens)
    kc, vc, table = _paged_cache(k, v, lens, 16, seed=150)
    rows = [s * 4096 + 4095 for s in range(8)]
    args = (q[rows], kc, vc, table, _i32(list(lens)), _i32(list(range(9))), 128 ** -0.5)
    item = A.paged_forward(*args, split_programs=False)
    for fused in (False, True):
        launch = dataclasses.replace(A.SPLIT_DECODE, tile=(64, 4, 1), max_registers=cap, fused_merge=fused)
        out = A.paged_forward(*args, split_programs=True, launch=launch)
        assert_bitwise_equal(out, item, f"{launch} vs per-item")


# ---- the backward's launch candidates (attention.BackwardLaunch; benchmarks/gpu_attention.py --sweep-train) ------

def _sweep_train_launches():
    """Every non-default --sweep-train candidate (the list an H200 sweep times)."""
    import importlib.util
    import os
    from rlalign.ops.triton_backend import attention as A
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu_attention.py")
    spec = importlib.util.spec_from_file_location("_bench_gpu_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return [launch for label, launch in bench.train_candidates(A) if launch != A.BWD_LAUNCH]


def test_backward_launches_accurate_deterministic_per_sequence(triton_backend):
    """Each --sweep-train candidate over hypothesis batches (1-3 sequences of 1-600 tokens, explicit: 1, 67, 129,
    300 and 3,000, 1,100): dq, dk, dv within 2e-2 of float64 (bf16), the same bits run to run and for a sequence alone as packed."""
    from hypothesis import Phase, example, given, settings, strategies as st

    from rlalign.ops.triton_backend import attention as A
    launches = _sweep_train_launches()
    assert launches, "no backward candidates"
    d, scale = 128, 128 ** -0.5

    @settings(max_examples=6, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate))
    @given(lens=st.lists(st.integers(1, 600), min_size=1, max_size=3), seed=st.integers(0, 1000))
    @example(lens=[1, 67, 129, 300], seed=0)
    @example(lens=[3000, 1100], seed=1)      # many programs at once, ragged
    def check(lens, seed):
        q, k, v, cu = _batch(d, seed=seed, lens=tuple(lens))
        go = rand(*q.shape, seed=seed + 7)
        out, lse = A.varlen_forward(q, k, v, cu, scale, store_lse=True)
        qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
        causal_attention_float64(qd, kd, vd, lens, scale).backward(go.double())
        s0, n = sum(lens[:-1]), lens[-1]
        alone_cu = _i32([0, n])
        out1, lse1 = A.varlen_forward(q[s0:], k[s0:], v[s0:], alone_cu, scale, store_lse=True)
        for launch in launches:
            grads = A.varlen_backward(q, k, v, out, lse, cu, go, scale, launch=launch)
            again = A.varlen_backward(q, k, v, out, lse, cu, go, scale, launch=launch)
            alone = A.varlen_backward(q[s0:], k[s0:], v[s0:], out1, lse1, alone_cu, go[s0:], scale, launch=launch)
            for name, a, b, c, want in zip(("dq", "dk", "dv"), grads, again, alone, (qd.grad, kd.grad, vd.grad)):
                assert_bitwise_equal(a, b, f"{launch} {lens}: {name} run to run")
                assert_bitwise_equal(c, a[s0:], f"{launch} {lens}: {name} of the last sequence alone vs packed")
                # 1-token sequences only: dq = dk = 0 exactly in float64; ours is fp32 rounding of dp - delta
                err = rel_err(a, want) if bool(want.any()) else float(a.double().abs().max())
                assert err < 2e-2, f"{launch} {lens}: {name} rel err {err:.3g}"
    check()
