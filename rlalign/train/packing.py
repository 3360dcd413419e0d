"""Packing scored sequences into micro-batches, the step's :class:`TrainBatch`, and the fused
per-token scoring of completions.

A training sample is ``tokens = prompt + completion`` with ``prompt_len``; only completion tokens
are scored. Token ``t`` of the completion (absolute position ``prompt_len + t``) is predicted by
the hidden row of position ``prompt_len + t - 1``; those rows go to ``model.head_logprobs`` (ops.logprob_entropy) and
the [tokens, vocab] logits are never built. The step's :class:`TrainBatch` is laid out from the tensors of its
:class:`~rlalign.train.samples.StepSamples` (slices of the flat token ids, no Python lists);
:func:`score_completions` scores samples given as lists (default-model pretraining).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from rlalign import ops
from rlalign.models.batch import ForwardBatch
from rlalign.train.samples import StepSamples


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


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Consecutive samples packed into one forward. ``tokens`` slices the step's flat per-token tensors
    (completion tokens, sample by sample); ``seq_ids`` are the tokens' sample indices local to this
    micro-batch (0 = ``samples.start``); ``rows`` / ``targets`` are :func:`scored_rows` of the pack."""
    samples: range
    tokens: slice
    forward: ForwardBatch
    rows: torch.Tensor
    targets: torch.Tensor
    seq_ids: torch.Tensor


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """One step's training data, laid out once and read by every consumer (scoring, reference,
    value model, update).

    ``samples`` is the step's :class:`~rlalign.train.samples.StepSamples` (tokens, prompt lengths, the
    rollout's log-probs); the per-token tensors ``[T]`` (``seq_ids``, ``mask``, ``rollout_logprobs``) run
    over the completion tokens, sample by sample, on the training device. ``mini_batches[m]`` are the
    micro-batches of mini-batch m (one optimizer step each): the samples cut into ``mini_batches``
    consecutive runs of equal size (sizes differ by at most one; none empty, so fewer when there are fewer
    samples), each cut into micro-batches of at most ``max_tokens`` tokens by :func:`micro_batches`.
    """
    samples: StepSamples
    seq_ids: torch.Tensor
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    mini_batches: list[list[MicroBatch]]

    @classmethod
    def build(cls, samples: StepSamples, *, max_tokens: int, mini_batches: int = 1, device="cpu") -> "TrainBatch":
        if not len(samples):
            raise ValueError("TrainBatch.build: no samples")
        if mini_batches < 1:
            raise ValueError(f"TrainBatch.build: mini_batches must be >= 1, got {mini_batches}")
        if samples.logprobs.shape[0] != int(samples.completion_lens.sum()):
            raise ValueError("TrainBatch.build: each sample needs one rollout logprob per completion token")
        lens = samples.completion_lens
        seq_ids = torch.repeat_interleave(torch.arange(len(samples)), lens).to(device)
        layout = _Layout(samples, device)
        count = min(mini_batches, len(samples))
        edges = [i * len(samples) // count for i in range(count + 1)]
        seq_lens = samples.sequence_lens.tolist()
        minis = []
        for lo, hi in zip(edges[:-1], edges[1:]):
            parts = micro_batches(seq_lens[lo:hi], max_tokens)
            minis.append([layout.micro_batch(range(lo + mb[0], lo + mb[-1] + 1)) for mb in parts])
        return cls(samples, seq_ids, torch.ones(int(lens.sum()), dtype=torch.bool, device=device),
                   samples.logprobs.to(device), minis)

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def micro_batches(self) -> list[MicroBatch]:
        """Every micro-batch, in sample order."""
        return [mb for mini in self.mini_batches for mb in mini]

    @property
    def completion_lens(self) -> torch.Tensor:
        return torch.bincount(self.seq_ids, minlength=self.num_samples)

    def with_mask(self, mask: torch.Tensor) -> "TrainBatch":
        return dataclasses.replace(self, mask=mask)

    @torch.no_grad()
    def score(self, model, *, temperature: float, with_entropy: bool = False, sampled: dict | None = None):
        """No-grad (logprobs, entropies | None) of every completion token ``[T]``, micro-batch by micro-batch
        (``sampled``: :func:`logprobs`)."""
        parts = [logprobs(model, mb, temperature=temperature, with_entropy=with_entropy, sampled=sampled)
                 for mb in self.micro_batches]
        return torch.cat([p[0] for p in parts]), (torch.cat([p[1] for p in parts]) if with_entropy else None)

    @torch.no_grad()
    def score_sampled(self, model, sampled: dict) -> ops.SampledLogprobs:
        """No-grad ``ops.sampled_logprob`` of every completion token ``[T]`` (kept-set log-probs, the full-softmax
        ones and the kept-set sizes), micro-batch by micro-batch."""
        parts = [ops.sampled_logprob(_head_rows(model, mb), model.lm_head_weight, mb.targets, **sampled)
                 for mb in self.micro_batches]
        return ops.SampledLogprobs(torch.cat([p.logprob for p in parts]), None,
                                   torch.cat([p.full_logprob for p in parts]), torch.cat([p.kept for p in parts]))


class _Layout:
    """Where each sample's tokens and completion tokens start in the step's flat tensors; cuts micro-batches."""

    def __init__(self, samples: StepSamples, device):
        self.samples, self.device = samples, device
        self.token_starts = _starts(samples.sequence_lens)         # in samples.tokens
        self.completion_starts = _starts(samples.completion_lens)   # in the per-token tensors [T]

    def micro_batch(self, picked: range) -> MicroBatch:
        """The packed forward of samples ``picked`` and the rows / targets of their completion tokens."""
        s, lo, hi = self.samples, picked.start, picked.stop
        seq_lens, prompt_lens = s.sequence_lens[lo:hi], s.prompt_lens[lo:hi]
        completion_lens = s.completion_lens[lo:hi]
        ids = s.tokens[self.token_starts[lo]:self.token_starts[hi]]
        local_starts = _starts(seq_lens)[:-1]
        positions = torch.arange(ids.shape[0], dtype=torch.int64) - torch.repeat_interleave(local_starts, seq_lens)
        # row predicting completion token j of sample i: its start + prompt_len_i - 1 + j; the target is the next id
        first_row = local_starts + prompt_lens - 1
        within = torch.arange(int(completion_lens.sum()), dtype=torch.int64) - torch.repeat_interleave(
            _starts(completion_lens)[:-1], completion_lens)
        rows = torch.repeat_interleave(first_row, completion_lens) + within
        forward = ForwardBatch(ids.to(self.device), positions.to(self.device),
                               _starts(seq_lens).to(torch.int32).to(self.device))
        return MicroBatch(picked, slice(int(self.completion_starts[lo]), int(self.completion_starts[hi])), forward,
                          rows.to(self.device), ids[rows + 1].to(self.device),
                          torch.repeat_interleave(torch.arange(len(picked)), completion_lens).to(self.device))


def _starts(lens: torch.Tensor) -> torch.Tensor:
    """int64 [n + 1]: 0, then the running sums of ``lens``."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.to(torch.int64).cumsum(0)])


def logprobs(model, mb: MicroBatch, *, temperature: float, with_entropy: bool = False, sampled: dict | None = None):
    """(logprobs, entropies | None) fp32 ``[tokens of mb]`` of ``model`` on one micro-batch: one packed
    forward, differentiable when grad is enabled. ``sampled`` None: the full softmax at ``temperature`` (the
    logprob temperature); else ``ops.sampled_logprob``'s settings (``RolloutSection.sampled_scoring``): the
    log-prob and entropy of the kept set's renormalised distribution the engine sampled from."""
    if sampled is not None:
        out = ops.sampled_logprob(_head_rows(model, mb), model.lm_head_weight, mb.targets, with_entropy=with_entropy,
                                  **sampled)
        return out.logprob, out.entropy
    hidden = model.forward_hidden(mb.forward)
    return model.head_logprobs(hidden.index_select(0, mb.rows), mb.targets, temperature=temperature,
                               with_entropy=with_entropy)


def _head_rows(model, mb: MicroBatch) -> torch.Tensor:
    """The final hidden rows predicting ``mb``'s completion tokens (one packed forward)."""
    return model.forward_hidden(mb.forward).index_select(0, mb.rows)
