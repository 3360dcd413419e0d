"""DeepSeek-V3's compressed latent KV cache (rlalign.models.latent_cache): it stores a token's latent row (kv_lora_rank
+ qk_rope_head_dim values per layer, not the expanded per-head K/V), re-expanding it at every paged call gives the
expanded cache's K/V bit for bit, and packed == prefill == chunked prefill + decode stay bitwise with it, over random
MLA shapes, sequence lengths, page sizes and schedules."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract import use_profile
from rlalign.contract.errors import ContractError
from rlalign.models import ForwardBatch, KVCache
from rlalign.models.deepseek_v3 import expand_kv
from rlalign.models.latent_cache import context_plan, latent_width
from rlalign.models.sizes import kv_bytes_per_token
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine
from rlalign.rollout.errors import RolloutConfigError
from tests.bitwise import assert_bitwise_equal
from tests.models.test_three_paths import check_paged, random_schedule, run_schedule, split

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mla_model(data, seed: int, dtype):
    """A random tiny DeepSeek-V3 (MLA shape, q_proj or low-rank q, plain or interleaved rope, dense or sparse)."""
    nope, rope = 2 * data.draw(st.integers(1, 6), label="nope/2"), data.draw(st.sampled_from([2, 4, 8]), label="rope")
    layers = data.draw(st.integers(1, 2), label="layers")
    return tiny_model("deepseek_v3", seed=seed, dtype=dtype, init_std=0.2, num_hidden_layers=layers,
                      first_k_dense_replace=data.draw(st.integers(0, layers), label="dense layers"),
                      num_attention_heads=data.draw(st.integers(1, 4), label="heads"),
                      num_key_value_heads=None, q_lora_rank=data.draw(st.sampled_from([None, 8]), label="q_lora"),
                      kv_lora_rank=data.draw(st.sampled_from([1, 4, 16]), label="kv_lora_rank"),
                      qk_nope_head_dim=nope, qk_rope_head_dim=rope, head_dim=rope,
                      v_head_dim=data.draw(st.integers(1, nope + rope), label="v_head_dim"),
                      rope_interleave=data.draw(st.booleans(), label="interleave"))


@settings(max_examples=15, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16), dtype=st.sampled_from(list(DTYPES)))
def test_latent_cache_keeps_packed_prefill_and_decode_bitwise(data, seed, dtype):
    """Random lengths (1 included, some across the 64-position attention block), schedules and page sizes: with the
    latent cache and with the expanded one, every token's hidden row, logprob and entropy are the packed forward's."""
    model = mla_model(data, seed, DTYPES[dtype])
    rng = random.Random(seed)
    lengths = data.draw(st.lists(st.integers(1, 80), min_size=1, max_size=4), label="lengths")
    seqs = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in lengths]
    with torch.no_grad():
        ref = split(model.forward_hidden(ForwardBatch.packed(seqs)), lengths)
    page_size = data.draw(st.sampled_from([1, 3, 16, 64]), label="page_size")
    steps = random_schedule(seqs, rng)
    for form in ("latent", "expanded"):
        check_paged(model, seqs, ref, steps, page_size, random.Random(seed), f"{form} cache, page_size {page_size}",
                    mla_cache=form)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_cache_holds_the_latent_and_it_re_expands_to_the_expanded_cache(dtype):
    """Per token and layer the cache holds kv_lora_rank + qk_rope_head_dim values (K/V zero-width), and expanding a
    cached latent row gives the K and padded V the expanded cache holds at the same slot, bit for bit."""
    model = tiny_model("deepseek_v3", seed=5, dtype=DTYPES[dtype], init_std=0.2, n_group=4, topk_group=2,
                       num_experts_per_tok=3)
    cfg, a = model.config, model.config.attention_options
    width = a["kv_lora_rank"] + a["qk_rope_head_dim"]
    assert latent_width(cfg) == width == 24
    elem = torch.empty((), dtype=model.dtype).element_size()
    cache = KVCache.for_model(cfg, 7, 5, model.dtype)
    assert sorted(cache.latent) == list(range(cfg.num_layers))
    stored = sum(t.numel() for t in cache.paged_tensors()) * elem
    assert stored == 7 * 5 * cfg.num_layers * width * elem == 7 * 5 * kv_bytes_per_token(cfg, elem)
    assert all(k.numel() == 0 and v.numel() == 0 for k, v in zip(cache.k, cache.v))
    expanded_values = 2 * cfg.num_heads * (a["qk_nope_head_dim"] + a["qk_rope_head_dim"])
    assert kv_bytes_per_token(cfg, elem, "expanded") == cfg.num_layers * expanded_values * elem

    rng = random.Random(0)
    seqs = [[rng.randrange(3, 300) for _ in range(n)] for n in (13, 1, 70)]
    caches = {}
    for form in ("latent", "expanded"):
        out = []
        run_schedule(model, seqs, random_schedule(seqs, random.Random(1)), 4, random.Random(2), mla_cache=form,
                     cache_out=out)
        caches[form] = out[0]
    (latent, tables), (expanded, same_tables) = caches["latent"], caches["expanded"]
    assert tables == same_tables
    slots = torch.tensor([page * 4 + p % 4 for seq, table in zip(seqs, tables) for p in range(len(seq))
                          for page in [table[p // 4]]])
    for layer, attn in enumerate(m.self_attn for m in model.model.layers):
        rows = latent.slot_values(layer, slots)
        assert rows.shape == (len(slots), width)
        with torch.no_grad():
            k, v = expand_kv(attn, rows[:, :a["kv_lora_rank"]], rows[:, a["kv_lora_rank"]:].view(-1, 1, attn.rope_dim))
        n = expanded.k[layer].shape[0] * expanded.k[layer].shape[1]
        assert_bitwise_equal(k, expanded.k[layer].view(n, *k.shape[1:])[slots], f"layer {layer}: K from the latent")
        assert_bitwise_equal(v, expanded.v[layer].view(n, *v.shape[1:])[slots], f"layer {layer}: V from the latent")


def test_context_plan_places_each_sequence_on_its_own_scratch_pages():
    """Earlier tokens (below each chunk start) are read from their cache slots and land, with the new tokens, on
    consecutive scratch pages per sequence in position order; stale slots past a context are never read."""
    model = tiny_model("deepseek_v3", seed=0)
    cache = KVCache.for_model(model.config, 12, 4, model.dtype)
    batch = ForwardBatch.extend([[7, 8], [9]], [5, 0], cache, [[9, 2], [4]])   # seq 0: 5 cached + 2 new; seq 1: 1 new
    plan = context_plan(batch)
    assert plan is context_plan(batch)   # built once per forward
    assert plan.num_pages == 3
    assert plan.block_table.tolist() == [[0, 1], [2, 0]]
    assert plan.cached_slots.tolist() == [36, 37, 38, 39, 8]          # page 9 (4 slots), then page 2 offset 0
    assert plan.cached_local.tolist() == [0, 1, 2, 3, 4]              # their scratch slots
    assert plan.new_local.tolist() == [5, 6, 8]                       # the new tokens' (positions 5, 6; 0)


def test_engine_mla_cache_setting():
    """RolloutConfig.mla_cache: the page size in bytes follows the form; a bad value is one line."""
    model = tiny_model("deepseek_v3", seed=0)
    latent = RolloutEngine(model, RolloutConfig(num_pages=4, page_size=8)).bytes_per_page
    expanded = RolloutEngine(model, RolloutConfig(num_pages=4, page_size=8, mla_cache="expanded")).bytes_per_page
    cfg = model.config
    assert latent == 8 * cfg.num_layers * latent_width(cfg) * 4
    assert expanded == 8 * cfg.num_layers * 2 * cfg.num_heads * cfg.head_dim * 4
    with pytest.raises(RolloutConfigError, match="mla_cache must be one of"):
        RolloutConfig(mla_cache="absorbed")


def test_a_non_finite_key_is_refused_before_its_latent_is_cached():
    """The new tokens' keys go through write_kv_cache's strict check (at the boundary policy, the only site before
    the attention): a NaN key raises and the latent cache stays as it was."""
    model = tiny_model("deepseek_v3", seed=0)
    with torch.no_grad():
        model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight[-1] = 3e38   # the last rotary column overflows
    cache = KVCache.for_model(model.config, 4, 4, model.dtype)
    with use_profile("strict"), ops.use_check_policy("boundary"), torch.no_grad():
        with pytest.raises(ContractError, match="write_kv_cache: k contains NaN or inf"):
            model.forward_hidden(ForwardBatch.prefill([[5, 6, 7]], cache, [[1]]))
    assert not cache.latent[0].any()
