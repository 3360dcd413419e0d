"""Packing scored sequences into micro-batches, and the fused per-token scoring of completions.

A training sample is ``tokens = prompt + completion`` with ``prompt_len``; only completion tokens
are scored. Token ``t`` of the completion (absolute position ``prompt_len + t``) is predicted by
the hidden row of position ``prompt_len + t - 1``; those rows go to ``model.head_logprobs`` (ops.logprob_entropy) and
the [tokens, vocab] logits are never built.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlalign.models.batch import ForwardBatch


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split sample indices, in order, into micro-batches of at most ``max_tokens`` tokens.

    Samples stay whole and in order (deterministic); a sample longer than ``max_tokens`` gets a
    micro-batch of its own.
    """
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > max_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(current)
    return batches


def scored_rows(samples: Sequence[tuple[Sequence[int], int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, targets) in a packed batch of ``samples``: the hidden row predicting each completion
    token, and that token; completion tokens in sample order."""
    rows, targets, offset = [], [], 0
    for tokens, prompt_len in samples:
        rows.extend(range(offset + prompt_len - 1, offset + len(tokens) - 1))
        targets.extend(tokens[prompt_len:])
        offset += len(tokens)
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(targets, dtype=torch.int64, device=device))


def score_completions(model, samples: Sequence[tuple[Sequence[int], int]], *, temperature: float = 1.0,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of every completion token of ``samples`` in one packed forward, under
    softmax(lm_head(h) / temperature). To equal a rollout's reported logprobs, ``temperature`` is the
    rollout's logprob temperature: ``ops.logprob_temperature`` of its sampling temperature.

    Differentiable when grad is enabled. Returns fp32 [completion tokens], sample by sample.
    """
    batch = ForwardBatch.packed([list(t) for t, _ in samples], device=model.device)
    rows, targets = scored_rows(samples, model.device)
    hidden = model.forward_hidden(batch)
    return model.head_logprobs(hidden.index_select(0, rows), targets, temperature=temperature,
                               with_entropy=with_entropy)


@torch.no_grad()
def score_in_micro_batches(model, samples, *, temperature: float, max_tokens: int, with_entropy: bool = False):
    """No-grad scoring of many samples, micro-batch by micro-batch (concatenated in sample order)."""
    lps, ents = [], []
    for mb in micro_batches([len(t) for t, _ in samples], max_tokens):
        lp, ent = score_completions(model, [samples[i] for i in mb], temperature=temperature,
                                    with_entropy=with_entropy)
        lps.append(lp)
        if ent is not None:
            ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)
