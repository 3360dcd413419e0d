"""The CPU speed paths of the torch backend give the bits of the plain formulation they replace.

* tile_mm issues its 64-row blocks as one bmm (and tile_mm_segments all K segments' blocks as one):
  equal to one torch.mm per block (doctor: "bmm item == mm of its 64-row block").
* attention: the per-forward plan, the scratch buffers, the two-gather K/V zeroing and the padding
  rows kept out of the elementwise math give the bits of the plain formula below (every tile row
  through the whole online softmax, keys outside a context zeroed after a gather), including
  caches holding NaN/inf outside every context, multi-block contexts and chunks of items.
"""

import threading

import pytest
import torch

from rlalign import ops
from rlalign.contract import spec
from rlalign.ops.torch_backend.attention import plan as attention_plan, scratch as attention_scratch
from rlalign.ops.torch_backend.linear import linear_fp32, segment_count
from rlalign.ops.torch_backend.primitives import compiled_gemm, kernel_defines, pad_rows, tile_mm
from rlalign.reductions import tree_sum
from tests.bitwise import assert_bitwise_equal

B, KV, QT = spec.ROW_BLOCK, spec.ATTN_KV_BLOCK, spec.ATTN_Q_TILE


def assert_same_bits(a, b):
    assert_bitwise_equal(a, b)


# ---- linear ------------------------------------------------------------------------------------------

def _tile_mm_plain(a, w):
    a = pad_rows(a, B)
    out = torch.empty((a.shape[0], w.shape[0]))
    for s in range(0, a.shape[0], B):
        torch.mm(a[s:s + B], w.t(), out=out[s:s + B])
    return out


def _linear_plain(x, w, k_segments):
    if not k_segments or k_segments == 1:
        return _tile_mm_plain(x, w)[:x.shape[0]]
    p = segment_count(x.shape[1], k_segments)
    seg = x.shape[1] // p
    parts = [_tile_mm_plain(x[:, i * seg:(i + 1) * seg].contiguous(), w[:, i * seg:(i + 1) * seg].contiguous())
             for i in range(p)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0][:x.shape[0]]


@pytest.mark.parametrize("m", [1, 63, 64, 65, 200, 640])
@pytest.mark.parametrize("k,n", [(16, 128), (128, 15), (384, 128), (96, 40), (1024, 64)])
def test_tile_mm_and_segments_equal_one_mm_per_block(m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    if kernel_defines():   # the cross-machine mode: the compiled kernel is every shape's definition, no MKL tile
        assert_same_bits(tile_mm(x, w), compiled_gemm(x, w, 1))
        for ks in (2, 8):
            assert_same_bits(linear_fp32(x, w, ks), compiled_gemm(x, w, segment_count(k, ks)))
        return
    assert_same_bits(tile_mm(x, w), _tile_mm_plain(x, w)[:m])
    assert_same_bits(tile_mm(x, w.t().contiguous().t()), _tile_mm_plain(x, w)[:m])  # w given transposed
    for ks in (2, 8):
        assert_same_bits(linear_fp32(x, w, ks), _linear_plain(x, w, ks))


def test_linear_op_with_and_without_autograd_same_bits():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(130, 256, generator=gen)
    w = torch.randn(64, 256, generator=gen)
    plain = ops.linear(x, w, k_segments=8, profile="strict")
    graph = ops.linear(x.requires_grad_(True), w, k_segments=8, profile="strict")
    assert graph.requires_grad
    assert_same_bits(plain, graph.detach())


# ---- attention: the plain formula ------------------------------------------------------------------------

def _reference_paged(q, k_cache, v_cache, block_table, seq_lens, cu, scale, chunk=None):
    """Every (sequence, kv head, 16-row tile) item, every row through every visible key block."""
    t, hq, d = q.shape
    _, ps, hkv, _ = k_cache.shape
    g = hq // hkv
    cu, lens, table = cu.long(), seq_lens.long(), block_table.long()
    k_rows, v_rows = k_cache.reshape(-1, d), v_cache.reshape(-1, d)
    out = torch.zeros(t * hq + 1, d)
    items = []
    for s in range(len(lens)):
        n_q = int(cu[s + 1] - cu[s])
        for h in range(hkv):
            for tile in range(-(-n_q * g // QT)):
                r = tile * QT + torch.arange(QT)
                tok, hg = r // g, r % g
                valid = tok < n_q
                pos = torch.where(valid, lens[s] - n_q + tok, 1 << 62)
                dest = torch.where(valid, (cu[s] + tok) * hq + h * g + hg, t * hq)
                items.append((s, h, pos, dest, int(torch.where(valid, pos, -1).max())))
    items.sort(key=lambda it: -it[4])  # stable: the op's item order (chunks only bound memory)
    q_rows = torch.cat([q.reshape(-1, d).float(), torch.zeros(1, d)])
    for s, h, pos, dest, last in items:
        qt = q_rows[dest].unsqueeze(0)
        m = torch.full((1, QT), float("-inf"))
        l, acc = torch.zeros(1, QT), torch.zeros(1, QT, d)
        for j in range(last // KV + 1):
            kp = j * KV + torch.arange(KV)
            inside = kp < lens[s]
            rows = (table[s, torch.clamp(kp // ps, max=table.shape[1] - 1)] * ps + kp % ps) * hkv + h
            kb = torch.where(inside.unsqueeze(1), k_rows[torch.where(inside, rows, 0)].float(), 0.0).unsqueeze(0)
            vb = torch.where(inside.unsqueeze(1), v_rows[torch.where(inside, rows, 0)].float(), 0.0).unsqueeze(0)
            sc = torch.bmm(qt, kb.transpose(1, 2)) * scale
            sc = torch.where(kp <= pos.unsqueeze(1), sc, float("-inf"))
            m_new = torch.maximum(m, sc.amax(-1))
            p = torch.exp(sc - m_new.unsqueeze(-1))
            alpha = torch.exp(m - m_new)
            l_new = l * alpha + tree_sum(p)
            acc_new = torch.bmm(p, vb) + acc * alpha.unsqueeze(-1)
            sees = pos >= j * KV
            m, l = torch.where(sees, m_new, m), torch.where(sees, l_new, l)
            acc = torch.where(sees.unsqueeze(-1), acc_new, acc)
        res = acc / l.unsqueeze(-1) + 0.0
        out[dest] = res[0]
    return out[:t * hq].reshape(t, hq, d).to(q.dtype)


def _paged_case(gen, lens, n_new, hq, hkv, d, ps, dtype, garbage):
    n_pages = sum(-(-n // ps) for n in lens) + 3
    perm = torch.randperm(n_pages, generator=gen).tolist()
    tables, nxt = [], 0
    for n in lens:
        tables.append(perm[nxt:nxt + -(-n // ps)])
        nxt += len(tables[-1])
    width = max(len(tb) for tb in tables)
    kc = (torch.randn(n_pages, ps, hkv, d, generator=gen) * 2).to(dtype)
    vc = torch.randn(n_pages, ps, hkv, d, generator=gen).to(dtype)
    if garbage:  # non-finite values in every slot outside the contexts
        inside = torch.zeros(n_pages * ps, dtype=torch.bool)
        for n, tb in zip(lens, tables):
            for p in range(n):
                inside[tb[p // ps] * ps + p % ps] = True
        kc.view(n_pages * ps, -1)[~inside] = float("nan")
        vc.view(n_pages * ps, -1)[~inside] = float("inf")
    q = torch.randn(sum(n_new), hq, d, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(n_new).cumsum(0).tolist(), dtype=torch.int32)
    bt = torch.tensor([tb + [0] * (width - len(tb)) for tb in tables], dtype=torch.int32)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (8, 1, 16), (3, 3, 8)])
@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("garbage", [False, True])
def test_paged_equals_plain_formula(dtype, hq, hkv, d, ps, garbage):
    gen = torch.Generator().manual_seed(hq * 100 + ps + d + int(garbage))
    lens = [1, 9, 40, 64, 65, 130, 7, 200]
    for n_new in ([1] * len(lens), [1, 9, 3, 64, 1, 20, 7, 1]):   # decode, and a mix with prefill chunks
        q, kc, vc, bt, sl, cu = _paged_case(gen, lens, n_new, hq, hkv, d, ps, dtype, garbage)
        out = ops.attention_paged(q, kc, vc, bt, sl, cu, profile="strict")
        assert_same_bits(out, _reference_paged(q, kc, vc, bt, sl, cu, d ** -0.5))


def test_paged_chunks_of_items_and_plan_reuse(monkeypatch):
    """Chunks of a few items (a chunk prefix per key block), a plan dropping its per-block rows
    (rebuilt per block), and one plan reused by calls with other caches and queries."""
    monkeypatch.setattr(attention_plan, "_CHUNK_ELEMS", 3 * KV * 32)
    monkeypatch.setattr(attention_plan, "_PLAN_SLOTS", 0)
    gen = torch.Generator().manual_seed(5)
    lens, n_new = [3, 70, 129, 64, 5, 150], [1, 2, 1, 1, 5, 1]
    q, kc, vc, bt, sl, cu = _paged_case(gen, lens, n_new, 4, 2, 32, 16, torch.float32, True)
    for _ in range(2):  # the second call hits the memoised plan, with new caches and queries
        out = ops.attention_paged(q, kc, vc, bt, sl, cu, profile="strict")
        assert_same_bits(out, _reference_paged(q, kc, vc, bt, sl, cu, 32 ** -0.5))
        kc, vc, q = kc * 1.5, vc - 1.0, q * 0.5


def test_paged_nonfinite_key_or_value_inside_a_context_raises():
    gen = torch.Generator().manual_seed(7)
    for where in ("k", "v"):
        q, kc, vc, bt, sl, cu = _paged_case(gen, [20, 3], [1, 1], 4, 2, 32, 16, torch.float32, False)
        page = int(bt[0, 1])
        (kc if where == "k" else vc)[page, 2, 1, 5] = float("inf")  # position 18 of sequence 0
        with pytest.raises(Exception, match="NaN or inf within a sequence's context"):
            ops.attention_paged(q, kc, vc, bt, sl, cu, profile="strict")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_forward_equals_paged_prefill_formula(dtype):
    """The packed (training) forward shares the online softmax: a packed batch equals the plain
    formula applied to the same sequences prefilled into a contiguous cache of page size 1."""
    gen = torch.Generator().manual_seed(11)
    lens, hq, hkv, d = [5, 64, 1, 100, 17], 4, 2, 32
    t = sum(lens)
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = ops.attention_varlen(q, k, v, cu, profile="strict")
    width = max(lens)
    bt = torch.tensor([[int(cu[s]) + i if i < n else 0 for i in range(width)] for s, n in enumerate(lens)],
                      dtype=torch.int32)
    ref = _reference_paged(q, k.unsqueeze(1), v.unsqueeze(1), bt, torch.tensor(lens, dtype=torch.int32), cu,
                           d ** -0.5)
    assert_same_bits(out, ref)


def test_scratch_buffers_across_inference_mode(monkeypatch):
    """Scratch buffers first made under torch.inference_mode (vLLM runs the ops there) must not be
    reused for in-place writes outside it, and vice versa."""
    monkeypatch.setattr(attention_scratch, "_scratch", threading.local())  # none made yet
    gen = torch.Generator().manual_seed(13)
    case = _paged_case(gen, [5, 70], [1, 1], 4, 2, 32, 16, torch.float32, False)
    with torch.inference_mode():
        inside = ops.attention_paged(*case, profile="strict")
    outside = ops.attention_paged(*case, profile="strict")
    with torch.inference_mode():
        again = ops.attention_paged(*case, profile="strict")
    assert_same_bits(inside, outside)
    assert_same_bits(again, outside)
