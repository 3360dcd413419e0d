"""CUDA: strict linear on the Triton backend -- invariance (bitwise), tile interchangeability, accuracy.

Bitwise (torch.equal on raw bits, first difference reported): a row's output does not depend on
the number of rows M (1..4096, which moves the launcher across tile shapes), the row's position,
the other rows' content, the run; every tile config and the TMA / pointer paths give the same
bits; k_segments=8 small-M and large-M kernels agree; TP partitions (fp32 shard partials merged by
the tree) equal the TP=1 bf16 call; dX rows are batch invariant; backward is deterministic.
Accuracy vs float64: bf16 ||out-ref||/||ref|| < 4e-3 (output rounding), fp32 (bf16x3) < 2e-5.
"""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from rlalign.contract import spec
from rlalign.contract.bits import bits_equal
from tests.bitwise import assert_bitwise_equal, first_difference
from tests.cuda.conftest import rand, rel_err

pytestmark = pytest.mark.cuda

N, K = 4096, 1024
M_VALUES = (1, 2, 3, 7, 16, 33, 64, 65, 100, 128, 255, 256, 511, 512, 1000, 4096)


@pytest.fixture(scope="module")
def big(triton_backend):
    return rand(4096, K, seed=1), rand(N, K, seed=2)


@pytest.mark.parametrize("k_segments", [None, spec.K_SEGMENTS])
def test_rows_do_not_depend_on_batch_size(big, k_segments):
    x, w = big
    full = ops.linear(x, w, k_segments=k_segments)
    for m in M_VALUES:
        assert_bitwise_equal(ops.linear(x[:m], w, k_segments=k_segments), full[:m], f"M={m} vs M=4096")
    for i in (0, 5, 4095):
        assert_bitwise_equal(ops.linear(x[i:i + 1], w, k_segments=k_segments), full[i:i + 1], f"row {i} alone")


def test_row_position_and_other_rows(big):
    x, w = big
    x = x[:300]
    full = ops.linear(x, w)
    perm = torch.randperm(300, device="cuda")
    assert_bitwise_equal(ops.linear(x[perm], w), full[perm], "permuted rows")
    y = x.clone()
    y[1:] = rand(299, K, seed=9, scale=100.0)
    assert_bitwise_equal(ops.linear(y, w)[0], full[0], "row 0 with other rows replaced")
    assert_bitwise_equal(ops.linear(x, w), full, "run to run")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("segments", [1, 4, 8])
def test_every_tile_config_and_path_gives_the_same_bits(triton_backend, dtype, segments):
    import dataclasses
    from rlalign.ops.triton_backend.gemm import all_configs, gemm
    x, w, b = rand(300, 1024, dtype=dtype, seed=3), rand(520, 1024, dtype=dtype, seed=4), rand(520, dtype=dtype, seed=5)
    configs = all_configs(segments, dtype == torch.float32)
    if segments > 1:   # the loop-per-segment structure (segment_tree_nested) too
        configs = configs + tuple(dataclasses.replace(c, nested=True) for c in configs)
    # every config on the TMA path; the pointer path (unaligned shapes) for the first and last
    runs = [(c, True) for c in configs] + [(configs[0], False), (configs[-1], False)]
    ref = gemm(x, w, b_trans=True, bias=b, segments=segments, config=runs[0][0], use_tma=True)
    report = {}
    for cfg, tma in runs[1:]:
        out = gemm(x, w, b_trans=True, bias=b, segments=segments, config=cfg, use_tma=tma)
        report[f"{cfg} tma={tma}"] = first_difference(out, ref)
    differing = {k: v for k, v in report.items() if v != "identical"}
    assert not differing, f"vs {runs[0][0]} tma=True: " + "; ".join(f"{k}: {v}" for k, v in differing.items())


def test_decode_tiles_give_the_training_tile_bits(triton_backend):
    """M <= 64 takes gemm.SMALL_M_TILES: 16- and 32-row tiles (mma.sync, not wgmma) and 128/256-column k-steps.
    Each of them, and the dispatcher's pick, gives the bits of a 128-row wgmma tile with 64-column steps (what a
    training batch runs): hypothesis over M (1..64 and past it), N off the tile grid, K a multiple of 64 but not
    always of 128/256 (the wide step then falls back to 64 columns), bias, fp32 output, TMA and pointer paths, and
    zero rows against all-negative columns (the sign of a zero sum must match)."""
    from hypothesis import example, given, settings, strategies as st
    from rlalign.ops.triton_backend.gemm import SMALL_M_TILES, GemmConfig, gemm
    training_tile = GemmConfig(128, 128, 8, 4, flatten=True)
    tiles = list(dict.fromkeys(tile for _, band in SMALL_M_TILES for tile in band))   # two bands share one

    @settings(max_examples=16, deadline=None, derandomize=True, database=None)
    @given(st.one_of(st.sampled_from([1, 2, 15, 16, 17, 32, 33, 64]), st.integers(1, 200)), st.integers(1, 700),
           st.sampled_from([64, 192, 256, 640, 1024, 4096]), st.booleans(), st.booleans(), st.booleans(),
           st.booleans())
    @example(1, 4096, 4096, False, False, True, False)
    @example(17, 130, 1024, True, True, False, True)
    def prop(m, n, k, bias, fp32_out, tma, signed_zeros):
        x, w = rand(m, k, seed=m + k), rand(n, k, seed=n + 7)
        if signed_zeros:
            x[: max(1, m // 2)] = 0.0
            w[: max(1, n // 3)] = -w[: max(1, n // 3)].abs() - 1.0
        b = rand(n, seed=3) if bias else None
        out_dtype = torch.float32 if fp32_out else torch.bfloat16
        ref = gemm(x, w, b_trans=True, bias=b, out_dtype=out_dtype, config=training_tile, use_tma=tma)
        runs = {"dispatcher": gemm(x, w, b_trans=True, bias=b, out_dtype=out_dtype, use_tma=tma)}
        for tile in tiles:
            runs[repr(tile)] = gemm(x, w, b_trans=True, bias=b, out_dtype=out_dtype, config=tile, use_tma=tma)
        report = {name: first_difference(out, ref) for name, out in runs.items()}
        differing = {name: r for name, r in report.items() if r != "identical"}
        assert not differing, (f"M={m} N={n} K={k} bias={bias} fp32_out={fp32_out} tma={tma} zeros={signed_zeros}: "
                               + "; ".join(f"{name}: {r}" for name, r in differing.items()))
    prop()


def test_kpart_schedule_candidates_give_the_default_bits(triton_backend):
    """Every large-M K-partition schedule of gemm.KPART_CANDIDATES (the --sweep-kpart candidates: a loop per
    segment, a stream of k-steps across segments and tiles, two programs per SM) gives the default's raw bits
    in bf16, the only dtype they are candidates for (fp32 operands take gemm._FP32_SMALL's tiles: the default's
    128x128 / 4 stages needs 295 KB of shared memory with fp32 operands, over the H200's 227 KiB):
    hypothesis over M (1, 63, 64, 65, 1000 among them), N off the tile grid, P = 2/4/8, A / B transposed, bias;
    one case has zero rows of A against all-negative B columns (-0.0 products: the sign of a zero must match)."""
    from hypothesis import example, given, settings, strategies as st
    from rlalign.ops.triton_backend.gemm import KPART_CANDIDATES, gemm

    @settings(max_examples=12, deadline=None, derandomize=True, database=None)
    @given(st.sampled_from([1, 63, 64, 65, 1000, 333]), st.integers(1, 300), st.sampled_from([2, 4, 8]),
           st.sampled_from([64, 128, 192, 512]), st.booleans(), st.booleans(), st.booleans(), st.booleans())
    @example(65, 130, 8, 64, False, True, False, True)   # no bias: a -0.0 output survives
    def prop(m, n, p, seg_k, a_trans, b_trans, bias, signed_zeros):
        dtype = torch.bfloat16
        k = p * seg_k
        a, b = rand(m, k, dtype=dtype, seed=m + n), rand(n, k, dtype=dtype, seed=k + 1)
        if signed_zeros:
            a[: max(1, m // 2)] = 0.0
            b[: max(1, n // 3)] = -b[: max(1, n // 3)].abs() - 1.0
        bvec = rand(n, dtype=dtype, seed=3) if bias else None
        a_in = a.t().contiguous() if a_trans else a
        b_in = b if b_trans else b.t().contiguous()
        ref = gemm(a_in, b_in, a_trans=a_trans, b_trans=b_trans, bias=bvec, segments=p, config=KPART_CANDIDATES[0])
        for cfg in KPART_CANDIDATES[1:]:
            out = gemm(a_in, b_in, a_trans=a_trans, b_trans=b_trans, bias=bvec, segments=p, config=cfg)
            assert_bitwise_equal(out, ref, f"{cfg} vs the default (M={m} N={n} P={p} seg_k={seg_k} "
                                           f"a_trans={a_trans} b_trans={b_trans} bias={bias})")
    prop()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("segments", [2, 4, 8])
def test_split_segment_partials_give_the_one_kernel_bits(triton_backend, dtype, segments):
    """Decode-sized M on a K partition runs as per-segment partials + a tree kernel: the bits of the one-kernel
    tree (every tile config of it, rows of M = 1..64 alone or together, bias, fp32 output, TMA and pointers)."""
    from rlalign.ops.triton_backend.gemm import SEGMENT_SPLIT_TABLE, SPLIT_SEGMENTS_MAX_M, all_configs, gemm
    x, w, b = rand(SPLIT_SEGMENTS_MAX_M, 1024, dtype=dtype, seed=6), rand(520, 1024, dtype=dtype, seed=7), \
        rand(520, dtype=dtype, seed=8)
    for m in (1, 17, SPLIT_SEGMENTS_MAX_M):
        split = gemm(x[:m], w, b_trans=True, bias=b, segments=segments)
        for cfg in all_configs(segments, dtype == torch.float32):
            one = gemm(x[:m], w, b_trans=True, bias=b, segments=segments, config=cfg)
            assert_bitwise_equal(split, one, f"M={m} split vs {cfg}")
        # every launch the table holds, at every M (bf16: fp32 operands keep the default launch)
        for _, launch in SEGMENT_SPLIT_TABLE if dtype == torch.bfloat16 else ():
            other = gemm(x[:m], w, b_trans=True, bias=b, segments=segments, split=launch)
            assert_bitwise_equal(other, split, f"M={m} split launch {launch}")
        assert_bitwise_equal(split[:1], gemm(x[:1], w, b_trans=True, bias=b, segments=segments), f"row 0 of M={m}")
        pointers = gemm(x[:m], w, b_trans=True, bias=b, segments=segments, use_tma=False)
        assert_bitwise_equal(pointers, split, f"M={m} pointer path")
        f32 = gemm(x[:m], w, b_trans=True, segments=segments, out_dtype=torch.float32)
        f32_one = gemm(x[:m], w, b_trans=True, segments=segments, out_dtype=torch.float32, config=all_configs(segments, dtype == torch.float32)[0])
        assert_bitwise_equal(f32, f32_one, f"M={m} fp32 output")


@pytest.mark.parametrize("out_mode", ["fp32", "acc_in"])
def test_fp32_output_configs_give_the_same_bits(triton_backend, out_mode):
    """fp32 outputs (lm_logits) and fp32 accumulation across calls (logprob backward dh)."""
    from rlalign.ops.triton_backend.gemm import all_configs, gemm
    x, w = rand(300, 1024, seed=30), rand(1024, 520, seed=31)
    start = rand(300, 520, dtype=torch.float32, seed=32)
    outs = {}
    for cfg in all_configs(1, False, out_mode):
        out = start.clone()
        gemm(x, w, out=out, acc_in=out_mode == "acc_in", config=cfg)
        outs[str(cfg)] = out
    ref_name, ref = next(iter(outs.items()))
    differing = {k: first_difference(v, ref) for k, v in outs.items() if first_difference(v, ref) != "identical"}
    assert not differing, f"vs {ref_name}: {differing}"
    # a reduction split at multiples of 64 columns and carried through memory == one call
    whole = gemm(x, w, out_dtype=torch.float32)
    acc = torch.zeros(300, 520, device="cuda")
    for k0, k1 in ((0, 64), (64, 576), (576, 1024)):
        gemm(x[:, k0:k1], w[k0:k1], out=acc, acc_in=True)
    assert_bitwise_equal(acc, whole, "K split across acc_in calls")


def test_bf16_configs_use_the_documented_instruction(triton_backend):
    """Every tile config of 64 or more rows compiles to Hopper's wgmma and no mma.sync; the 16/32-row decode tiles
    (gemm.SMALL_M_TILES) to mma.sync m16n8k16 and no wgmma -- the two families whose bits docs/design/tile-shapes.md records as
    equal (rule 2); a third would be unmeasured."""
    from rlalign.ops.triton_backend.gemm import all_configs, gemm, gemm_kernel
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma is Hopper's")
    x, w = rand(130, 256, seed=6), rand(200, 256, seed=7)
    for segments in (1, 8):
        for cfg in all_configs(segments, False):
            gemm(x, w, b_trans=True, segments=segments, config=cfg)
    compiled = _compiled_kernels(gemm_kernel)
    assert compiled, "found no compiled gemm_kernel variants to inspect"
    bm_arg = (gemm_kernel.arg_names.index("BM"),)
    wrong, rows_seen = [], set()
    for kern in compiled:
        bm = kern.src.constants[bm_arg]
        rows_seen.add(bm)
        ptx = kern.asm["ptx"]
        want, other = ("wgmma.mma_async", "mma.sync") if bm >= 64 else ("mma.sync.aligned.m16n8k16", "wgmma")
        if want not in ptx or other in ptx:
            wrong.append(f"BM={bm}: {want} {'missing' if want not in ptx else 'present'}, {other} "
                         f"{'present' if other in ptx else 'absent'}")
    assert not wrong, f"{len(wrong)} of {len(compiled)} GEMM variants: " + "; ".join(wrong)
    assert {16, 64, 128} <= rows_seen, f"tile heights compiled: {sorted(rows_seen)}"


def _compiled_kernels(kernel):
    """Compiled variants of a @triton.jit function (Triton 3.x keeps them per device)."""
    cache = getattr(kernel, "device_caches", None)
    out = []
    if cache:
        for dev_cache in cache.values():
            kernels = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            out += list(kernels.values())
    return out


def test_k_segments_equal_tree_of_segment_partials(triton_backend):
    """linear(k_segments=8) == the 8 segment GEMMs (fp32 out, each from zero) merged by the tree."""
    from rlalign.ops.triton_backend.gemm import gemm
    x, w = rand(70, 1024, seed=11), rand(256, 1024, seed=12)
    seg = 1024 // 8
    parts = [gemm(x[:, i * seg:(i + 1) * seg], w[:, i * seg:(i + 1) * seg], b_trans=True, out_dtype=torch.float32)
             for i in range(8)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    assert_bitwise_equal(ops.linear(x, w, k_segments=8), parts[0].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [64, 192, 384])
def test_tiny_k_segments_tree_and_batch_invariance(triton_backend, dtype, k):
    """Tiny-model shapes: segments of 8..48 columns (one masked k-step each, the pointer path) give
    the tree of per-segment partials, and a row's bits do not depend on M (1..600)."""
    from rlalign.ops.triton_backend.gemm import gemm
    x, w = rand(600, k, dtype=dtype, seed=40), rand(256, k, dtype=dtype, seed=41)
    seg = k // 8
    parts = [gemm(x[:, i * seg:(i + 1) * seg], w[:, i * seg:(i + 1) * seg], b_trans=True, out_dtype=torch.float32)
             for i in range(8)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    full = ops.linear(x, w, k_segments=8)
    assert_bitwise_equal(full, parts[0].to(dtype), f"K={k}: tree of segment partials")
    for m in (1, 63, 64, 65, 200):
        assert_bitwise_equal(ops.linear(x[:m], w, k_segments=8), full[:m], f"K={k}: M={m} vs M=600")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_partition_gives_tp1_bits(triton_backend, tp):
    """Each rank reduces its subtree from fp32 copies of its bf16 shard (bf16x3 with exact-zero low
    parts == the bf16 path); merging rank partials by the top of the tree gives the TP=1 bits."""
    k = 4096
    x, w = rand(33, k, seed=13), rand(512, k, seed=14)
    full = ops.linear(x, w, k_segments=spec.K_SEGMENTS)
    shard = k // tp
    parts = [ops.linear(x[:, r * shard:(r + 1) * shard].float(), w[:, r * shard:(r + 1) * shard].float(),
                        k_segments=spec.K_SEGMENTS // tp) for r in range(tp)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    assert_bitwise_equal(parts[0].to(torch.bfloat16), full, f"TP={tp}")


def test_tma_launches_from_a_thread_without_a_cuda_context(triton_backend):
    """The first CUDA call of a thread can be one of our TMA launches (autograd's backward worker: an H200 run of
    2026-12-03 failed test_backward_rows_invariant_and_deterministic with "Failed to create tensor map descriptor: invalid
    device context"): a fresh thread runs the forward and the dX GEMM first thing and gets the main thread's bits."""
    import threading
    from rlalign.ops.triton_backend.gemm import gemm
    w, x, g = rand(1024, 512, seed=15), rand(600, 512, seed=16), rand(600, 1024, seed=17)
    want = (ops.linear(x, w, k_segments=8), gemm(g, w, out_dtype=torch.bfloat16))
    got, errors = [], []

    def first_cuda_calls():
        try:
            got.extend((ops.linear(x, w, k_segments=8), gemm(g, w, out_dtype=torch.bfloat16)))
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(repr(exc)[:600])

    thread = threading.Thread(target=first_cuda_calls)
    thread.start()
    thread.join()
    assert not errors, errors[0]
    for name, a, b in zip(("forward", "dX"), got, want):
        assert_bitwise_equal(a, b, name)


def test_backward_rows_invariant_and_deterministic(triton_backend):
    w = rand(1024, 512, seed=15).requires_grad_()
    x = rand(600, 512, seed=16).requires_grad_()
    g = rand(600, 1024, seed=17)
    runs = []
    for _ in range(2):
        x.grad = w.grad = None
        ops.linear(x, w, k_segments=8).backward(g)
        runs.append((x.grad.clone(), w.grad.clone()))
    for a, b in zip(*runs):
        assert_bitwise_equal(a, b, "backward run to run")
    for m in (1, 64, 65):
        xs = x.detach()[:m].clone().requires_grad_()
        ops.linear(xs, w, k_segments=8).backward(g[:m])
        assert_bitwise_equal(xs.grad, runs[0][0][:m], f"dX rows of M={m} vs M=600")


def test_bias_grad_deterministic(triton_backend):
    w, b = rand(96, 128, seed=18).requires_grad_(), rand(96, seed=19).requires_grad_()
    x = rand(1000, 128, seed=20)
    grads = []
    for _ in range(2):
        b.grad = None
        ops.linear(x, w, b).float().pow(2).sum().backward()
        grads.append(b.grad.clone())
    assert_bitwise_equal(grads[0], grads[1])


def _bias_launches(segments: int, m: int, k: int):
    """(name, context, ws) for every GEMM launch family that can take this call: the dispatcher's choice, the
    Triton kernel alone, and each Gluon launch the dispatcher uses where the Gluon kernel supports the shape."""
    import contextlib
    from rlalign.ops.triton_backend.gemm_ws import DEFAULT_WS, NARROW_WS, SMALL_GRID_WS, supported, triton_kernel_only
    yield "dispatcher", contextlib.nullcontext(), None
    yield "Triton kernel", triton_kernel_only(), None
    probe_a, probe_b = rand(m, k, seed=0), rand(200, k, seed=1)
    if supported(probe_a, probe_b, True, segments, out_dtype=torch.float32, bias=rand(200, seed=2)):
        yield "Gluon 128x128", contextlib.nullcontext(), DEFAULT_WS
        yield "Gluon 64x128", contextlib.nullcontext(), SMALL_GRID_WS
        yield "Gluon 64x64", contextlib.nullcontext(), NARROW_WS


@pytest.mark.parametrize("segments", [1, 2, 4, 8])
def test_bias_is_added_after_the_whole_sum(triton_backend, segments):
    """The documented order: the K sum (P segments merged by the tree) in fp32, then + bias[n] in fp32, then one
    rounding. So with an fp32 output, gemm(bias) == gemm() + bias bit for bit, and the bf16 output is that rounded
    once -- for every launch family, one k-step per segment (where a folded loop once let Triton's combine pass put
    the bias into the accumulator first: gemm.KSTEP_UNSPECIALIZED), several, and a K that ends inside a step."""
    from rlalign.ops.triton_backend.gemm import gemm
    bad = []
    for k in (segments * 64, segments * 192, segments * 40):   # one step a segment, three, one ending inside a step
        for m in (1, 65, 462):
            x, w, bias = rand(m, k, seed=m + k), rand(200, k, seed=m + k + 1), rand(200, seed=m + k + 2)
            for name, ctx, ws in _bias_launches(segments, m, k):
                with ctx:
                    summed = gemm(x, w, b_trans=True, segments=segments, out_dtype=torch.float32, ws=ws)
                    biased = gemm(x, w, b_trans=True, segments=segments, bias=bias, out_dtype=torch.float32, ws=ws)
                    rounded = gemm(x, w, b_trans=True, segments=segments, bias=bias, out_dtype=torch.bfloat16, ws=ws)
                expected = summed + bias.float()
                for what, out, ref in (("fp32 out", biased, expected), ("bf16 out", rounded, expected.to(torch.bfloat16))):
                    if not bits_equal(out, ref):
                        bad.append(f"{name} M={m} K={k} P={segments} {what}: {first_difference(out, ref)}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 4e-3), (torch.float32, 2e-5)])
@pytest.mark.parametrize("k_segments", [None, 8])
def test_accuracy_vs_float64(triton_backend, dtype, tol, k_segments):
    x, w, b = rand(300, 1024, dtype=dtype, seed=21), rand(520, 1024, dtype=dtype, seed=22), rand(520, dtype=dtype, seed=23)
    out = ops.linear(x, w, b, k_segments=k_segments)
    ref = x.double() @ w.double().T + b.double()
    err = rel_err(out, ref)
    assert err < tol, f"rel err {err:.3g}"


def test_backward_accuracy_vs_float64(triton_backend):
    x = rand(300, 256, seed=24).requires_grad_()
    w = rand(384, 256, seed=25).requires_grad_()
    g = rand(300, 384, seed=26)
    ops.linear(x, w).backward(g)
    xd, wd = x.detach().double(), w.detach().double()
    assert rel_err(x.grad, g.double() @ wd) < 4e-3
    assert rel_err(w.grad, g.double().T @ xd) < 4e-3


def test_unaligned_shapes_take_the_pointer_path(triton_backend):
    """K and N not multiples of 8 (no TMA): still correct and batch invariant."""
    x, w = rand(200, 100, seed=27), rand(77, 100, seed=28)
    full = ops.linear(x, w)
    assert rel_err(full, x.double() @ w.double().T) < 4e-3
    assert_bitwise_equal(ops.linear(x[7:8], w), full[7:8])
    view = rand(50, 101, seed=29)[:, 1:]   # a misaligned view
    assert_bitwise_equal(ops.linear(view[3:4], w), ops.linear(view, w)[3:4])
