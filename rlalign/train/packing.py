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

import contextlib
import dataclasses
from typing import Sequence

import torch

from rlalign import ops
from rlalign.contract.errors import RLAlignError
from rlalign.models.batch import ForwardBatch
from rlalign.models.moe import RoutingReplay, replay_routing, sparse_layer_indices
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
    micro-batch (0 = ``samples.start``); ``rows`` / ``targets`` are :func:`scored_rows` of the pack.
    ``replay`` (``algo.routing_replay``): the rollout's expert choices of the pack's rows as (expert ids
    [rows, sparse layers, k], bool [rows] replayed), :func:`replay_plan`; None: the pack routes freshly."""
    samples: range
    tokens: slice
    forward: ForwardBatch
    rows: torch.Tensor
    targets: torch.Tensor
    seq_ids: torch.Tensor
    replay: "tuple[torch.Tensor, torch.Tensor] | None" = None


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """One step's training data, laid out once and read by every consumer (scoring, reference,
    value model, update).

    ``samples`` is the step's :class:`~rlalign.train.samples.StepSamples` (tokens, prompt lengths, the
    rollout's log-probs); the per-token tensors ``[T]`` (``seq_ids``, ``mask``, ``rollout_logprobs``,
    ``generated``) run over the completion tokens, sample by sample, on the training device. ``generated`` marks
    the tokens the model sampled (False: a multi-turn episode's observation tokens); ``mask`` (the tokens the loss
    weighs) starts as ``generated``, and the agreement check compares every ``generated`` token. ``mini_batches[m]`` are the
    micro-batches of mini-batch m (one optimizer step each): the samples cut into ``mini_batches``
    consecutive runs of equal size (sizes differ by at most one; none empty, so fewer when there are fewer
    samples), each cut into micro-batches of at most ``max_tokens`` tokens by :func:`micro_batches`. With
    ``replay_routing`` every micro-batch carries the rollout's recorded expert choices of its rows
    (:attr:`MicroBatch.replay`), which the policy's forwards replay (:func:`replaying`).
    """
    samples: StepSamples
    seq_ids: torch.Tensor
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    mini_batches: list[list[MicroBatch]]
    generated: torch.Tensor

    @classmethod
    def build(cls, samples: StepSamples, *, max_tokens: int, mini_batches: int = 1, device="cpu",
              replay_routing: bool = False) -> "TrainBatch":
        if not len(samples):
            raise ValueError("TrainBatch.build: no samples")
        if replay_routing and not samples.has_routing:
            raise RLAlignError("algo.routing_replay=true: the rollout engine recorded no expert choices for this "
                               "step's samples (rollout.record_routing=true on rollout.engine=rlalign records them)")
        if mini_batches < 1:
            raise ValueError(f"TrainBatch.build: mini_batches must be >= 1, got {mini_batches}")
        if samples.logprobs.shape[0] != int(samples.completion_lens.sum()):
            raise ValueError("TrainBatch.build: each sample needs one rollout logprob per completion token")
        lens = samples.completion_lens
        seq_ids = torch.repeat_interleave(torch.arange(len(samples)), lens).to(device)
        layout = _Layout(samples, device, replay_routing)
        count = min(mini_batches, len(samples))
        edges = [i * len(samples) // count for i in range(count + 1)]
        seq_lens = samples.sequence_lens.tolist()
        minis = []
        for lo, hi in zip(edges[:-1], edges[1:]):
            parts = micro_batches(seq_lens[lo:hi], max_tokens)
            minis.append([layout.micro_batch(range(lo + mb[0], lo + mb[-1] + 1)) for mb in parts])
        generated = samples.generated_mask().to(device)
        return cls(samples, seq_ids, generated, samples.logprobs.to(device), minis, generated)

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
    def score(self, model, *, temperature: float, with_entropy: bool = False, sampled: dict | None = None,
              replay: bool = False):
        """No-grad (logprobs, entropies | None) of every completion token ``[T]``, micro-batch by micro-batch
        (``sampled``: :func:`logprobs`); ``replay``: routing by the micro-batches' replayed expert choices
        (:func:`replaying`; the policy's forwards, never the reference model's)."""
        parts = []
        for mb in self.micro_batches:
            with replaying(model, mb) if replay else contextlib.nullcontext():
                parts.append(logprobs(model, mb, temperature=temperature, with_entropy=with_entropy, sampled=sampled))
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

    def __init__(self, samples: StepSamples, device, replay_routing: bool = False):
        self.samples, self.device, self.replay_routing = samples, device, replay_routing
        self.token_starts = _starts(samples.sequence_lens)         # in samples.tokens
        self.completion_starts = _starts(samples.completion_lens)   # in the per-token tensors [T]
        self.routing_starts = _starts(samples.routing_rows)         # in samples.routing

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
        replay = self.replay_plan(picked, positions) if self.replay_routing else None
        return MicroBatch(picked, slice(int(self.completion_starts[lo]), int(self.completion_starts[hi])), forward,
                          rows.to(self.device), ids[rows + 1].to(self.device),
                          torch.repeat_interleave(torch.arange(len(picked)), completion_lens).to(self.device), replay)

    def replay_plan(self, picked: range, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids int64 [rows, sparse layers, k], replayed bool [rows]) of the pack of samples ``picked``
        (``positions``: each row's position in its sample): sample i's first ``routing_rows[i]`` rows -- the
        tokens the engine fed through the model, every prompt token and every completion token but the last --
        take its recorded experts; the rest (each sample's last token, whose output scores nothing) route
        freshly (their ids here are 0, unread)."""
        s, lo, hi = self.samples, picked.start, picked.stop
        sample = torch.repeat_interleave(torch.arange(lo, hi), s.sequence_lens[lo:hi])
        replayed = positions < s.routing_rows[sample]
        source = torch.where(replayed, self.routing_starts[sample] + positions, 0)
        if s.routing.shape[0] == 0:   # nothing recorded: every row routes freshly
            experts = torch.zeros((len(positions), *s.routing.shape[1:]), dtype=torch.int64)
        else:
            experts = s.routing.index_select(0, source).to(torch.int64)
        return experts.to(self.device), replayed.to(self.device)


def _starts(lens: torch.Tensor) -> torch.Tensor:
    """int64 [n + 1]: 0, then the running sums of ``lens``."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.to(torch.int64).cumsum(0)])


def replaying(model, mb: MicroBatch):
    """The context in which ``model``'s forwards on ``mb`` -- and a backward's recomputed layers -- route by
    ``mb``'s replayed expert choices (:func:`rlalign.models.moe.replay_routing`); a no-op for a micro-batch
    without them."""
    if mb.replay is None:
        return contextlib.nullcontext()
    experts, replayed = mb.replay
    return replay_routing(RoutingReplay(experts, replayed, tuple(sparse_layer_indices(model.config))))


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
