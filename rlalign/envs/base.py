"""The environment interface: what a multi-turn episode's environment is given and what it returns.

An episode starts from a dataset row (:class:`rlalign.tasks.Problem`: prompt, answer, the row's other fields).
The episode's first tokens are the row's prompt as the task encodes it (the chat template, when the task uses
one); :meth:`Env.reset` then sees the row. Each model turn ends (an end token, a stop token, or the turn's token
limit) and goes to :meth:`Env.step` as a :class:`Turn` (its text and its exact token ids); the env answers with a
:class:`StepResult`: the next observation (text, encoded by the model's tokenizer as is -- no chat template is
applied, the env writes the turn markers it needs -- or token ids, inserted as given), the turn's reward and
whether the episode is done. The episode's return is the sum of every turn's reward plus :meth:`Env.final_reward`.

The env instance belongs to one episode: :func:`rlalign.envs.loading.load_env` gives a factory, called once per
episode. An env runs in the trainer's process (tools it calls run with a timeout:
:mod:`rlalign.envs.tools`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rlalign.contract.errors import RLAlignError


class EnvError(RLAlignError):
    """An environment broke its contract (raised, returned something that is not a StepResult, an observation
    that is neither text nor token ids in the vocabulary, a non-finite reward): one line naming the env."""


@dataclasses.dataclass(frozen=True)
class Turn:
    """One model turn: ``text`` (decoded; None when the episodes run without a tokenizer), ``token_ids`` (exactly what the engine sampled), ``index`` (0-based),
    ``finish_reason`` ("stop": an end/stop token; "length": the turn's or the episode's token limit)."""
    text: str | None
    token_ids: tuple[int, ...]
    index: int
    finish_reason: str


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The env's answer to a turn: the next ``observation`` (text, token ids, or None when done), the turn's
    ``reward`` and whether the episode is ``done``. An observation given while not done is appended to the
    episode (masked out of the loss) and the model takes the next turn."""
    observation: "str | Sequence[int] | None" = None
    reward: float = 0.0
    done: bool = False


class Env:
    """Subclass and override :meth:`step` (and :meth:`reset`, :meth:`final_reward` where needed).

    ``reset(row)`` starts the episode from a dataset row; ``step(turn)`` answers each model turn. The driver
    (:func:`rlalign.envs.episodes.run_episodes`) ends the episode at ``done``, at ``task.max_turns`` model turns
    or when ``task.max_episode_tokens`` are reached (then ``final_reward`` still scores it)."""

    def reset(self, row) -> None:
        """The episode's dataset row (``row.prompt``, ``row.answer``, ``row.extra``)."""
        self.row = row

    def step(self, turn: Turn) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} must implement step(turn) -> StepResult")

    def final_reward(self) -> float:
        """Added to the episode's return once it ends, whatever ended it (default 0)."""
        return 0.0


__all__ = ["Env", "EnvError", "StepResult", "Turn"]
