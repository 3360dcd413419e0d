"""CUDA: the native rollout profile as a fair baseline.

- Native paged attention reads K/V through the page table in the Triton paged kernel (no gather: no
  index/gather kernel runs), for prefill with a block table and decode, at batch 1 with a long context
  (the split launch) and at batch 256 (one program per item), and inside a CUDA graph replayed with other
  contexts. Accuracy vs float64: ||out - ref|| / ||ref|| < 1e-2 in bf16 (the strict kernel's bound).
- The native sampler's static form captured in a CUDA graph: every replay's greedy rows are the argmax, its
  top-k rows stay in their top k, and the noise is fresh per replay (the default generator's philox offset).
- The native MoE experts run as grouped GEMMs on the GPU (bf16) and agree with the per-expert loop.
"""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from rlalign.ops import capturing_graph
from rlalign.ops.attention import native_paged_kernel_unavailable
from tests.cuda.conftest import rand, rel_err

pytestmark = pytest.mark.cuda

HQ, HKV, D, PAGE = 16, 8, 128, 16
TOL = 1e-2


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _cache(lens, seed):
    """Shuffled pages holding every sequence's K/V (NaN elsewhere) -> (k, v packed, k_cache, v_cache, table)."""
    t = sum(lens)
    k, v = rand(t, HKV, D, seed=seed), rand(t, HKV, D, seed=seed + 1)
    pages = [-(-n // PAGE) for n in lens]
    total = sum(pages) + 3
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.zeros((len(lens), max(pages) + 2), dtype=torch.int32)
    kc = torch.full((total, PAGE, HKV, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    vc = kc.clone()
    start = used = 0
    for s, n in enumerate(lens):
        ids = torch.tensor(perm[used:used + pages[s]])
        used += pages[s]
        table[s, :len(ids)] = ids
        pos = torch.arange(n)
        slot = (ids[pos // PAGE] * PAGE + pos % PAGE).cuda()
        ops.write_kv_cache(k[start:start + n], v[start:start + n], kc, vc, slot, profile="native")
        start += n
    return k, v, kc, vc, table.cuda()


def _reference(q, k, v, lens, n_q):
    """float64: sequence s's last n_q[s] queries at the end of its context, causal."""
    out, start, qs = [], 0, 0
    for n, m in zip(lens, n_q):
        kk = k[start:start + n].double().repeat_interleave(HQ // HKV, 1)
        vv = v[start:start + n].double().repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("thd,uhd->htu", q[qs:qs + m].double(), kk) * D ** -0.5
        causal = torch.arange(n, device="cuda")[None, :] <= torch.arange(n - m, n, device="cuda")[:, None]
        out.append(torch.einsum("htu,uhd->thd", s.masked_fill(~causal, float("-inf")).softmax(-1), vv))
        start, qs = start + n, qs + m
    return torch.cat(out)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def _kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("lens, n_q", [
    ((4096,), (1,)),                                   # batch 1, long context: the split launch
    (tuple(range(1, 257)), (1,) * 256),                # batch 256: one program per item
    ((1, 70, 300, 700), (1, 33, 300, 64)),             # prefill with a block table, ragged
])
def test_native_paged_reads_the_pages_and_is_accurate(lens, n_q):
    _needs_cuda()
    k, v, kc, vc, table = _cache(lens, seed=len(lens))
    q = rand(sum(n_q), HQ, D, seed=99)
    assert native_paged_kernel_unavailable(q) is None
    cu, seq_lens = _i32([0, *torch.tensor(n_q).cumsum(0).tolist()]), _i32(list(lens))
    out = ops.attention_paged(q, kc, vc, table, seq_lens, cu, profile="native")
    err = rel_err(out, _reference(q, k, v, lens, n_q))
    assert err < TOL, f"native paged vs float64: relative error {err} (lens {lens[:4]}...)"
    # the same index tensors: their validation (which indexes the block table once) is memoised by the first call
    names = _kernel_names(lambda: ops.attention_paged(q, kc, vc, table, seq_lens, cu, profile="native"))
    gathers = [n for n in names if "index" in n.lower() or "gather" in n.lower()]
    assert not gathers and any("attn_fwd" in n or "attn_stream" in n for n in names), f"kernels: {sorted(set(names))}"


def test_native_paged_decode_in_a_cuda_graph():
    """Captured once for a batch of 8 at a 64-page table (the decode graphs' form), replayed with other contexts."""
    _needs_cuda()
    lens = [1, 17, 300, 64, 65, 1000, 256, 257]
    k, v, kc, vc, table = _cache([1024] * 8, seed=3)
    q_static = rand(8, HQ, D, seed=5)
    lens_static, cu = _i32(lens), torch.arange(9, dtype=torch.int32, device="cuda")
    with ops.static_decode():
        ops.attention_paged(q_static, kc, vc, table, lens_static, cu, profile="native")   # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with ops.static_decode(), capturing_graph(max_query_len=1), torch.cuda.graph(graph):
        out = ops.attention_paged(q_static, kc, vc, table, lens_static, cu, profile="native")
    for trial, ctx in enumerate(([5, 900, 1024, 1, 333, 64, 700, 2], lens)):
        lens_static.copy_(_i32(ctx))
        q_static.copy_(rand(8, HQ, D, seed=10 + trial))
        graph.replay()
        ref = torch.cat([_reference(q_static[s:s + 1], k[1024 * s:1024 * (s + 1)], v[1024 * s:1024 * (s + 1)],
                                    [n], [1]) for s, n in enumerate(ctx)])
        err = rel_err(out, ref)
        assert err < TOL, f"replay {trial}: relative error {err}"


def test_native_sampler_in_a_cuda_graph():
    _needs_cuda()
    rows, vocab = 64, 4096
    logits = torch.zeros(rows, vocab, device="cuda")
    logits[:, :8] = 1.0                                  # 8 equally likely top tokens per row
    logits[0, 100] = 5.0                                 # row 0 greedy: argmax 100
    temperature = torch.ones(rows, device="cuda")
    temperature[0] = 0.0
    top_k = torch.zeros(rows, dtype=torch.int64, device="cuda")
    top_k[1::2] = 8                                      # odd rows: the top 8 only
    seeds = torch.arange(rows, device="cuda")
    kw = dict(seeds=seeds, seq_ids=seeds, positions=seeds, temperature=temperature, top_k=top_k, profile="native")
    with ops.static_decode():
        ops.sample(logits, **kw)                         # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with ops.static_decode(), capturing_graph(sample_filtered=True) as verdicts, torch.cuda.graph(graph):
        tokens = ops.sample(logits, **kw)
    draws = []
    for _ in range(3):
        graph.replay()
        assert all(bool(ok) for _, _, ok in verdicts)
        draws.append(tokens.clone())
    for got in draws:
        assert int(got[0]) == 100
        assert bool((got[1::2] < 8).all()), "a top-8 row emitted outside its top 8"
    assert not torch.equal(draws[0][1:], draws[1][1:]), "two replays drew the same 63 tokens: the noise is not fresh"


def test_native_moe_experts_are_grouped_gemms_on_cuda():
    """bf16 on the H200: the native experts take torch._grouped_mm (no host read: a native MoE engine captures
    its decode steps) and agree with the per-expert loop to bf16 rounding, odd and empty groups included."""
    _needs_cuda()
    from rlalign.ops.moe import _native_expert_ffn, expert_ffn_loop, native_grouped_unavailable

    experts, hidden, inter = 16, 256, 128
    gate, up = rand(experts, inter, hidden, seed=1, scale=0.05), rand(experts, inter, hidden, seed=2, scale=0.05)
    down = rand(experts, hidden, inter, seed=3, scale=0.05)
    ids = torch.sort(torch.randint(0, experts - 3, (301,), generator=torch.Generator().manual_seed(0))).values.cuda()
    rows = rand(301, hidden, seed=4)
    with torch.no_grad():
        reason = native_grouped_unavailable(rows, gate, up, down)
        assert reason is None, f"the native experts fall back to the per-expert loop on this GPU: {reason}"
        got = _native_expert_ffn(rows, ids, gate, up, down, None, "native")
        want = expert_ffn_loop(rows, ids, gate, up, down, None, profile="native")
    err = rel_err(got, want)
    assert err < TOL, f"grouped native experts vs the loop: relative error {err}"
