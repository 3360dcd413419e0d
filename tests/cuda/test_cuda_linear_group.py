"""ops.linear_group on the Triton backend: stacked projections (q/k/v, gate/up) as one Gluon launch that writes
each projection to its own tensor, in raw bits against one ops.linear per weight.

Each test collects every failing case (shape, launch, first differing index and values) before it fails.
"""

from __future__ import annotations

import pytest
import torch

from rlalign.contract.bits import bits_equal, describe_difference
from tests.cuda.conftest import rand

pytestmark = pytest.mark.cuda

# (widths, K): 8B q/k/v and gate/up cut in K, the 0.6B q/k/v, two blocks of one tile column each, a last block
# that is not a whole number of tiles
SHAPES = (((4096, 1024, 1024), 1024), ((2048, 1024, 1024), 1024), ((1536, 1536), 512), ((128, 64, 200), 256),
          ((64, 64), 64))


def _stacked(widths, k, seed, bias):
    w = rand(sum(widths), k, seed=seed, scale=0.05)
    b = rand(sum(widths), seed=seed + 1) if bias else None
    cuts = [0]
    for x in widths:
        cuts.append(cuts[-1] + x)
    weights = [w[a:z] for a, z in zip(cuts, cuts[1:])]
    biases = [b[a:z] for a, z in zip(cuts, cuts[1:])] if bias else None
    return weights, biases


def test_gemm_ws_output_blocks_bits_equal(triton_backend):
    """gemm_ws with its output cut into 2-3 column blocks == one output, sliced: every launch the dispatcher takes,
    M around the decode window and a large M, with and without bias."""
    from rlalign.ops.triton_backend.gemm import gemm
    from rlalign.ops.triton_backend.gemm_ws import NARROW_WS, SMALL_GRID_WS, DEFAULT_WS, gemm_ws
    bad = []
    for cfg in (SMALL_GRID_WS, NARROW_WS, DEFAULT_WS):
        for widths, k in SHAPES:
            if any(x % cfg.block_n for x in widths[:-1]):
                continue
            for m in (1, 65, 244, 256, 1000):
                for bias in (False, True):
                    weights, biases = _stacked(widths, k, seed=m + k, bias=bias)
                    w = torch.cat(weights)
                    b = torch.cat(biases) if bias else None
                    x = rand(m, k, seed=m)
                    ref = gemm(x, w, b_trans=True, bias=b, ws=cfg)
                    outs = tuple(torch.empty((m, n), dtype=x.dtype, device=x.device) for n in widths)
                    gemm_ws(x, w, b_trans=True, segments=1, out=outs, bias=b, config=cfg)
                    start = 0
                    for i, (n, out) in enumerate(zip(widths, outs)):
                        if not bits_equal(out, ref[:, start:start + n]):
                            bad.append(f"{cfg} M={m} widths={widths} K={k} bias={bias} block {i}: "
                                       f"{describe_difference(out, ref[:, start:start + n])}")
                        start += n
    assert not bad, f"{len(bad)} cases differ:\n" + "\n".join(bad[:20])


def test_linear_group_bits_equal_separate_linears(triton_backend):
    """ops.linear_group(x, stacked weights) == ops.linear per weight, at every M class (below, inside and above the
    decode rows where the one launch is taken, and the empty batch), stacked or not, with and without bias; and the
    one launch is taken where the dispatcher runs the Gluon kernel (gemm census)."""
    from rlalign import ops
    from rlalign.ops import gemm_census
    from rlalign.ops.triton_backend.gemm import ws_default
    bad = []
    for widths, k in SHAPES + (((12288, 12288), 256), ):   # + gate/up at the 8B width: the Triton kernel's waves
        for m in (0, 1, 64, 65, 128, 244, 256, 257, 700):
            for bias in (False, True):
                weights, biases = _stacked(widths, k, seed=k + m, bias=bias)
                x = rand(m, k, seed=m + 7)
                for views in (False, True):
                    with torch.no_grad():
                        ref = [ops.linear(x, w, None if not bias else b) for w, b in zip(weights, biases or weights)]
                        with gemm_census.collecting() as census:
                            outs = ops.linear_group(x, weights, biases, views=views)
                        apart = ops.linear_group(x, [w.clone() for w in weights],
                                                 [b.clone() for b in biases] if bias else None, views=views)
                    what = f"M={m} widths={widths} K={k} bias={bias} views={views}"
                    for i, (o, a, r) in enumerate(zip(outs, apart, ref)):
                        if not (bits_equal(o, r) and bits_equal(a, r)):
                            bad.append(f"{what} output {i}: stacked {describe_difference(o, r)}; "
                                       f"apart {describe_difference(a, r)}")
                    # one launch: with views always; without, where the dispatcher takes the Gluon kernel for the
                    # stacked call and the blocks end on its tile columns
                    launch = ws_default(x, torch.cat(weights), True, 1, False, x.dtype, None, False) if m else None
                    blocks = launch is not None and all(n % launch.block_n == 0 for n in widths[:-1])
                    if m and (views or blocks) and len(census.calls) != 1:
                        bad.append(f"{what}: {len(census.calls)} launches, expected one ({census.calls[:3]})")
                    if m and not (views or blocks) and len(census.calls) != len(widths):
                        bad.append(f"{what}: {len(census.calls)} launches, expected one per weight")
    assert not bad, f"{len(bad)} cases fail:\n" + "\n".join(bad[:20])


def test_silu_mul_reads_strided_rows_in_place(triton_backend):
    """silu_mul of column views of one [M, 2I] tensor (linear_group's gate/up with views) == of contiguous copies."""
    from rlalign import ops
    bad = []
    for m, i in ((1, 64), (244, 12288), (300, 1000), (0, 128)):
        both = rand(m, 2 * i, seed=m + i)
        g, u = both[:, :i], both[:, i:]
        with torch.no_grad():
            out, ref = ops.silu_mul(g, u), ops.silu_mul(g.contiguous(), u.contiguous())
        if not (out.is_contiguous() and bits_equal(out, ref)):
            bad.append(f"M={m} I={i}: {describe_difference(out, ref)}")
    assert not bad, "\n".join(bad)


def test_decoder_forward_stacked_equals_unstacked(triton_backend):
    """A Qwen3 and a Qwen2 (q/k/v biases) decoder without grad at decode-size batches: the forward's hidden rows
    with the projections stacked (the default) == with every parameter in its own tensor."""
    from rlalign import ops
    from rlalign.models.batch import ForwardBatch
    from rlalign.models.testing import tiny_model
    bad = []
    for family in ("qwen3", "qwen2"):
        model = tiny_model(family, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64).cuda()
        attn = model.model.layers[0].self_attn
        assert ops.stacked_rows([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is not None
        apart = tiny_model(family, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64).cuda()
        with torch.no_grad():
            for p, q in zip(apart.parameters(), model.parameters()):
                p.data = q.detach().clone()
        for rows in (100, 244):
            g = torch.Generator().manual_seed(rows)
            tokens = [torch.randint(0, model.config.vocab_size, (1 + i % 3, ), generator=g).tolist()
                      for i in range(rows // 2)]
            with torch.no_grad():
                h = model.forward_hidden(ForwardBatch.packed(tokens, device="cuda"))
                r = apart.forward_hidden(ForwardBatch.packed(tokens, device="cuda"))
            if not bits_equal(h, r):
                bad.append(f"{family} {rows} rows: {describe_difference(h, r)}")
    assert not bad, "\n".join(bad)
