"""Portable LM head: logits, token log-prob and entropy (forward only).

Per token, all fp32:

    z        = matmul_nt(h, W) [V]  (arith: products, tree over H), then / fp32(T) by IEEE division (T != 1)
    m        = max_v z + 0.0
    e_v      = exp(z_v - m)                     (arith.exp)
    s        = tree_sum_v(e)                    w = tree_sum_v(e * z)    (one tree over the whole vocab)
    lse      = m + log(s)                       (arith.log)
    logprob  = z[target] - lse                  entropy = lse - w / s

Tokens are processed in chunks (memory only): a token's values depend on its own row, W, its target and T.
"""

from __future__ import annotations

import torch

from rlalign.ops.portable import arith
from rlalign.reductions import tree_sum

# logits held at once per chunk of tokens (memory only)
CHUNK_ELEMS = {"cuda": 1 << 26}
DEFAULT_CHUNK_ELEMS = 1 << 22


def scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """z [S, V] fp32 = (hidden @ weight^T) / fp32(temperature), the division skipped at T == 1."""
    z = arith.matmul_nt(hidden.float(), weight.float())
    return z if float(temperature) == 1.0 else arith.div(z, float(temperature))


def _token_rows(hidden: torch.Tensor, vocab: int) -> int:
    budget = CHUNK_ELEMS.get(hidden.device.type, DEFAULT_CHUNK_ELEMS)
    return max(1, budget // max(1, vocab))


def logprob_entropy(hidden, weight, targets, temperature, token_chunk=None, vocab_chunk=None, with_entropy=True):
    """ops.logprob_entropy in the portable profile (chunk sizes change nothing and are ignored)."""
    tokens = hidden.shape[0]
    logprob = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty_like(logprob) if with_entropy else None
    step = _token_rows(hidden, weight.shape[0])
    for r in range(0, tokens, step):
        z = scaled_logits(hidden[r:r + step], weight, temperature)
        m = z.amax(-1, keepdim=True) + 0.0
        e = arith.exp(z - m)
        s = tree_sum(e)
        lse = m.squeeze(-1) + arith.log(s)
        logprob[r:r + step] = z.gather(1, targets[r:r + step].long().unsqueeze(1)).squeeze(1) - lse
        if with_entropy:
            entropy[r:r + step] = lse - arith.div(tree_sum(e * z), s)
    return logprob, entropy


def lm_logits(hidden, weight, temperature, vocab_chunk=None):
    """ops.lm_logits in the portable profile: the z :func:`logprob_entropy` reduces."""
    out = torch.empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32, device=hidden.device)
    step = _token_rows(hidden, weight.shape[0])
    for r in range(0, hidden.shape[0], step):
        out[r:r + step] = scaled_logits(hidden[r:r + step], weight, temperature)
    return out
