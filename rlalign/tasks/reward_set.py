"""A run's rewards: rule rewards (functions, each in a worker process of its own) and reward models (scored on the
device, strict), combined with weights.

``task.rewards`` lists the terms; each entry is a mapping with exactly one of

- ``name``: a rule reward as ``task.reward`` names one (a built-in, ``module:function``, ``file.py:function``);
- ``reward_model``: a ``*ForSequenceClassification`` checkpoint folder (:mod:`rlalign.tasks.reward_model`);

and an optional ``weight`` (a finite number, default 1.0); a reward model entry may also give ``dtype`` (float32 or
bfloat16; default: the checkpoint's) and ``micro_batch_tokens`` (default 8192). A sample's reward is
``sum(weight_i * reward_i)`` over the terms in the order listed (float64 arithmetic, one fixed order); a single term
of weight 1 is passed through unchanged.

Concurrency (what "a slow reward does not stall the run" means here): :meth:`RewardSet.score` first sends the batch
to every rule reward's worker process (they score at the same time, each bounded by ``task.reward_timeout_s`` per
call), then runs the reward models on the device in this process meanwhile, then collects the workers' values.
Scoring does not yet overlap generation: it starts when the step's completions are all in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlalign.tasks.reward_model import RewardModel
from rlalign.tasks.reward_terms import RewardTerm, combine
from rlalign.tasks.reward_worker import RewardWorker


class RewardSet:
    """The terms loaded: one :class:`RewardWorker` per rule reward, one :class:`RewardModel` per reward model (on
    ``device``). A reward that cannot be loaded fails here; :meth:`close` stops the workers."""

    def __init__(self, terms: Sequence[RewardTerm], *, timeout_s: float, device: str = "cpu"):
        self.terms = list(terms)
        self._scorers: list = []
        self._seen: list[list[float]] = [[] for _ in self.terms]   # each term's values since take_term_means
        try:
            for term in self.terms:
                self._scorers.append(
                    RewardWorker(term.name, timeout_s) if term.name is not None else
                    RewardModel(term.reward_model, device=device, dtype=term.dtype,
                                micro_batch_tokens=term.micro_batch_tokens))
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        return [s.name for s in self._scorers]

    def components(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
                   extras: "Sequence[Mapping[str, Any]] | None" = None,
                   conversations: "Sequence[Sequence[dict] | None] | None" = None) -> list[list[float]]:
        """Each term's rewards (unweighted), in term order; the workers score while the reward models run."""
        try:
            for worker in (s for s in self._scorers if isinstance(s, RewardWorker)):
                worker.submit(prompts, completions, answers, extras)
            model_values = {id(s): s.score(prompts, completions, conversations)
                            for s in self._scorers if isinstance(s, RewardModel)}
            return [s.result() if isinstance(s, RewardWorker) else model_values[id(s)] for s in self._scorers]
        except BaseException:
            self.close()   # a failed term stops the run; the other workers' batches are never collected
            raise

    def score(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
              extras: "Sequence[Mapping[str, Any]] | None" = None,
              conversations: "Sequence[Sequence[dict] | None] | None" = None) -> list[float]:
        """Each sample's weighted sum of the terms' rewards (see the module docstring)."""
        values = self.components(prompts, completions, answers, extras, conversations)
        for seen, term_values in zip(self._seen, values):
            seen.extend(term_values)
        return combine(values, [t.weight for t in self.terms])

    def take_term_means(self) -> dict[str, float]:
        """``{"reward/term<i>_<label>": mean}`` of each term's (unweighted) values scored since the last call, when
        there are two terms or more (one term: {} -- its values are the reward); then forgets them. Labels: the
        function's name, or the reward model folder's name."""
        seen, self._seen = self._seen, [[] for _ in self.terms]
        if len(self.terms) < 2 or not seen[0]:
            return {}
        return {f"reward/term{i}_{term_label(t)}": sum(v) / len(v) for i, (t, v) in enumerate(zip(self.terms, seen))}

    def close(self) -> None:
        for scorer in self._scorers:
            close = getattr(scorer, "close", None)
            if close is not None:
                close()


def term_label(term: RewardTerm) -> str:
    """A short metric-safe label of a term: the function's name, or the reward model folder's name."""
    source = term.name.rpartition(":")[2] if term.name is not None else Path(term.reward_model).name
    return re.sub(r"[^A-Za-z0-9_.-]", "_", source.rpartition(".")[2] or source) or "term"


__all__ = ["RewardSet", "term_label"]
