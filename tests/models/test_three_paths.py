"""One forward, three batch descriptions: a token's hidden state, logprob and entropy are bitwise the
same in a packed training batch, a prefill into a paged KV cache and step-by-step decode, whatever
the batch composition and order, the prefill chunking and the page layout (strict profile)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.models import ForwardBatch, KVCache
from rlalign.models.batch import pages_needed
from rlalign.models.testing import tiny_model
from tests.bitwise import assert_bitwise_equal

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
FAMILIES = {
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16),
    "llama": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=32, rope_scaling=LLAMA3_ROPE),
    # layer 0 sparse (8 experts, top-2), layer 1 dense
    "qwen3_moe": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1]),
}
# the three paths also run these (not the LoRA / recompute tests, which reuse FAMILIES: MLA has no q/k/v_proj);
# deepseek_v3: MLA (expanded K, zero-padded V in the cache), layer 0 dense, layer 1 routed (4 groups, 2 kept) + shared
PATH_FAMILIES = {**FAMILIES, "deepseek_v3": dict(n_group=4, topk_group=2, num_experts_per_tok=3)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# 66 crosses the 64-position attention block boundary; 1 is a single-token sequence.
LENGTHS = (9, 66, 1, 23)


@pytest.fixture(scope="module", params=[(f, d) for f in PATH_FAMILIES for d in DTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def setup(request):
    family, dtype = request.param
    return make_setup(family, DTYPES[dtype], "cpu")


def make_setup(family, dtype, device, **overrides):
    """(model, sequences, packed reference hidden rows per sequence)."""
    model = tiny_model(family, seed=3, dtype=dtype, init_std=0.15, norm_jitter=0.2, device=device,
                       **{**PATH_FAMILIES[family], **overrides})
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]
    with torch.no_grad():
        ref = split(model.forward_hidden(ForwardBatch.packed(seqs, device)), [len(s) for s in seqs])
    return model, seqs, ref


def split(rows: torch.Tensor, lengths) -> list[torch.Tensor]:
    return list(torch.split(rows, list(lengths)))


def targets_of(seq, start, n) -> list[int]:
    """Next-token targets of positions start..start+n-1 (0 after the last token)."""
    return [seq[p + 1] if p + 1 < len(seq) else 0 for p in range(start, start + n)]


def lp_ent(model, rows, targets):
    return ops.logprob_entropy(rows, model.lm_head_weight, torch.tensor(targets, dtype=torch.int64, device=rows.device),
                               temperature=0.8)


def check_same(model, seqs, ref, got, what):
    """Hidden rows bitwise equal; logprob/entropy of the rows bitwise equal to the packed reference."""
    for i, (r, g) in enumerate(zip(ref, got)):
        assert_bitwise_equal(g, r, f"{what}: hidden of sequence {i}")
    targets = [t for s in seqs for t in targets_of(s, 0, len(s))]
    lp_r, ent_r = lp_ent(model, torch.cat(ref), targets)
    lp_g, ent_g = lp_ent(model, torch.cat(got), targets)
    assert_bitwise_equal(lp_g, lp_r, f"{what}: logprob")
    assert_bitwise_equal(ent_g, ent_r, f"{what}: entropy")


@torch.no_grad()
def run_schedule(model, seqs, steps, page_size, rng, spare_pages=3, mla_cache="latent", cache_out=None):
    """Feed ``seqs`` through a paged cache: each step is [(seq index, new tokens)], in batch order.
    Pages are a random permutation of the cache (plus spare pages never used). Returns per-sequence
    hidden rows, and per-sequence (logprob, entropy) computed step by step as an engine would.
    ``mla_cache``: KVCache.for_model's; ``cache_out``: a list that gets (the cache, the block tables)."""
    need = [pages_needed(len(s), page_size) for s in seqs]
    perm = list(range(sum(need) + spare_pages))
    rng.shuffle(perm)
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    cache = KVCache.for_model(model.config, len(perm), page_size, model.dtype, model.device, mla_cache=mla_cache)
    if cache_out is not None:
        cache_out.append((cache, tables))
    done = [0] * len(seqs)
    rows = [[] for _ in seqs]
    step_lp = [[] for _ in seqs]
    for step in steps:
        new = [seqs[i][done[i]:done[i] + n] for i, n in step]
        batch = ForwardBatch.extend(new, [done[i] for i, _ in step], cache, [tables[i] for i, _ in step])
        hidden = model.forward_hidden(batch)
        targets = [t for i, n in step for t in targets_of(seqs[i], done[i], n)]
        lp, ent = lp_ent(model, hidden, targets)
        cu = batch.cu_seqlens.tolist()
        for (i, n), a, b in zip(step, cu[:-1], cu[1:]):
            rows[i].append(hidden[a:b])
            step_lp[i].append((lp[a:b], ent[a:b]))
            done[i] += n
    assert done == [len(s) for s in seqs]
    return [torch.cat(r) for r in rows], step_lp


def random_schedule(seqs, rng, max_chunk=24) -> list[list[tuple[int, int]]]:
    """Random batch compositions and orders, chunk sizes 1..max_chunk (1 = a decode step)."""
    left = {i: len(s) for i, s in enumerate(seqs)}
    steps = []
    while left:
        active = sorted(left)
        chosen = rng.sample(active, rng.randint(1, len(active)))
        step = []
        for i in chosen:
            n = 1 if rng.random() < 0.4 else rng.randint(1, min(left[i], max_chunk))
            step.append((i, n))
            left[i] -= n
            if left[i] == 0:
                del left[i]
        steps.append(step)
    return steps


def decode_schedule(seqs, decode_tokens=6):
    """Prefill all but the last ``decode_tokens`` tokens together, then decode one token per step."""
    prompt = [max(1, len(s) - decode_tokens) for s in seqs]
    steps = [[(i, n) for i, n in enumerate(prompt)]]
    for k in range(max(len(s) for s in seqs)):
        step = [(i, 1) for i, s in enumerate(seqs) if prompt[i] + k < len(s)]
        if step:
            steps.append(step)
    return steps


def check_paged(model, seqs, ref, steps, page_size, rng, what, **schedule):
    got, step_lp = run_schedule(model, seqs, steps, page_size, rng, **schedule)
    check_same(model, seqs, ref, got, what)
    targets = [t for s in seqs for t in targets_of(s, 0, len(s))]
    lp_r, ent_r = lp_ent(model, torch.cat(ref), targets)
    lp_g = torch.cat([lp for per_seq in step_lp for lp, _ in per_seq])
    ent_g = torch.cat([ent for per_seq in step_lp for _, ent in per_seq])
    assert_bitwise_equal(lp_g, lp_r, f"{what}: logprob computed step by step")
    assert_bitwise_equal(ent_g, ent_r, f"{what}: entropy computed step by step")


@torch.no_grad()
def check_every_path(setup, label: str) -> None:
    """Packed compositions, one-shot prefill, prefill + decode and random schedules at page sizes 1 / 16 / 64 all give
    ``setup``'s packed reference bits (the device tiers run this on their own models)."""
    model, seqs, ref = setup
    test_packed_compositions(setup)
    check_paged(model, seqs, ref, [[(i, len(s)) for i, s in enumerate(seqs)]], 16, random.Random(0),
                f"{label} one-shot prefill")
    check_paged(model, seqs, ref, decode_schedule(seqs), 8, random.Random(1), f"{label} decode")
    for seed, page_size in [(3, 1), (4, 16), (5, 64)]:
        rng = random.Random(seed)
        check_paged(model, seqs, ref, random_schedule(seqs, rng), page_size, rng,
                    f"{label} random schedule (seed {seed}, page_size {page_size})")


def test_packed_compositions(setup):
    model, seqs, ref = setup
    dev = model.device
    alone = [model.forward_hidden(ForwardBatch.packed([s], dev)) for s in seqs]
    check_same(model, seqs, ref, alone, "each sequence alone")
    order = [2, 0, 3, 1]
    shuffled = split(model.forward_hidden(ForwardBatch.packed([seqs[i] for i in order], dev)),
                     [len(seqs[i]) for i in order])
    check_same(model, seqs, ref, [shuffled[order.index(i)] for i in range(len(seqs))], "reordered packing")
    other = [5, 7, 11, 13, 17]
    mixed = split(model.forward_hidden(ForwardBatch.packed([seqs[1], other, seqs[0], seqs[3], seqs[2]], dev)),
                  [len(seqs[1]), len(other), len(seqs[0]), len(seqs[3]), len(seqs[2])])
    check_same(model, seqs, ref, [mixed[2], mixed[0], mixed[4], mixed[3]], "packed with an extra sequence")


def test_prefill_whole(setup):
    model, seqs, ref = setup
    steps = [[(i, len(s)) for i, s in enumerate(seqs)]]
    check_paged(model, seqs, ref, steps, 16, random.Random(0), "one-shot prefill, page_size 16")


def test_decode(setup):
    model, seqs, ref = setup
    check_paged(model, seqs, ref, decode_schedule(seqs), 8, random.Random(1), "prefill then decode, page_size 8")


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), page_size=st.sampled_from([1, 3, 16, 64]))
def test_random_schedules(setup, seed, page_size):
    model, seqs, ref = setup
    rng = random.Random(seed)
    check_paged(model, seqs, ref, random_schedule(seqs, rng), page_size, rng,
                f"random schedule (seed {seed}, page_size {page_size})")


def test_model_logprobs_matches_ops(setup):
    """CausalLM.logprobs is forward_hidden + ops.logprob_entropy with the LM head."""
    model, seqs, ref = setup
    targets = torch.tensor([t for s in seqs for t in targets_of(s, 0, len(s))], dtype=torch.int64)
    with torch.no_grad():
        lp, ent = model.logprobs(ForwardBatch.packed(seqs, model.device), targets.to(model.device), temperature=0.8,
                                 with_entropy=True)
    lp_r, ent_r = lp_ent(model, torch.cat(ref), targets.tolist())
    assert_bitwise_equal(lp, lp_r, "model.logprobs")
    assert_bitwise_equal(ent, ent_r, "model.logprobs entropy")


@pytest.mark.parametrize("head_dim", [6, 10])
def test_narrow_heads_without_grouped_queries_agree_across_paths(head_dim):
    """A query's attention row sits at its token's row of the 16-row tile in the packed forward and at row 0 in
    decode; without grouped queries at these widths the library's p @ v GEMM is not row invariant on some
    machines (the op routes it: rlalign/ops/torch_backend/attention/gemms.py)."""
    model, seqs, ref = make_setup("qwen3", torch.float32, "cpu", num_attention_heads=4, num_key_value_heads=4,
                                  head_dim=head_dim)
    check_paged(model, seqs, ref, decode_schedule(seqs), 16, random.Random(head_dim), f"head_dim {head_dim}, decode")
    check_paged(model, seqs, ref, random_schedule(seqs, random.Random(head_dim)), 3, random.Random(1),
                f"head_dim {head_dim}, random chunks")
