"""Multi-turn draws (``task.env``): the step's episodes from the episode driver, as the step's samples.

An episode becomes one sample of :class:`~rlalign.train.samples.StepSamples`: its prompt, then every token after
it (each model turn's sampled ids and each observation's inserted ids, exactly as the engine ran them) as the
completion, with ``generated`` False on the observation tokens (masked out of the loss and out of the agreement
check, which covers every model-generated token). Its reward is the episode's return (every turn's reward plus the
final reward): by default advantages are per episode (GRPO normalises the returns of a prompt's episodes and gives
every generated token of an episode its episode's advantage); the record also carries each token's turn and each
turn's return-to-go, for per-turn advantages (``algo.turn_advantage=turn``, :mod:`rlalign.algos.advantages`), and
each token's weights version (the engine's for that turn), for asynchronous steps (:mod:`rlalign.train.offpolicy`). ``truncated`` is True when the episode ran out of tokens
(``task.max_episode_tokens``), so ``algo.overlong_filter`` drops those episodes.
"""

from __future__ import annotations

import math


from rlalign.envs.episodes import Episode, EpisodeLimits, run_episodes
from rlalign.train.samples import StepSamples


def limits_of(cfg) -> EpisodeLimits:
    return EpisodeLimits(cfg.task.max_turns, cfg.task.max_episode_tokens, cfg.rollout.max_new_tokens)


def episode_samples(episodes: list[Episode]) -> StepSamples:
    """The unscored record of ``episodes`` (one sample each, in order; observation tokens marked not generated),
    with every token's turn and weights version and every turn's return-to-go."""
    return StepSamples.of_records(episodes, truncated_by="max_episode_tokens",
                                  generated=[g for e in episodes for g in e.generated],
                                  versions=[v for e in episodes for v in e.versions],
                                  turns=[t for e in episodes for t in e.turns],
                                  turn_returns=[e.returns_to_go() for e in episodes])


def episode_stats(episodes: list[Episode], forward_tokens: int) -> dict:
    """``episodes/*``: mean turns and return, the share that the env ended, tokens per episode (model and
    observation), and the engine's forward tokens per episode token (1.0 would mean nothing recomputed; each turn
    recomputes only the partial page before it and feeds its observation)."""
    n = max(len(episodes), 1)
    tokens = sum(len(e.prompt_tokens) + len(e.tokens) for e in episodes)
    return {"episodes/turns": sum(e.num_turns for e in episodes) / n,
            "episodes/return": math.fsum(e.episode_return for e in episodes) / n,
            "episodes/done_frac": sum(e.finish_reason == "done" for e in episodes) / n,
            "episodes/observation_tokens": sum(e.generated.count(False) for e in episodes) / n,
            "episodes/generated_tokens": sum(e.generated.count(True) for e in episodes) / n,
            "episodes/forward_per_token": forward_tokens / max(tokens, 1)}


def play(engine, task, tokenizer, problems, sampling, limits: EpisodeLimits) -> tuple[list[Episode], int]:
    """(episodes of ``problems`` x ``sampling.n``, the engine's forward tokens they took)."""
    before = engine.counters["forward_tokens"]
    episodes = run_episodes(engine, tokenizer, [task.encode(p.prompt) for p in problems], problems, task.env,
                            sampling, limits)
    return episodes, engine.counters["forward_tokens"] - before   # rlalign's engine (the config refuses others)


def draw_episodes(engine, task, tokenizer, problems, sampling, limits: EpisodeLimits):
    """(unscored samples, each episode's return, ``episodes/*`` stats) of one draw."""
    episodes, forward = play(engine, task, tokenizer, problems, sampling, limits)
    return episode_samples(episodes), [e.episode_return for e in episodes], episode_stats(episodes, forward)


__all__ = ["draw_episodes", "episode_samples", "episode_stats", "limits_of", "play"]
