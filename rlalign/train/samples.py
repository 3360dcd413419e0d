"""The step's samples: the one record that carries them from the rollout engine to the trainer, as tensors.

:class:`StepSamples` is built once from the engine's :class:`~rlalign.models.completion.Completion` records
(:meth:`StepSamples.of_completions`; multi-turn episodes through the same :meth:`StepSamples.of_records`) and read
by everything after: the data-parallel all-gather (:mod:`rlalign.train.dp_rollout`), the rewards and DAPO's group
filter (:mod:`rlalign.train.sampling`), the step's layout (:class:`rlalign.train.packing.TrainBatch`), the
agreement checks (:mod:`rlalign.train.agreement`) and the step's statistics. Every field is a tensor on the host,
sample by sample in the order the engine returned them (prompt-major); variable-length fields are flat with a
length per sample:

- ``tokens`` int64 [sum of sequence lengths]: each sample's prompt tokens, then its completion tokens;
- ``prompt_lens`` / ``completion_lens`` int64 [N];
- ``logprobs`` fp32 [sum of completion lengths]: the engine's log-prob of each completion token (the
  behaviour policy's; exact: a fp32 value is exact as a Python float and back);
- ``truncated`` bool [N]: the sample ended at its length limit;
- ``prompt_index`` int64 [N]: the sample's prompt among the prompts of its draw;
- ``routing``: MoE expert ids [sum of routing rows, sparse layers, k] in the engine's dtype, or None unless every
  sample carries a record (``Completion.routing``); ``routing_rows`` int64 [N] its rows per sample (0 without);
- ``rewards`` fp32 [N] and ``group_ids`` int64 [N] once scored (:meth:`scored`): a group is one prompt's samples;
- ``generated`` bool [sum of completion lengths] or None (every completion token is the model's): for multi-turn
  episodes (:mod:`rlalign.train.multiturn`) False on the observation tokens the env inserted, which have no
  rollout log-prob (their ``logprobs`` entry is 0.0), are masked out of the loss and not compared.
- ``versions`` int64 [sum of completion lengths]: the engine's weights version each completion token was sampled
  with (the behaviour policy's version; :mod:`rlalign.train.offpolicy` reads it), or None where a record lost it
  (the data-parallel all-gather does not carry it).
- ``turns`` int64 [sum of completion lengths], ``turn_returns`` fp32 [sum of turn_counts] and ``turn_counts``
  int64 [N], or all None (one-turn samples): for multi-turn episodes, the turn each completion token belongs to
  (an observation's: the turn it answers), each turn's return-to-go (its reward, the later turns' and the final
  reward: :meth:`rlalign.envs.episodes.Episode.returns_to_go`), sample by sample, and each sample's turn count --
  what ``algo.turn_advantage=turn`` reads.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from rlalign.models.completion import Completion


@dataclasses.dataclass(frozen=True)
class StepSamples:
    tokens: torch.Tensor
    prompt_lens: torch.Tensor
    completion_lens: torch.Tensor
    logprobs: torch.Tensor
    truncated: torch.Tensor
    prompt_index: torch.Tensor
    routing: torch.Tensor | None
    routing_rows: torch.Tensor
    rewards: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    generated: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    turns: torch.Tensor | None = None
    turn_returns: torch.Tensor | None = None
    turn_counts: torch.Tensor | None = None

    # ---- building -----------------------------------------------------------------------------------

    @classmethod
    def of_completions(cls, completions: Sequence[Completion]) -> "StepSamples":
        """The record of the engine's ``completions`` (unscored), with the weights version of every token."""
        return cls.of_records(completions, truncated_by="length",
                              versions=[v for c in completions for v in c.versions()])

    @classmethod
    def of_records(cls, records: Sequence, *, truncated_by: str, generated: "Sequence[bool] | None" = None,
                   versions: "Sequence[int] | None" = None, turns: "Sequence[int] | None" = None,
                   turn_returns: "Sequence[Sequence[float]] | None" = None) -> "StepSamples":
        """The one conversion of per-sample lists into tensors (unscored): ``records`` carry ``prompt_tokens``,
        ``tokens``, ``logprobs``, ``finish_reason`` (``truncated_by`` marks a cut one), ``prompt_index`` and
        ``routing`` -- the engine's completions, or multi-turn episodes with their ``generated`` flags, turns and
        each sample's per-turn returns-to-go."""
        routes = [r.routing for r in records]
        routed = bool(routes) and all(r is not None for r in routes)
        return cls(
            tokens=torch.tensor([t for r in records for t in (*r.prompt_tokens, *r.tokens)], dtype=torch.int64),
            prompt_lens=torch.tensor([len(r.prompt_tokens) for r in records], dtype=torch.int64),
            completion_lens=torch.tensor([len(r.tokens) for r in records], dtype=torch.int64),
            logprobs=torch.tensor([x for r in records for x in r.logprobs], dtype=torch.float32),
            truncated=torch.tensor([r.finish_reason == truncated_by for r in records], dtype=torch.bool),
            prompt_index=torch.tensor([r.prompt_index for r in records], dtype=torch.int64),
            routing=torch.cat(routes) if routed else None,
            routing_rows=torch.tensor([r.shape[0] if routed else 0 for r in routes], dtype=torch.int64),
            generated=None if generated is None else torch.tensor(generated, dtype=torch.bool),
            versions=None if versions is None else torch.tensor(versions, dtype=torch.int64),
            turns=None if turns is None else torch.tensor(turns, dtype=torch.int64),
            turn_returns=None if turn_returns is None else torch.tensor([g for r in turn_returns for g in r],
                                                                        dtype=torch.float32),
            turn_counts=None if turn_returns is None else torch.tensor([len(r) for r in turn_returns],
                                                                       dtype=torch.int64))

    @classmethod
    def concat(cls, parts: Sequence["StepSamples"]) -> "StepSamples":
        """The samples of ``parts`` one after another; the routing record stays only when every part that has
        samples carries one."""
        filled = [p for p in parts if len(p)] or list(parts[:1])
        routed = all(p.routing is not None for p in filled)
        cat = lambda name: torch.cat([getattr(p, name) for p in filled])  # noqa: E731
        scored = all(p.rewards is not None for p in filled)
        marked = any(p.generated is not None for p in filled)
        versioned = all(p.versions is not None for p in filled)
        turned = all(p.turns is not None for p in filled)
        return cls(cat("tokens"), cat("prompt_lens"), cat("completion_lens"), cat("logprobs"), cat("truncated"),
                   cat("prompt_index"), cat("routing") if routed else None,
                   cat("routing_rows") if routed else torch.zeros(sum(len(p) for p in filled), dtype=torch.int64),
                   cat("rewards") if scored else None, cat("group_ids") if scored else None,
                   torch.cat([p.generated_mask() for p in filled]) if marked else None,
                   cat("versions") if versioned else None, *(
                       (cat("turns"), cat("turn_returns"), cat("turn_counts")) if turned else (None, None, None)))

    def scored(self, rewards: Sequence[float], first_group: int) -> "StepSamples":
        """These samples with their rewards (fp32) and group ids (``first_group`` + the prompt's index)."""
        return dataclasses.replace(self, rewards=torch.tensor(rewards, dtype=torch.float32),
                                   group_ids=self.prompt_index + first_group)

    def select(self, keep: torch.Tensor) -> "StepSamples":
        """The samples where ``keep`` (bool [N]) is True, in order, each with all of its tokens and rows."""
        keep = keep.to(torch.bool).cpu()
        per_token = lambda lens: torch.repeat_interleave(keep, lens)  # noqa: E731
        pick = lambda t: None if t is None else t[keep]  # noqa: E731
        return StepSamples(self.tokens[per_token(self.sequence_lens)], self.prompt_lens[keep],
                           self.completion_lens[keep], self.logprobs[per_token(self.completion_lens)],
                           self.truncated[keep], self.prompt_index[keep],
                           None if self.routing is None else self.routing[per_token(self.routing_rows)],
                           self.routing_rows[keep], pick(self.rewards), pick(self.group_ids),
                           None if self.generated is None else self.generated[per_token(self.completion_lens)],
                           None if self.versions is None else self.versions[per_token(self.completion_lens)],
                           None if self.turns is None else self.turns[per_token(self.completion_lens)],
                           None if self.turns is None else self.turn_returns[per_token(self.turn_counts)],
                           pick(self.turn_counts))

    # ---- reading ------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.prompt_lens.shape[0])

    @property
    def sequence_lens(self) -> torch.Tensor:
        """int64 [N]: prompt + completion tokens of each sample."""
        return self.prompt_lens + self.completion_lens

    def generated_mask(self) -> torch.Tensor:
        """bool [sum of completion lengths]: True on the tokens the model sampled (all of them unless ``generated``)."""
        if self.generated is not None:
            return self.generated
        return torch.ones(int(self.completion_lens.sum()), dtype=torch.bool)

    @property
    def has_routing(self) -> bool:
        """Whether every sample carries the rollout's routing (an MoE model on an engine that records it)."""
        return self.routing is not None and len(self) > 0

    def completion_token_lists(self) -> list[list[int]]:
        """Each sample's completion tokens, for the tokenizer (the rewards score decoded text)."""
        sequences = self.tokens.split(self.sequence_lens.tolist())
        return [seq[p:].tolist() for seq, p in zip(sequences, self.prompt_lens.tolist())]

    def group_tensor(self, device="cpu") -> torch.Tensor:
        """Group ids renumbered 0..G-1 in order of first appearance."""
        ids = self.group_ids
        distinct, inverse = torch.unique(ids, return_inverse=True)
        first_seen = torch.full((len(distinct),), len(ids), dtype=torch.int64).scatter_reduce(
            0, inverse, torch.arange(len(ids), dtype=torch.int64), "amin")
        rank = torch.empty_like(first_seen)
        rank[torch.argsort(first_seen)] = torch.arange(len(distinct), dtype=torch.int64)
        return rank[inverse].to(device)

    def num_groups(self) -> int:
        return int(torch.unique(self.group_ids).numel())

    def reward_tensor(self, device="cpu") -> torch.Tensor:
        return self.rewards.to(device)


__all__ = ["StepSamples"]
