"""CUDA tier of ops.rope_write_kv (skipped without CUDA): the Triton kernel that rotates q and k, writes the
rotated k and v to their cache slots and flags a non-finite k, against what it replaced -- rope_kernel for q
and k, then write_kv_cache -- on the GPU, bf16 and fp32: the same bits (NaN-filled caches: unwritten slots
stay NaN); a NaN / inf in k gives write_kv_cache's deferred error at the next flush (a NaN in q or v is not
this op's check), also from inside a captured CUDA graph replayed on a bad k; the rollout engine's decode
graphs (which now call it once per layer) still give the trainer's logprobs bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract import ContractError
from rlalign.contract.bits import bits_equal
from rlalign.ops import _checks as chk
from tests.cuda.conftest import rand

pytestmark = pytest.mark.cuda


def _case(t, hq, hkv, d, page_size, extra_pages, dtype, seed):
    q, k, v = (rand(t, h, d, dtype=dtype, seed=seed + i) for i, h in enumerate((hq, hkv, hkv)))
    g = torch.Generator().manual_seed(seed)
    cos, sin = ops.rope_cos_sin(torch.randperm(40000, generator=g)[:t].cuda(), ops.rope_inv_freq(d, 1e6))
    pages = -(-t // page_size) + extra_pages
    slots = torch.randperm(pages * page_size, generator=g)[:t].cuda()
    cache = torch.full((pages, page_size, hkv, d), float("nan"), dtype=dtype, device="cuda")
    return q, k, v, cos, sin, cache, slots


def _separate(q, k, v, cos, sin, cache, slots):
    kc, vc = cache.clone(), cache.clone()
    qr, kr = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
    ops.write_kv_cache(kr, v, kc, vc, slots)
    return qr, kr, kc, vc


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 600), hkv=st.sampled_from([1, 2, 8]), group=st.sampled_from([1, 2, 4]),
       d=st.sampled_from([64, 128, 256]), page_size=st.sampled_from([1, 16, 64]), extra=st.integers(0, 4),
       bf16=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_bits_equal_the_separate_kernels(triton_backend, t, hkv, group, d, page_size, extra, bf16, seed):
    q, k, v, cos, sin, cache, slots = _case(t, hkv * group, hkv, d, page_size, extra,
                                            torch.bfloat16 if bf16 else torch.float32, seed)
    want = _separate(q, k, v, cos, sin, cache, slots)
    kc, vc = cache.clone(), cache.clone()
    qo, ko = ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots)
    ops.flush_deferred_checks()
    for name, got, ref in zip(("q", "k", "k_cache", "v_cache"), (qo, ko, kc, vc), want):
        assert bits_equal(got, ref), f"{name} differs (T={t}, Hkv={hkv}, G={group}, D={d}, page={page_size})"


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 600), hkv=st.sampled_from([1, 2, 8]), group=st.sampled_from([1, 2, 4]),
       d=st.sampled_from([16, 48, 64, 80, 96, 128, 256]), bf16=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_qk_norm_bits_equal_rms_norm_then_the_op(triton_backend, t, hkv, group, d, bf16, seed):
    """The q/k norm in rope_write_kv's launch: the bits of ops.rms_norm (rms_fwd_kernel) on q and k, then the op."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v, cos, sin, cache, slots = _case(t, hkv * group, hkv, d, 16, 2, dtype, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    wq, wk = (torch.randn(d, device="cuda", generator=g).to(dtype) for _ in range(2))
    kc_ref, vc_ref, kc, vc = (cache.clone() for _ in range(4))
    want = ops.rope_write_kv(ops.rms_norm(q, wq, 1e-6), ops.rms_norm(k, wk, 1e-6), v, cos, sin, kc_ref, vc_ref, slots)
    got = ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots, qk_norm=(wq, wk, 1e-6))
    ops.flush_deferred_checks()
    for name, a, b in (("q", got[0], want[0]), ("k", got[1], want[1]), ("k_cache", kc, kc_ref), ("v_cache", vc, vc_ref)):
        assert bits_equal(a, b), f"{name} differs (T={t}, Hkv={hkv}, G={group}, D={d}, {dtype})"


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 300), hkv=st.sampled_from([1, 2, 8]), group=st.sampled_from([1, 4]),
       d=st.sampled_from([16, 48, 64, 128]), spare=st.sampled_from([0, 8, 3]), norm=st.booleans(), bf16=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_column_views_of_one_projection_are_read_in_place(triton_backend, t, hkv, group, d, spare, norm, bf16, seed):
    """q, k, v as column views of one [T, (Hq + 2 Hkv) D + spare] tensor (the stacked q/k/v GEMM's output the
    paged forward passes): the bits of the op on contiguous copies, with and without the fused q/k norm."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    hq = hkv * group
    out = rand(t, (hq + 2 * hkv) * d + spare, dtype=dtype, seed=seed)
    cuts = (0, hq * d, (hq + hkv) * d, (hq + 2 * hkv) * d)
    q, k, v = (out[:, a:z].view(t, (z - a) // d, d) for a, z in zip(cuts, cuts[1:]))
    _, _, _, cos, sin, cache, slots = _case(t, hq, hkv, d, 16, 2, dtype, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    qk_norm = (*(torch.randn(d, device="cuda", generator=g).to(dtype) for _ in range(2)), 1e-6) if norm else None
    kc_ref, vc_ref, kc, vc = (cache.clone() for _ in range(4))
    want = ops.rope_write_kv(q.contiguous(), k.contiguous(), v.contiguous(), cos, sin, kc_ref, vc_ref, slots,
                             qk_norm=qk_norm)
    got = ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots, qk_norm=qk_norm)
    ops.flush_deferred_checks()
    for name, a, b in (("q", got[0], want[0]), ("k", got[1], want[1]), ("k_cache", kc, kc_ref), ("v_cache", vc, vc_ref)):
        assert bits_equal(a, b), f"{name} differs (T={t}, Hkv={hkv}, G={group}, D={d}, spare={spare}, norm={norm})"


def test_qwen3_decode_shape(triton_backend):
    q, k, v, cos, sin, cache, slots = _case(462, 16, 8, 128, 16, 8, torch.bfloat16, 7)
    want = _separate(q, k, v, cos, sin, cache, slots)
    kc, vc = cache.clone(), cache.clone()
    got = ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots) + (kc, vc)
    assert all(bits_equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("policy", ["per-op", "boundary"])
@pytest.mark.parametrize("where", ["k", "q", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_only_a_bad_key_fails_at_the_next_flush(triton_backend, policy, where, value):
    q, k, v, cos, sin, cache, slots = _case(300, 16, 8, 128, 16, 2, torch.bfloat16, 3)
    {"q": q, "k": k, "v": v}[where][299, 7, 127] = value
    messages = []
    with ops.use_check_policy(policy):
        for fn in (lambda: ops.write_kv_cache(ops.rope(k, cos, sin), v, cache.clone(), cache.clone(), slots),
                   lambda: ops.rope_write_kv(q, k, v, cos, sin, cache.clone(), cache.clone(), slots)):
            fn()
            try:
                ops.flush_deferred_checks()
                messages.append(None)
            except ContractError as exc:
                messages.append(str(exc))
    assert messages[0] == messages[1]
    assert (messages[1] is not None) == (where == "k")
    if where == "k":
        assert messages[1].startswith("rlalign.ops.write_kv_cache: k contains NaN or inf")


def test_a_captured_graph_flags_a_bad_key_at_replay(triton_backend):
    q, k, v, cos, sin, cache, slots = _case(64, 16, 8, 128, 16, 2, torch.bfloat16, 5)
    kc, vc = cache.clone(), cache.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):   # warm (compile) outside the capture
        ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots)
        ops.flush_deferred_checks()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with ops.use_check_policy("boundary"), ops.capturing_graph() as verdicts, torch.cuda.graph(graph):
        ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots)
    assert [op for op, _, _ in verdicts] == ["write_kv_cache"]
    graph.replay()
    assert bool(verdicts[0][2])
    k[10, 3, 5] = float("inf")
    graph.replay()
    assert not bool(verdicts[0][2])
    ops.requeue_deferred_checks(verdicts)
    with pytest.raises(ContractError, match="write_kv_cache: k contains NaN or inf"):
        ops.flush_deferred_checks()


def test_decode_graphs_match_the_trainer(triton_backend):
    """The engine's decode graphs (rope_write_kv once per layer and step) give the trainer's logprobs."""
    from rlalign.models.testing import tiny_model
    from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
    from tests.rollout.test_engine_bitwise import assert_matches_trainer, make_prompts
    model = tiny_model("qwen3", seed=5, init_std=0.1, dtype="bfloat16", device="cuda")
    engine = RolloutEngine(model, RolloutConfig(num_pages=256, decode_graphs="on", decode_graph_max_batch=16))
    completions = engine.generate(make_prompts(3, count=5), SamplingParams(n=2, max_new_tokens=24, seed=9))
    assert engine.counters["graph_steps"] > 0
    assert_matches_trainer(model, completions, 1.0)
