"""Portable sampling: the strict sampler's rules (rlalign/ops/torch_backend/sample.py) with portable arithmetic.

The same counter-based keyed noise -- integer hashing (splitmix64) to u = (2 * (bits >>> 41) + 1) / 2^24, exact
in fp32 -- and the same order rules (greedy argmax, top-k of the order (z desc, id asc), top-p by exact integer
prefix sums of fp32 probabilities, min-p as a tighter top-k, Gumbel-max, ties to the lowest id); only the float
transforms change: g = -log(-log(u)) and the top-p / min-p probabilities use :mod:`.arith`'s exp and log, and
z = logits / fp32(T) is an IEEE division by a tensor. So a row's token is a pure function of its logits' bits and
its settings, on every device. Eager only (the portable profile captures no CUDA graph).
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import fail
from rlalign.ops import _checks as chk
from rlalign.ops.portable import arith
from rlalign.ops.torch_backend import sample as strict_sample

ROW_CHUNK_ELEMS = 1 << 20     # logits per row chunk (memory only)


def perturbed(z: torch.Tensor, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """z + g with g = -log(-log(u)), computed as z - log(-log(u)) in fp32 (arith.log)."""
    return z - arith.log(-arith.log(strict_sample.uniforms(keys, offsets)))


def scaled(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """z = logits / fp32(T) per row (greedy rows T = 0 divided by 1): IEEE division by a [S, 1] tensor."""
    return arith.div(logits, torch.where(temperature == 0, 1.0, temperature).unsqueeze(-1))


def min_p_top_k(logits, temperature, top_k, min_p) -> torch.Tensor:
    """ops.sample's min-p rule (a tighter top-k; greedy rows keep theirs) with the portable exp."""
    return torch.where(temperature == 0, top_k,
                       strict_sample.min_p_top_k(scaled(logits, temperature), top_k, min_p, exp=arith.exp))


def _sample_chunk(logits, keys, offsets, greedy, temperature, k, top_p, filtered):
    z = scaled(logits, temperature)
    strict_sample.overflow_verdict(z, False)
    score = perturbed(z, keys, offsets)
    if bool(filtered.any()):
        rows = filtered.nonzero().squeeze(1)
        keep = strict_sample.keep_mask(z[rows], k[rows], top_p[rows], exp=arith.exp)
        score[rows] = torch.where(keep, score[rows], float("-inf"))
    score = torch.where(greedy.unsqueeze(-1), logits, score)
    return torch.argmax(score, dim=-1)   # first (lowest) index among equal maxima


def sample(logits, seeds, seq_ids, positions, temperature, top_k, top_p):
    """ops.sample in the portable profile: logits fp32 [S, V]; per-row int64 / fp32 settings -> int64 [S]."""
    if chk.static_shapes():
        raise fail("sample", "the portable profile samples eagerly: no CUDA-graph capture or static decode")
    rows, vocab = logits.shape
    strict_sample.check_logit_values(logits, False)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    greedy = temperature == 0
    k = torch.where(top_k >= vocab, 0, top_k)
    filtered = ~greedy & ((k > 0) | (top_p < 1))
    keys = strict_sample.row_keys(seeds, seq_ids, positions)
    offsets = strict_sample.token_offsets(vocab, logits.device)
    step = max(1, ROW_CHUNK_ELEMS // vocab)
    for r in range(0, rows, step):
        sl = slice(r, r + step)
        out[sl] = _sample_chunk(logits[sl], keys[sl], offsets, greedy[sl], temperature[sl], k[sl], top_p[sl],
                                filtered[sl])
    return out
