"""The SFT objective: an example's scored tokens, their packed forward and the loss.

An :class:`Example` is a token sequence and, per token, whether predicting it is in the loss (``scored``).
Token ``t`` (``t >= 1``) is predicted by the hidden row of position ``t - 1``; token 0 has no row before it
and is never scored. For a prompt/response row (:func:`response_mask`) the scored tokens are the response's
and its end token; for a chat conversation, each assistant turn's content and end-of-turn token
(:mod:`rlalign.train.sft.data`).

A batch of examples runs as the trainer's packed forward (:func:`pack`: ``ForwardBatch.packed``, the model's
``forward_hidden``, ``head_logprobs`` on the rows predicting scored tokens -- the rows and targets
``rlalign.train.packing.scored_rows`` gives a prompt/completion sample). With ``N`` the scored tokens of the
whole optimizer step (every micro-batch), the step minimises

    L = -(1 / N) * sum over scored tokens t of log p(x_t | x_<t)

each micro-batch contributing ``-(sum of its scored tokens' log-probs) / N`` (:func:`micro_batch_loss`), so the
per-token weight ``1 / N`` does not depend on how the step is cut into micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from rlalign.models.batch import ForwardBatch


@dataclasses.dataclass(frozen=True)
class Example:
    """One training sequence: ``tokens`` and, per token, whether its prediction is in the loss (``scored[0]``
    is always False); ``source`` names the row for error messages (``file: row N``)."""
    tokens: tuple[int, ...]
    scored: tuple[bool, ...]
    source: str = ""

    @property
    def num_scored(self) -> int:
        return sum(self.scored)


def response_mask(prompt_len: int, response_len: int) -> tuple[bool, ...]:
    """``scored`` of ``prompt + response`` (the response's end token counted in ``response_len``): every
    response token that has a token before it; with an empty prompt the response's first token is the
    sequence's first and is not scored."""
    return tuple(False for _ in range(prompt_len)) + tuple(prompt_len + i > 0 for i in range(response_len))


@dataclasses.dataclass(frozen=True)
class Pack:
    """Examples packed into one forward: the packed batch, the rows predicting scored tokens and those tokens
    (example by example, in position order)."""
    forward: ForwardBatch
    rows: torch.Tensor
    targets: torch.Tensor

    @property
    def num_scored(self) -> int:
        return int(self.rows.numel())


def pack(examples: Sequence[Example], device) -> Pack:
    rows, targets, offset = [], [], 0
    for ex in examples:
        for t, scored in enumerate(ex.scored):
            if scored:
                rows.append(offset + t - 1)
                targets.append(ex.tokens[t])
        offset += len(ex.tokens)
    return Pack(ForwardBatch.packed([list(ex.tokens) for ex in examples], device=device),
                torch.tensor(rows, dtype=torch.int64, device=device),
                torch.tensor(targets, dtype=torch.int64, device=device))


def token_logprobs(model, packed: Pack) -> torch.Tensor:
    """fp32 ``[scored tokens]``: log p(x_t | x_<t) of every scored token of the pack, one packed forward
    (differentiable when grad is enabled)."""
    hidden = model.forward_hidden(packed.forward)
    return model.head_logprobs(hidden.index_select(0, packed.rows), packed.targets, temperature=1.0)[0]


def micro_batch_loss(logprobs: torch.Tensor, step_tokens: int) -> torch.Tensor:
    """This micro-batch's part of the step's loss: ``-(sum of its scored log-probs) / step_tokens``."""
    return -logprobs.sum() / step_tokens


__all__ = ["Example", "Pack", "pack", "response_mask", "token_logprobs", "micro_batch_loss"]
