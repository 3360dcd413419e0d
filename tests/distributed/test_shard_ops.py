"""Single-process checks of the shard-level op entries and the layouts parallelize relies on."""

import pytest
import torch

from rlalign import ops
from rlalign.contract import spec
from rlalign.contract.errors import ContractError, RLAlignError
from rlalign.distributed.collectives import tree_reduce
from rlalign.distributed.layers import MIN_SHARD_COLUMNS
from rlalign.distributed.parallelize import check_tp
from rlalign.distributed.vocab_head import VocabLayout
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.models.testing import tiny_hf_config
from rlalign.ops.shard import linear_partial, logprob_merge_stats, logprob_shard_stats
from rlalign.ops.torch_backend.primitives import tile_mm
from tests.bitwise import assert_bitwise_equal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_rank_subtrees_merge_to_the_full_linear(dtype, tp):
    gen = torch.Generator().manual_seed(tp)
    x = torch.randn(70, 128, generator=gen).to(dtype)
    w = torch.randn(48, 128, generator=gen).to(dtype)
    k = 128 // tp
    parts = [linear_partial(x[:, r * k:(r + 1) * k], w[:, r * k:(r + 1) * k], 8 // tp) for r in range(tp)]
    assert all(p.dtype == torch.float32 for p in parts)
    assert_bitwise_equal(tree_reduce(parts).to(dtype), ops.linear(x, w, k_segments=8), f"tp={tp}")


def test_linear_partial_fails_closed_on_a_bad_partition():
    x, w = torch.randn(4, 12), torch.randn(3, 12)
    with pytest.raises(ContractError, match="linear_partial.*segments must be 1, 2, 4 or 8"):
        linear_partial(x, w, 8)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vocab_shard_stats_merge_to_the_fused_op(temperature):
    gen = torch.Generator().manual_seed(1)
    vocab, tokens = 5000, 90
    hidden, weight = torch.randn(tokens, 32, generator=gen), torch.randn(vocab, 32, generator=gen)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    layout = VocabLayout.of(vocab)
    stats, z_target = [], torch.zeros(tokens)
    for r in range(4):
        a, b = layout.rank_range(r, 4)
        s, z = logprob_shard_stats(hidden, weight[a:b], targets, a, temperature, True)
        stats.append(s)
        mine = (targets >= a) & (targets < b)
        z_target = torch.where(mine, z, z_target)
    lp, ent, _, _ = logprob_merge_stats(torch.cat(stats, dim=1), z_target)
    ref_lp, ref_ent = ops.logprob_entropy(hidden, weight, targets, temperature=temperature)
    assert_bitwise_equal(lp, ref_lp, "logprob")
    assert_bitwise_equal(ent, ref_ent, "entropy")


@pytest.mark.parametrize("vocab", [1, 320, 1024, 1025, 5000, 151936])
def test_vocab_layout_is_contiguous_and_block_aligned(vocab):
    layout = VocabLayout.of(vocab)
    assert len(layout.segments) == spec.K_SEGMENTS
    assert layout.segments[0][0] == 0 and layout.segments[-1][1] == vocab
    for (a, b), (c, _) in zip(layout.segments, layout.segments[1:]):
        assert a <= b == c and a % spec.VOCAB_BLOCK == 0
    for tp in (1, 2, 4, 8):
        ranges = [layout.rank_range(r, tp) for r in range(tp)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(tp - 1))


@pytest.mark.parametrize("overrides, tp, message", [
    ({}, 3, "tp=3 is not supported"),
    ({"num_key_value_heads": 2}, 4, "num_key_value_heads=2"),
    ({"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8}, 8, "shards narrower than 16"),
])
def test_check_tp_names_the_problem(overrides, tp, message):
    config = ModelConfig.from_hf_dict(tiny_hf_config("qwen3", **overrides))
    with pytest.raises(RLAlignError, match=message):
        check_tp(config, tp, CausalLM(config, device="meta"))


def test_gemm_columns_do_not_depend_on_n_for_shards_of_min_width():
    """The column-parallel forward's assumption on this CPU: a column slice at least
    MIN_SHARD_COLUMNS wide computes the same bits as inside the full GEMM."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(64, 96, generator=gen), torch.randn(512, 96, generator=gen)
    full = tile_mm(x, w)
    for width in (MIN_SHARD_COLUMNS, 24, 32, 64, 128, 256):
        for offset in (0, 16, 64, 256):
            assert_bitwise_equal(tile_mm(x, w[offset:offset + width]), full[:, offset:offset + width],
                                 f"width {width} offset {offset}")
