"""CUDA: sliding-window and sink attention (gpt-oss) and wide MLA heads (DeepSeek-V3) on the Triton backend.

Op level (strict): a query's output has the same bits packed, alone, in one paged prefill of the batch, in a
chunked prefill and in batched step-by-step decode (pages shuffled in a NaN-filled cache of 16 / 64 slots), for
windows of 1, inside a 64-key block, across blocks and around the 256-key split, with and without sinks, GQA 8/2,
head widths 64 (gpt-oss), 24 (not a power of two) and 192 (DeepSeek-V3's 128 + 64: the wide launches), V heads of
their own width (192 / 128: DeepSeek-V3's; 24 / 40), bf16 and fp32; accurate vs float64. The backward: dq, dk, dv, dsinks vs float64 autograd, deterministic run to run and per
sequence. Native paged with a window / sinks runs the Triton paged kernel: accurate vs float64.

Model level: the gpt-oss and DeepSeek-V3 test models' three paths (packed, prefill, decode, random schedules) give
the same bits on CUDA, bf16 and fp32 (DeepSeek-V3 also at its real 192 / 128 head widths), and a gpt-oss training
step's gradients (sinks included) are deterministic.
"""

from __future__ import annotations


import pytest
import torch

from rlalign import ops
from rlalign.contract.errors import ContractError
from rlalign.models import ForwardBatch
from rlalign.models.testing import tiny_model
from tests.bitwise import assert_bitwise_equal
from tests.cuda.conftest import rand, rel_err
from tests.cuda.test_cuda_attention import _paged_cache
from tests.references import causal_attention_float64

pytestmark = pytest.mark.cuda

HQ, HKV = 8, 2
LENS = (1, 70, 300, 9)                    # 300: past the 256-key split
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}   # ||out - ref|| / ||ref|| vs float64 (fp32: bf16x3 dots)
# windows of 1, inside a block, across a block (ending past 256: the split), none (sinks only), past the length
CASES = [(1, True), (5, False), (60, True), (None, True), (10_000, False)]


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def _batch(d, dtype, seed, lens=LENS, dv=None):
    t = sum(lens)
    q, k = (rand(t, h, d, dtype=dtype, seed=seed + i) for i, h in enumerate((HQ, HKV)))
    v = rand(t, HKV, dv or d, dtype=dtype, seed=seed + 2)
    return q, k, v, _i32([0] + torch.tensor(lens).cumsum(0).tolist())


def _sinks(seed):
    return rand(HQ, dtype=torch.float32, seed=seed, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("d, dv", [(64, 64), (192, 192), (192, 128), (24, 40)])
@pytest.mark.parametrize("window, with_sinks", CASES)
def test_every_path_gives_the_packed_bits(triton_backend, d, dv, dtype, window, with_sinks):
    q, k, v, cu = _batch(d, dtype, seed=d, dv=dv)
    sinks = _sinks(7) if with_sinks else None
    kw = dict(window=window, sinks=sinks)
    what = f"d {d}/{dv} {dtype} window {window} sinks {with_sinks}"
    packed = ops.attention_varlen(q, k, v, cu, **kw)
    err = rel_err(packed, causal_attention_float64(q, k, v, list(LENS), d ** -0.5, window, sinks))
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} vs float64"
    starts = cu[:-1].tolist()
    for s, n in enumerate(LENS):
        r = slice(starts[s], starts[s] + n)
        assert_bitwise_equal(ops.attention_varlen(q[r], k[r], v[r], _i32([0, n]), **kw), packed[r],
                             f"{what}: sequence {s} alone")
    for page_size in (16, 64):
        kc, vc, table = _paged_cache(k, v, LENS, page_size, seed=page_size + d)
        assert_bitwise_equal(ops.attention_paged(q, kc, vc, table, _i32(list(LENS)), cu, **kw), packed,
                             f"{what}: one paged prefill (page {page_size})")
        s, n, s0 = 2, LENS[2], starts[2]
        bounds = [0, 1, 63, 65, 250, 258, 290, n]
        for a, b in zip(bounds[:-1], bounds[1:]):
            out = ops.attention_paged(q[s0 + a:s0 + b], kc, vc, table[s:s + 1], _i32([b]), _i32([0, b - a]), **kw)
            assert_bitwise_equal(out, packed[s0 + a:s0 + b], f"{what}: chunk [{a}, {b}) (page {page_size})")
        for pos in range(max(LENS)):                 # batched decode, every sequence still longer than pos
            live = [i for i, m in enumerate(LENS) if m > pos]
            rows = [starts[i] + pos for i in live]
            out = ops.attention_paged(q[rows], kc, vc, table[live], _i32([pos + 1] * len(live)),
                                      _i32(list(range(len(live) + 1))), **kw)
            assert_bitwise_equal(out, packed[rows], f"{what}: batched decode at {pos} (page {page_size})")


@pytest.mark.parametrize("d, dv", [(64, 64), (192, 128), (24, 40)])
@pytest.mark.parametrize("window, with_sinks", [(1, True), (60, True), (100, False), (None, True)])
def test_backward_accurate_deterministic_and_per_sequence(triton_backend, d, dv, window, with_sinks):
    """fp32 (bf16 rounds p and dS before the products: the accuracy bound would say little): dq, dk, dv, dsinks
    vs float64 autograd; the same bits run to run; sequence 0 packed first and again last gets the same bits."""
    lens = list(LENS) + [LENS[1]]
    q, k, v, cu = _batch(d, torch.float32, seed=3, lens=lens, dv=dv)
    n0, t = LENS[1], sum(lens)
    a = LENS[0]
    for x in (q, k, v):
        x[t - n0:] = x[a:a + n0]
    go = rand(*q.shape[:2], dv, dtype=torch.float32, seed=9)
    go[t - n0:] = go[a:a + n0]
    sinks = _sinks(5) if with_sinks else None

    def grads():
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)] + ([sinks.clone().requires_grad_(True)]
                                                                        if with_sinks else [])
        out = ops.attention_varlen(*leaves[:3], cu, window=window, sinks=leaves[3] if with_sinks else None)
        out.backward(go)
        return [x.grad for x in leaves]
    first, again = grads(), grads()
    ref = [x.double().requires_grad_(True) for x in (q, k, v)] + ([sinks.double().requires_grad_(True)]
                                                                  if with_sinks else [])
    causal_attention_float64(*ref[:3], lens, d ** -0.5, window, ref[3] if with_sinks else None).backward(go.double())
    for name, got, rerun, want in zip(("dq", "dk", "dv", "dsinks"), first, again, ref):
        assert rel_err(got, want.grad) < 1e-4, f"{name} d {d} window {window}: {rel_err(got, want.grad):.3g}"
        assert_bitwise_equal(rerun, got, f"{name} run to run")
        if name != "dsinks":
            assert_bitwise_equal(got[t - n0:], got[a:a + n0], f"{name}: sequence 1 packed twice")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_native_paged_runs_the_triton_kernel_with_window_and_sinks(triton_backend, dtype):
    q, k, v, cu = _batch(64, dtype, seed=30)
    sinks = _sinks(1)
    kc, vc, table = _paged_cache(k, v, LENS, 16, seed=1)
    ref = causal_attention_float64(q, k, v, list(LENS), 64 ** -0.5, 20, sinks)
    out = ops.attention_paged(q, kc, vc, table, _i32(list(LENS)), cu, window=20, sinks=sinks, profile="native")
    assert rel_err(out, ref) < TOL[dtype]


def test_split_and_streamed_launches_refuse_a_window(triton_backend):
    from rlalign.ops.triton_backend import attention as A
    q, k, v, cu = _batch(64, torch.bfloat16, seed=4)
    kc, vc, table = _paged_cache(k, v, LENS, 16, seed=2)
    for launch in (dict(split_programs=True), dict(stream=True)):
        with pytest.raises(ContractError, match="one-program-per-item launch only"):
            A.paged_forward(q[:4], kc, vc, table, _i32(list(LENS)), _i32([0, 1, 2, 3, 4]), 0.1, window=8, **launch)


# ---- the models --------------------------------------------------------------------------------------------

MODELS = {
    # gpt-oss: a window of 8 on layer 0 (decode steps whose window starts inside a page and a key block), sinks
    "gpt_oss": ("gpt_oss", dict(sliding_window=8)),
    "deepseek_v3": ("deepseek_v3", dict(n_group=4, topk_group=2, num_experts_per_tok=3)),
    # DeepSeek-V3's real head widths: K heads 128 + 64 = 192 (padded to 256 columns in the kernels), V 128
    "deepseek_v3-mla192": ("deepseek_v3", dict(n_group=4, topk_group=2, num_experts_per_tok=3, qk_nope_head_dim=128,
                                               qk_rope_head_dim=64, v_head_dim=128)),
}


@pytest.fixture(scope="module", params=[(m, d) for m in MODELS for d in DTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def model_setup(request):
    from tests.models import test_three_paths as three
    name, dtype = request.param
    family, keys = MODELS[name]
    model = tiny_model(family, seed=3, dtype=DTYPES[dtype], init_std=0.15, norm_jitter=0.2, device="cuda", **keys)
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in three.LENGTHS]
    with torch.no_grad():
        ref = three.split(model.forward_hidden(ForwardBatch.packed(seqs, "cuda")), [len(s) for s in seqs])
    return model, seqs, ref


@torch.no_grad()
def test_model_three_paths_cuda(model_setup):
    from tests.models import test_three_paths as three
    three.check_every_path(model_setup, "cuda")


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3"])
def test_model_training_gradients_are_deterministic(name):
    """A training forward and backward (log-probs of the packed batch): the same gradient bits twice, every
    parameter's gradient finite, the sinks' non-zero."""
    family, keys = MODELS[name]
    model = tiny_model(family, seed=5, dtype=torch.float32, init_std=0.15, device="cuda", **keys).train()
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 66, 1, 23)]
    targets = torch.tensor([t for s in seqs for t in s[1:] + [0]], device="cuda")

    def grads():
        model.zero_grad(set_to_none=True)
        hidden = model.forward_hidden(ForwardBatch.packed(seqs, "cuda"))
        lp, _ = ops.logprob_entropy(hidden, model.lm_head_weight, targets)
        lp.sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    first, again = grads(), grads()
    assert first.keys() == again.keys() and first
    for n, g in first.items():
        assert bool(torch.isfinite(g).all()), f"{n}: non-finite gradient"
        assert_bitwise_equal(again[n], g, f"{n}: gradient run to run")
    sinks = [n for n in first if n.endswith("sinks")]
    assert (name != "gpt_oss") or (sinks and all(bool(first[n].abs().sum() > 0) for n in sinks)), sinks


def test_engine_decodes_the_latent_cache_eagerly_on_cuda():
    """DeepSeek-V3's latent cache plans its scratch pages on the host: no decode graphs ('auto'), 'on' refused in one
    line; the expanded cache captures as the other families do."""
    from rlalign.rollout.config import RolloutConfig
    from rlalign.rollout.device_setup import decode_graph_mode
    from rlalign.rollout.errors import RolloutConfigError
    family, keys = MODELS["deepseek_v3"]
    model = tiny_model(family, seed=1, dtype=torch.bfloat16, device="cuda", **keys)
    assert decode_graph_mode(RolloutConfig(decode_graphs="auto"), model) is None
    with pytest.raises(RolloutConfigError, match="cannot capture multi-head latent attention"):
        decode_graph_mode(RolloutConfig(decode_graphs="on"), model)
    assert decode_graph_mode(RolloutConfig(decode_graphs="auto", mla_cache="expanded"), model) == "graphs"
