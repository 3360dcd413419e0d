"""CUDA: the MoE experts' grouped GEMMs (rlalign.ops.triton_backend.grouped) on the Triton backend.

- the grouped FFN has the bits of the per-expert loop of strict linears (forward, dX, dW), bf16 and fp32,
  with idle experts, one-row experts and experts holding thousands of rows;
- a token's expert output does not depend on the expert's load: alone vs 4,000 tokens on the same expert;
- accuracy against float64;
- ops.moe_experts can be captured in a CUDA graph (no host sync) and replayed with other routings;
- the dispatch kernel (rlalign.ops.triton_backend.dispatch) gives torch.sort's order, its inverse, the offsets
  and the row-tile tables exactly, and ops.moe_experts through it has the torch.sort path's bits (y, dx, dW).
"""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from rlalign.contract import spec
from rlalign.ops import capturing_graph
from rlalign.ops.moe import expert_ffn_loop, sorted_experts
from tests.bitwise import assert_bitwise_equal
from tests.cuda.conftest import rand, rel_err

pytestmark = pytest.mark.cuda


def _experts(n_experts, hidden, inter, dtype, seed=0):
    gate = [rand(inter, hidden, dtype=dtype, seed=seed + 3 * e, scale=0.06) for e in range(n_experts)]
    up = [rand(inter, hidden, dtype=dtype, seed=seed + 3 * e + 1, scale=0.06) for e in range(n_experts)]
    down = [rand(hidden, inter, dtype=dtype, seed=seed + 3 * e + 2, scale=0.09) for e in range(n_experts)]
    return gate, up, down


def _sorted_rows(counts, hidden, dtype, seed=1):
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts), device="cuda"),
                                            torch.tensor(counts, device="cuda"))
    return rand(sum(counts), hidden, dtype=dtype, seed=seed), expert_of_row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden,inter", [(256, 128), (512, 96), (2048, 768)])
def test_grouped_ffn_equals_per_expert_loop(triton_backend, dtype, hidden, inter):
    counts = [0, 1, 3000, 0, 65, 128, 2, 700]
    gate, up, down = _experts(len(counts), hidden, inter, dtype)
    rows, e_of_row = _sorted_rows(counts, hidden, dtype)
    for segments in (None, spec.MOE_K_SEGMENTS, spec.K_SEGMENTS):
        grouped = triton_backend.moe.expert_ffn(rows, e_of_row, gate, up, down, segments)
        loop = expert_ffn_loop(rows, e_of_row, gate, up, down, segments)
        assert_bitwise_equal(grouped, loop, f"forward, down_segments={segments}")


def _tile_case():
    from rlalign.ops.triton_backend import grouped as G
    counts, k, n = [0, 1, 700, 65, 128, 3000], 768, 512
    x, e_of_row = _sorted_rows(counts, k, torch.bfloat16)
    ws = [rand(n, k, seed=40 + e, scale=0.05) for e in range(len(counts))]
    return G, x, ws, G.expert_offsets(e_of_row, len(counts)), n


# One case per (segments, tile): every case compiles its own kernels (~5-10 s each on the H200), so the
# matrix is spread over test cases instead of one test that outlives the per-test time limit.
_TILES = [(128, 128, 8, 3, False), (64, 256, 4, 3, False), (128, 64, 8, 4, False), (128, 256, 8, 3, False),
          (128, 128, 4, 3, False), (64, 64, 4, 4, True), (128, 64, 8, 4, True)]


@pytest.mark.parametrize("tile", _TILES, ids=lambda t: "x".join(map(str, t[:4])) + ("-nested" if t[4] else ""))
@pytest.mark.parametrize("segments", [1, 4, 8])
def test_every_grouped_tile_and_structure_gives_the_same_bits(triton_backend, segments, tile):
    G, x, ws, offsets, _ = _tile_case()
    ref = G.grouped_rows(x, offsets, ws, segments=segments, config=G.GroupedConfig(64, 64, 4, 4))
    cfg = G.GroupedConfig(*tile[:4], nested=tile[4])
    for tma in (True, False):
        out = G.grouped_rows(x, offsets, ws, segments=segments, config=cfg, use_tma=tma)
        assert_bitwise_equal(out, ref, f"segments={segments} {cfg} tma={tma}")


@pytest.mark.parametrize("tile", [(128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 4, 3)], ids=lambda t: "x".join(map(str, t)))
def test_every_grouped_dx_tile_gives_the_same_bits(triton_backend, tile):
    """dX's form (W_e untransposed: [K, N] = [512, 768] here) on the forward's tiles."""
    G, x, ws, offsets, n = _tile_case()
    g = rand(x.shape[0], n, seed=77)
    ref = G.grouped_rows(g, offsets, ws, transpose_w=False, config=G.GroupedConfig(64, 64, 4, 4))
    cfg = G.GroupedConfig(*tile)
    assert_bitwise_equal(G.grouped_rows(g, offsets, ws, transpose_w=False, config=cfg), ref, f"dX form {cfg}")


def test_every_grouped_weight_grad_tile_gives_the_same_bits(triton_backend):
    from rlalign.ops.triton_backend import grouped as G
    counts, k, n = [0, 1, 700, 65, 128, 3000], 768, 512
    x, e_of_row = _sorted_rows(counts, k, torch.bfloat16)
    g = rand(x.shape[0], n, seed=78)
    offsets = G.expert_offsets(e_of_row, len(counts))
    ref = G.grouped_weight_grad(g, x, offsets, len(counts), torch.bfloat16, config=G.GroupedConfig(64, 64, 4, 4))
    for cfg in (G.GroupedConfig(64, 128, 4, 4), G.GroupedConfig(128, 128, 8, 3), G.GroupedConfig(128, 256, 8, 3),
                G.GroupedConfig(64, 256, 4, 3), G.GroupedConfig(128, 128, 4, 3)):
        out = G.grouped_weight_grad(g, x, offsets, len(counts), torch.bfloat16, config=cfg)
        assert_bitwise_equal(out, ref, f"dW {cfg}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_grouped_ffn_gradients_equal_per_expert_loop(triton_backend, dtype):
    hidden, inter, counts = 256, 192, [5, 0, 1, 900, 64, 63]
    weights = [w.requires_grad_() for w in sum(_experts(len(counts), hidden, inter, dtype), [])]
    rows, e_of_row = _sorted_rows(counts, hidden, dtype)
    grad_out = rand(rows.shape[0], hidden, dtype=dtype, seed=9)
    grads = []
    for fn in (triton_backend.moe.expert_ffn, expert_ffn_loop):
        x = rows.clone().requires_grad_()
        n = len(counts)
        out = fn(x, e_of_row, weights[:n], weights[n:2 * n], weights[2 * n:], spec.MOE_K_SEGMENTS)
        grads.append(torch.autograd.grad(out, [x] + weights, grad_out, allow_unused=True))
    for i, (g, l) in enumerate(zip(*grads)):
        if l is None:          # an idle expert: the loop never touched it, the grouped dW is zero
            assert g is None or not bool(g.any()), f"gradient {i}: idle expert has a non-zero gradient"
            continue
        assert_bitwise_equal(g, l, f"gradient {i} ({'x' if i == 0 else 'weight'})")


@pytest.mark.parametrize("strided", [False, True], ids=["stacked", "fused-gate-up-views"])
def test_stacked_weights_grouped_equals_per_expert_loop_one_gradient_each(triton_backend, strided):
    """The model's layout: stacked [E, ...] weights (or gate/up as views of a fused [E, 2I, H] tensor, the
    transformers patch) through the grouped FFN equal the per-expert loop on the same stacked tensors, forward
    and every gradient; each stacked weight's gradient is one [E, ...] tensor, zeros at an idle expert."""
    hidden, inter, counts = 256, 192, [5, 0, 1, 900, 64, 63]
    gate, up, down = (torch.stack(ws) for ws in _experts(len(counts), hidden, inter, torch.bfloat16))
    rows, e_of_row = _sorted_rows(counts, hidden, torch.bfloat16)
    grad_out = rand(rows.shape[0], hidden, seed=9)
    results = []
    for fn in (triton_backend.moe.expert_ffn, expert_ffn_loop):
        fused = torch.cat([gate, up], dim=1).requires_grad_()
        down_w = down.clone().requires_grad_()
        gate_w, up_w = ((fused[:, :inter], fused[:, inter:]) if strided
                        else (gate.clone().requires_grad_(), up.clone().requires_grad_()))
        leaves = [fused, down_w] if strided else [gate_w, up_w, down_w]
        x = rows.clone().requires_grad_()
        out = fn(x, e_of_row, gate_w, up_w, down_w, spec.MOE_K_SEGMENTS)
        results.append((out, torch.autograd.grad(out, [x] + leaves, grad_out)))
    (out_g, grads_g), (out_l, grads_l) = results
    assert_bitwise_equal(out_g, out_l, "forward")
    for i, (g, l) in enumerate(zip(grads_g, grads_l)):
        assert_bitwise_equal(g, l, f"gradient {i}")
    assert not bool(grads_g[-1][1].any()), "idle expert 1's down_proj gradient slice is not zero"


def test_expert_output_does_not_depend_on_its_load(triton_backend):
    hidden, inter, n_experts = 512, 256, 8
    gate, up, down = _experts(n_experts, hidden, inter, torch.bfloat16)
    x = rand(4000, hidden, seed=4)
    crowded = torch.full((4000, 2), 3, device="cuda")
    crowded[:, 1] = 5
    full = ops.moe_experts(x, crowded, gate, up, down, down_segments=spec.MOE_K_SEGMENTS)
    for i in (0, 1777, 3999):
        one = ops.moe_experts(x[i:i + 1], crowded[i:i + 1], gate, up, down, down_segments=spec.MOE_K_SEGMENTS)
        assert_bitwise_equal(one, full[i:i + 1], f"token {i} alone vs 4,000 tokens on experts 3 and 5")
    spread = torch.stack([torch.arange(4000, device="cuda") % n_experts, torch.full((4000,), 5, device="cuda")], 1)
    mixed = ops.moe_experts(x, spread, gate, up, down, down_segments=spec.MOE_K_SEGMENTS)
    rows = spread[:, 0] == 3
    assert_bitwise_equal(mixed[rows, 0], full[rows, 0], "expert 3's rows under a spread routing")


def test_grouped_ffn_accuracy_against_float64(triton_backend):
    hidden, inter, counts = 512, 384, [40, 0, 300, 7]
    gate, up, down = _experts(len(counts), hidden, inter, torch.float32)
    rows, e_of_row = _sorted_rows(counts, hidden, torch.float32)
    out = triton_backend.moe.expert_ffn(rows, e_of_row, gate, up, down, spec.MOE_K_SEGMENTS)
    ref = []
    for e in range(len(counts)):
        r = rows[e_of_row == e].double()
        h = torch.nn.functional.silu(r @ gate[e].double().T) * (r @ up[e].double().T)
        ref.append(h @ down[e].double().T)
    assert rel_err(out, torch.cat(ref)) < 2e-5


def test_moe_experts_capture_in_a_cuda_graph(triton_backend):
    hidden, inter, n_experts, tokens, k = 256, 128, 16, 64, 4
    gate, up, down = _experts(n_experts, hidden, inter, torch.bfloat16)
    x = rand(tokens, hidden, seed=2)
    experts = torch.stack([torch.randperm(n_experts, device="cuda")[:k] for _ in range(tokens)])
    ops.moe_experts(x, experts, gate, up, down, down_segments=spec.MOE_K_SEGMENTS)   # warm-up (compiles, tables)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), capturing_graph():
        ops.moe_experts(x, experts, gate, up, down, down_segments=spec.MOE_K_SEGMENTS)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            static_out = ops.moe_experts(x, experts, gate, up, down, down_segments=spec.MOE_K_SEGMENTS)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):   # new routings, one expert crowded in the last
        g = torch.Generator(device="cuda").manual_seed(seed)
        new = torch.stack([torch.randperm(n_experts, device="cuda", generator=g)[:k] for _ in range(tokens)])
        if seed == 2:
            new[:, 0] = 7
            new[:, 1:] = torch.where(new[:, 1:] == 7, 0, new[:, 1:])
        experts.copy_(new)
        graph.replay()
        eager = ops.moe_experts(x, experts, gate, up, down, down_segments=spec.MOE_K_SEGMENTS)
        assert_bitwise_equal(static_out, eager, f"graph replay with routing {seed}")


def test_out_of_range_expert_id_raises_at_the_next_sync_point(triton_backend):
    from rlalign.contract.errors import ContractError
    from rlalign.ops import flush_deferred_checks
    gate, up, down = _experts(4, 128, 64, torch.bfloat16)
    x = rand(8, 128, seed=3)
    bad = torch.tensor([[0, 1]] * 7 + [[2, 4]], device="cuda")
    flush_deferred_checks()
    ops.moe_experts(x, bad, gate, up, down)          # no host sync here; rows of id 4 are never computed
    with pytest.raises(ContractError, match=r"expert id is outside \[0, 4\)"):
        flush_deferred_checks()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_combine_kernel_equals_torch_formulation(triton_backend, dtype):
    """The Triton combine (one pass, no fma) against the torch backend's separate multiply/add kernels on the
    same GPU: forward and dy bit for bit, dw deterministic and within fp32 rounding (its sum order is the kernel's)."""
    from rlalign.ops.torch_backend.moe import combine as torch_combine
    from rlalign.ops.triton_backend.combine import combine
    tokens, k, hidden, n_experts = 1000, 8, 2048 + 40, 128
    g = torch.Generator(device="cuda").manual_seed(11)
    y = rand(tokens, k, hidden, dtype=dtype, seed=12).requires_grad_()
    w = torch.rand(tokens, k, device="cuda", generator=g).requires_grad_()
    experts = torch.argsort(torch.rand(tokens, n_experts, device="cuda", generator=g), dim=1)[:, :k]
    gout = rand(tokens, hidden, dtype=dtype, seed=13)
    out = combine(y, w, experts)
    ref = torch_combine(y, w, experts)
    assert_bitwise_equal(out, ref, "combine forward")
    dy, dw = torch.autograd.grad(out, [y, w], gout)
    ref_dy, ref_dw = torch.autograd.grad(ref, [y, w], gout)
    assert_bitwise_equal(dy, ref_dy, "combine dy")
    dy2, dw2 = torch.autograd.grad(combine(y, w, experts), [y, w], gout)
    assert_bitwise_equal(dw2, dw, "combine dw run to run")
    assert rel_err(dw, ref_dw) < 1e-5
    one = combine(y[417:418], w[417:418], experts[417:418])
    assert_bitwise_equal(one, out[417:418], "one token alone vs 1,000")


@pytest.mark.parametrize("n_experts,k,normalize", [(128, 8, True), (64, 4, False), (2, 1, True)])
def test_route_kernel_equals_torch_formulation(triton_backend, n_experts, k, normalize):
    """The one-launch routing kernel against the torch formulation on the same GPU: experts and weights bit
    for bit (libdevice expf is torch's exp), ties to the lower expert, the router gradient identical, a token
    alone == the token among 5,000."""
    from rlalign.ops.torch_backend.moe import route as torch_route
    from rlalign.ops.triton_backend.route import route
    logits = rand(5000, n_experts, dtype=torch.float32, seed=21, scale=2.0)
    logits[7, 0] = logits[7, 1] = logits[7].max() + 0.5          # equal top logits: expert 0 first
    logits.requires_grad_()
    experts, weights = route(logits, k, normalize)
    ref_e, ref_w = torch_route(logits, k, normalize)
    assert torch.equal(experts, ref_e), "experts differ from the torch formulation"
    assert int(experts[7, 0]) == 0
    assert_bitwise_equal(weights, ref_w, "routing weights")
    gw = rand(5000, k, dtype=torch.float32, seed=22)
    assert_bitwise_equal(torch.autograd.grad(weights, logits, gw)[0], torch.autograd.grad(ref_w, logits, gw)[0],
                         "router gradient")
    one_e, one_w = route(logits[4321:4322], k, normalize)
    assert torch.equal(one_e, experts[4321:4322])
    assert_bitwise_equal(one_w, weights[4321:4322], "one token alone vs 5,000")


def _int_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    diff = (got != want).nonzero()
    if not diff.numel():
        return ""
    i = int(diff[0, 0])
    return f"{diff.shape[0]} of {got.numel()} differ, first at index {i}: {int(got[i])} vs {int(want[i])}"


# Few compiled variants: the kernels specialise on the bucket width only (next power of two of E + 1).
@pytest.mark.parametrize("tokens,k,n_experts,load", [(4096, 8, 128, "router"), (1, 8, 128, "router"),
                                                      (3001, 2, 128, "one expert"), (777, 3, 8, "skewed")])
def test_dispatch_kernel_equals_torch_sort_and_the_tables(triton_backend, tokens, k, n_experts, load):
    from rlalign.ops.triton_backend import dispatch as D, grouped as G
    g = torch.Generator(device="cuda").manual_seed(tokens)
    if load == "router":
        ids = torch.topk(torch.rand(tokens, n_experts, device="cuda", generator=g), k, dim=-1).indices
    elif load == "one expert":
        ids = torch.full((tokens, k), 5, device="cuda")
    else:
        ids = torch.where(torch.rand(tokens, k, device="cuda", generator=g) < 0.7, n_experts - 1,
                          torch.randint(0, n_experts, (tokens, k), device="cuda", generator=g))
    heights = (64, 128)
    plan = D.dispatch(ids, n_experts, heights)
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device="cuda")
    offsets = G.expert_offsets(flat.index_select(0, order), n_experts)
    for name, got, want in (("order", plan.order, order), ("token", plan.token, order // k),
                            ("inverse", plan.inverse, inverse), ("offsets", plan.offsets, offsets)):
        assert not _int_mismatch(got, want), f"{name}: {_int_mismatch(got, want)}"
    assert bool(plan.ok)
    for height in heights:
        want = G._slots(offsets, flat.numel(), height)
        assert plan.slots[height][3] == want[3]
        for name, got, ref in zip(("expert", "row", "end"), plan.slots[height][:3], want[:3]):
            assert not _int_mismatch(got, ref), f"height {height} slot {name}: {_int_mismatch(got, ref)}"
    bad = ids.clone()
    bad[tokens // 2, k - 1] = n_experts
    assert not bool(D.dispatch(bad, n_experts, heights).ok), "an out-of-range id passed the dispatch's verdict"


@pytest.mark.parametrize("tokens", [1, 1000])
def test_moe_experts_dispatch_has_the_sort_paths_bits(triton_backend, tokens):
    """ops.moe_experts (dispatch kernel, one gather) against the torch.sort path over the same grouped FFN
    (sorted_experts): y, dx and each stacked weight's gradient bit for bit."""
    hidden, inter, n_experts, k = 256, 128, 16, 4
    gate, up, down = (torch.stack(ws) for ws in _experts(n_experts, hidden, inter, torch.bfloat16, seed=5))
    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.topk(torch.rand(tokens, n_experts, device="cuda", generator=g), k, dim=-1).indices
    ids[: tokens // 3, 0] = 2                                          # one crowded expert
    x = rand(tokens, hidden, seed=6)
    grad_y = rand(tokens, k, hidden, seed=7)
    results = []
    for fn in (lambda *a: ops.moe_experts(*a, down_segments=spec.MOE_K_SEGMENTS),
               lambda *a: sorted_experts(*a, spec.MOE_K_SEGMENTS)):
        leaves = [t.clone().requires_grad_() for t in (x, gate, up, down)]
        y = fn(leaves[0], ids, *leaves[1:])
        results.append((y, torch.autograd.grad(y, leaves, grad_y)))
    (y, grads), (y_ref, grads_ref) = results
    assert_bitwise_equal(y, y_ref, "forward")
    for name, a, b in zip(("dx", "d gate", "d up", "d down"), grads, grads_ref):
        assert_bitwise_equal(a, b, name)
