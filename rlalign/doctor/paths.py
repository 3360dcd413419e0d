"""The model's three paths on this machine: every row of a sequence -- its hidden state, the log-prob of the next
token and the entropy -- has the same bits in a packed training forward, a one-shot prefill into a paged KV cache,
and a chunked prefill followed by one-token decode steps (random chunk sizes, batch compositions and page
layouts), for each model family's feature set (q/k norm, qkv bias, llama3 rope, MoE) in fp32 and bf16.

The op checks test each op's invariances alone; this one tests that the decoder composes them into the contract on
this card and this build (a fused kernel on one path and two kernels on the other must agree too)."""

from __future__ import annotations

import random

import torch

from rlalign import ops
from rlalign.contract.bits import bits_equal, describe_difference
from rlalign.doctor.base import Check
from rlalign.models import ForwardBatch, KVCache
from rlalign.models.batch import pages_needed
from rlalign.models.testing import tiny_model

# Small configs that reach each feature of the decoder (head dims whose halves are not multiples of 16 included:
# a layout Triton vectorises differently from a contiguous row).
FAMILIES = {
    "qwen3 (q/k norm, head_dim 16)": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "qwen3 (q/k norm, head_dim 48)": ("qwen3", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=48)),
    "qwen2 (qkv bias, MQA)": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
    "llama (llama3 rope)": ("llama", dict(num_attention_heads=2, num_key_value_heads=2, head_dim=32, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32))),
    "qwen3_moe (8 experts, top-2)": ("qwen3_moe", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                                       norm_topk_prob=True, mlp_only_layers=[1])),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TEMPERATURE = 0.8


def check_three_paths(device: torch.device, gen: torch.Generator) -> tuple[bool, str]:
    """Every family x dtype of :data:`FAMILIES` / :data:`DTYPES`; the first violation, named, or what was checked."""
    seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=gen))
    for name, (family, overrides) in FAMILIES.items():
        for dname, dtype in DTYPES.items():
            problem = _check_family(family, overrides, dtype, device, random.Random(seed))
            if problem:
                return False, f"{name} {dname}: {problem}"
    return True, f"{len(FAMILIES)} families x {', '.join(DTYPES)}: packed == one-shot prefill == chunked prefill + decode"


@torch.no_grad()
def _check_family(family: str, overrides: dict, dtype, device, rng: random.Random) -> str | None:
    model = tiny_model(family, seed=rng.randrange(2 ** 31), dtype=dtype, init_std=0.15, norm_jitter=0.2,
                       device=device, **overrides)
    vocab = model.config.vocab_size
    # one single-token sequence and one that crosses the 64-key attention block
    lengths = [1, rng.randint(65, 90), rng.randint(2, 40), rng.randint(2, 40)]
    seqs = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    packed = list(torch.split(model.forward_hidden(ForwardBatch.packed(seqs, device)), lengths))
    reference = (packed, *_scores(model, torch.cat(packed), seqs, [(i, 0, n) for i, n in enumerate(lengths)]))
    one_shot = [[(i, n) for i, n in enumerate(lengths)]]
    for what, steps in (("one-shot prefill", one_shot), ("chunked prefill + decode", _chunked_schedule(lengths, rng))):
        problem = _compare(reference, _run_paged(model, seqs, steps, rng.choice((1, 3, 16)), rng), what)
        if problem:
            return problem
    return None


def _chunked_schedule(lengths: list[int], rng: random.Random) -> list[list[tuple[int, int]]]:
    """Steps of (sequence, new tokens): prefill chunks of 1..24 tokens, then one token per step, sequences joining
    and leaving in random order."""
    left = dict(enumerate(lengths))
    decode_from = {i: rng.randint(1, n) for i, n in left.items()}
    steps = []
    while left:
        step = []
        for i in rng.sample(sorted(left), rng.randint(1, len(left))):
            done = lengths[i] - left[i]
            n = 1 if done >= decode_from[i] else rng.randint(1, min(24, decode_from[i] - done))
            step.append((i, n))
            left[i] -= n
            if not left[i]:
                del left[i]
        steps.append(step)
    return steps


def _run_paged(model, seqs, steps, page_size: int, rng: random.Random):
    """Feed ``steps`` through a paged cache whose pages are a random permutation (plus spare pages): per sequence
    its hidden rows, and log-probs / entropies computed step by step as an engine would."""
    need = [pages_needed(len(s), page_size) for s in seqs]
    pages = list(range(sum(need) + 3))
    rng.shuffle(pages)
    tables = [pages[sum(need[:i]):sum(need[:i + 1])] for i in range(len(seqs))]
    cache = KVCache.for_model(model.config, len(pages), page_size, model.dtype, model.device)
    done = [0] * len(seqs)
    rows, lps, ents = ([[] for _ in seqs] for _ in range(3))
    for step in steps:
        batch = ForwardBatch.extend([seqs[i][done[i]:done[i] + n] for i, n in step], [done[i] for i, _ in step],
                                    cache, [tables[i] for i, _ in step])
        hidden = model.forward_hidden(batch)
        lp, ent = _scores(model, hidden, seqs, [(i, done[i], n) for i, n in step])
        at = 0
        for i, n in step:
            rows[i].append(hidden[at:at + n])
            lps[i].append(lp[at:at + n])
            ents[i].append(ent[at:at + n])
            done[i] += n
            at += n
    return [torch.cat(r) for r in rows], torch.cat([x for per in lps for x in per]), \
        torch.cat([x for per in ents for x in per])


def _scores(model, hidden, seqs, spans):
    """(log-prob of the next token, entropy) of the rows of ``spans`` = [(sequence, first position, rows)] at
    TEMPERATURE (target 0 after a sequence's last token)."""
    targets = [seqs[i][p + 1] if p + 1 < len(seqs[i]) else 0 for i, start, n in spans for p in range(start, start + n)]
    return ops.logprob_entropy(hidden, model.lm_head_weight, torch.tensor(targets, device=hidden.device),
                               temperature=TEMPERATURE)


def _compare(reference, got, what: str) -> str | None:
    (ref_rows, ref_lp, ref_ent), (rows, lp, ent) = reference, got
    for i, (r, g) in enumerate(zip(ref_rows, rows)):
        if not bits_equal(g, r):
            return f"{what}: hidden rows of sequence {i} differ from the packed forward ({describe_difference(g, r)})"
    if not bits_equal(lp, ref_lp):
        return f"{what}: log-probs differ from the packed forward's ({describe_difference(lp, ref_lp)})"
    if not bits_equal(ent, ref_ent):
        return f"{what}: entropies differ from the packed forward's ({describe_difference(ent, ref_ent)})"
    return None


CHECKS: tuple[Check, ...] = (
    Check("model", "packed == one-shot prefill == chunked prefill + decode, per family (fp32, bf16)",
          check_three_paths),
)
