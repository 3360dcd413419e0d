"""The episode driver: multi-turn rollouts on the rollout engine, every token the trainer sees the engine's own.

:func:`run_episodes` plays ``n`` episodes per prompt in lockstep turns. Turn ``t`` of every running episode is one
engine request whose prompt is the episode's token ids so far (the prompt, then every earlier turn's sampled ids
and every observation's inserted ids, as ids: nothing is re-tokenised); the engine's prefix cache holds the full
pages of what the previous turn computed, so a turn prefills only the tail after the last full page of cached
K/V (at most ``page_size - 1`` tokens) and the new observation -- the earlier turns are not computed again while
their pages stay cached (under memory pressure a page evicted or a preempted sequence is recomputed: the same
bits, only slower).

The token-level guarantee (strict profile): the log-prob the engine reports for every model-generated token of
every turn equals, bit for bit, the trainer's log-prob of that token in one packed forward of the whole episode.
It holds because a token's log-prob depends only on the ids before it and its position -- never on which forward
(prefill chunk, decode step, prefix-cache hit, recompute after preemption) wrote the K/V it attends to
(docs/rollout.md). Observation tokens have no rollout log-prob; :attr:`Episode.generated` marks them False, and
the trainer masks them out of the loss and out of the agreement check (which covers every generated token).

Seeds: turn ``t`` of episode ``e`` samples with ``derive_seed(sampling.seed, t, 0)`` keyed by the episode's index
(``prompt_index * n + sample``), so an episode's tokens do not depend on the batch it ran in.

An env that raises or answers with something that is not a StepResult, a non-finite reward or an observation
that is not text or in-vocabulary token ids ends the call with one :class:`EnvError` line (a tool's failure never
does: :mod:`rlalign.envs.tools`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from rlalign.envs.base import EnvError, StepResult, Turn
from rlalign.ops.sample import derive_seed
from rlalign.rollout.config import SamplingParams
from rlalign.rollout.engine import RolloutEngine, collector_paused


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns`` model turns; ``max_episode_tokens`` tokens after the prompt (model turns and observations);
    each turn at most ``max_turn_tokens`` new tokens."""
    max_turns: int
    max_episode_tokens: int
    max_turn_tokens: int

    def __post_init__(self):
        for name in ("max_turns", "max_episode_tokens", "max_turn_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"EpisodeLimits.{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass
class Episode:
    """One episode. ``tokens``: every id after the prompt, turns and observations in order; ``generated[i]``: the
    model sampled ``tokens[i]`` (False: an observation's); ``logprobs[i]``: the engine's log-prob of a generated
    token (0.0 for an observation's, never compared); ``turns[i]``: the turn ``tokens[i]`` belongs to (an
    observation's: the turn it answers); ``versions[i]``: the engine's weights version of the turn ``tokens[i]``
    belongs to (the request that sampled it; an observation's: the turn it answers); ``turn_rewards``: each turn's
    reward; ``final_reward``: the env's at the end; ``finish_reason``: "done" (the env ended it), "max_turns" or
    "max_episode_tokens"; ``routing``: the MoE routing record of every fed row (the last turn's, which covers the
    whole episode), or None."""
    prompt_index: int
    sample_index: int
    prompt_tokens: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    generated: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: list[int] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    final_reward: float = 0.0
    finish_reason: str | None = None
    routing: object = None

    @property
    def num_turns(self) -> int:
        return len(self.turn_rewards)

    @property
    def episode_return(self) -> float:
        """Every turn's reward plus the final reward."""
        return math.fsum(self.turn_rewards) + self.final_reward

    def returns_to_go(self) -> list[float]:
        """Per turn ``t``: the rewards of turns ``t, t + 1, ...`` plus the final reward (the same sum as
        :attr:`episode_return`, so turn 0's is the episode's return, bit for bit)."""
        return [math.fsum(self.turn_rewards[t:]) + self.final_reward for t in range(self.num_turns)]

    @property
    def truncated(self) -> bool:
        return self.finish_reason != "done"


@dataclasses.dataclass
class _Running:
    episode: Episode
    env: object
    key: int


def run_episodes(engine, tokenizer, prompts: Sequence[Sequence[int]], rows: Sequence, env_factory: Callable,
                 sampling: SamplingParams, limits: EpisodeLimits, *,
                 prompt_indices: "Sequence[int] | None" = None) -> list[Episode]:
    """``sampling.n`` episodes of each prompt (token ids; ``rows[i]`` its dataset row, given to ``env.reset``),
    prompt by prompt then by sample; module docstring. ``sampling.max_new_tokens`` is ignored (``limits``).
    ``tokenizer`` decodes each turn's text and encodes text observations; without one (None) a turn's text is None
    and the env must answer with token ids. ``engine``: a :class:`RolloutEngine` (each turn one batch of requests),
    or an engine with ``generate(prompts, sampling, prompt_indices=...)`` and ``model_config`` -- the vLLM engine
    (:mod:`rlalign.integrations.vllm`): one ``generate`` call per distinct turn budget, the same seeds."""
    max_model_len, vocab_size = _engine_limits(engine)
    if len(rows) != len(prompts):
        raise ValueError(f"run_episodes: {len(prompts)} prompts but {len(rows)} rows")
    indices = list(range(len(prompts))) if prompt_indices is None else [int(i) for i in prompt_indices]
    running = []
    for p, (ids, row) in enumerate(zip(prompts, rows)):
        for k in range(sampling.n):
            env = env_factory()
            _call(env, "reset", row)
            running.append(_Running(Episode(indices[p], k, [int(t) for t in ids]), env, indices[p] * sampling.n + k))
    episodes = [r.episode for r in running]
    turn = 0
    while running:
        seed = derive_seed(sampling.seed, turn, 0)
        requests = [(r.episode.prompt_tokens + r.episode.tokens, _budget(r.episode, limits, max_model_len), r.key)
                    for r in running]
        generate = _step_engine if isinstance(engine, RolloutEngine) else _generate_by_budget
        completions = generate(engine, requests, dataclasses.replace(sampling, n=1, seed=seed, seed_by="index"))
        running = [r for r, c in zip(running, completions)
                   if _take_turn(r, c, tokenizer, limits, turn, max_model_len, vocab_size)]
        turn += 1
    return episodes


def _engine_limits(engine) -> tuple[int, int]:
    """(max_model_len, vocab size) of a RolloutEngine or of a generate()-only engine (the vLLM engine's
    ``config.max_model_len`` or its checkpoint's length)."""
    if isinstance(engine, RolloutEngine):
        if engine.has_unfinished():
            raise EnvError("run_episodes needs an idle engine (requests are in flight)")
        return engine.max_model_len, engine.model.config.vocab_size
    model_config = getattr(engine, "model_config", None)
    if not callable(getattr(engine, "generate", None)) or model_config is None:
        raise EnvError(f"multi-turn episodes run on rlalign's RolloutEngine or the vLLM engine; {type(engine).__name__} "
                       "cannot continue a sequence with observation tokens")
    configured = getattr(getattr(engine, "config", None), "max_model_len", None)
    return configured or model_config.max_position_embeddings, model_config.vocab_size


def _budget(ep: Episode, limits: EpisodeLimits, max_model_len: int) -> int:
    """The turn's token limit: the per-turn one, what the episode and the model length leave (>= 1 here)."""
    return min(limits.max_turn_tokens, limits.max_episode_tokens - len(ep.tokens),
               max_model_len - len(ep.prompt_tokens) - len(ep.tokens))


def _step_engine(engine: RolloutEngine, requests, sampling: SamplingParams):
    """Each running episode's next turn: one request per episode (its ids so far), the engine stepped to the end."""
    request_ids = []
    try:
        for ids, budget, key in requests:
            params = dataclasses.replace(sampling, max_new_tokens=budget)
            request_ids.append(engine.add_request(ids, params, prompt_index=key))
        done = {}
        with collector_paused():
            while engine.has_unfinished():
                for out in engine.step():
                    if out.completion is not None:
                        done[out.request_id] = out.completion
    except BaseException:
        engine.abort_all()
        raise
    return [done[rid] for rid in request_ids]


def _generate_by_budget(engine, requests, sampling: SamplingParams):
    """The turns on a generate()-only engine: one call per distinct budget, each request keyed by its episode."""
    out = [None] * len(requests)
    for budget in sorted({b for _, b, _ in requests}):
        picked = [i for i, (_, b, _) in enumerate(requests) if b == budget]
        done = engine.generate([requests[i][0] for i in picked], dataclasses.replace(sampling, max_new_tokens=budget),
                               prompt_indices=[requests[i][2] for i in picked])
        for i, completion in zip(picked, done, strict=True):
            out[i] = completion
    return out


def _take_turn(r: _Running, completion, tokenizer, limits: EpisodeLimits, turn: int, max_model_len: int,
               vocab_size: int) -> bool:
    """Append the turn, ask the env, append its observation; whether the episode goes on."""
    ep = r.episode
    ep.tokens += completion.tokens
    ep.generated += [True] * len(completion.tokens)
    ep.logprobs += completion.logprobs
    ep.turns += [turn] * len(completion.tokens)
    ep.versions += [completion.weights_version] * len(completion.tokens)
    ep.routing = completion.routing
    text = completion.text if completion.text is not None or tokenizer is None else tokenizer.decode(completion.tokens)
    result = _call(r.env, "step", Turn(text, tuple(completion.tokens), turn, completion.finish_reason))
    if not isinstance(result, StepResult):
        raise EnvError(f"{_name(r.env)}.step returned {type(result).__name__}, expected a StepResult")
    ep.turn_rewards.append(_reward(r.env, "step", result.reward))
    room = min(limits.max_episode_tokens, max_model_len - len(ep.prompt_tokens))
    reason = _end_reason(result, ep, turn, limits, room)
    if reason is None:
        obs = _observation_ids(r.env, result.observation, tokenizer, vocab_size)
        if len(ep.tokens) + len(obs) < room:
            ep.tokens += obs
            ep.generated += [False] * len(obs)
            ep.logprobs += [0.0] * len(obs)
            ep.turns += [turn] * len(obs)
            ep.versions += [completion.weights_version] * len(obs)
            return True
        reason = "max_episode_tokens"   # no room left for a model token after the observation
    ep.finish_reason = reason
    ep.final_reward = _reward(r.env, "final_reward", _call(r.env, "final_reward"))
    return False


def _end_reason(result: StepResult, ep: Episode, turn: int, limits: EpisodeLimits, room: int) -> "str | None":
    if result.done:
        return "done"
    if turn + 1 >= limits.max_turns:
        return "max_turns"
    if len(ep.tokens) >= room:
        return "max_episode_tokens"
    return None


def _observation_ids(env, observation, tokenizer, vocab_size: int) -> list[int]:
    """The observation's ids: text encoded as is (no special tokens added), or the ids given (checked)."""
    if observation is None:
        return []
    if isinstance(observation, str):
        if tokenizer is None:
            raise EnvError(f"{_name(env)}.step returned a text observation but the episodes run without a tokenizer; "
                           "return token ids or pass the tokenizer")
        return list(tokenizer.encode(observation, add_special_tokens=False))
    try:
        ids = [int(t) for t in observation]
    except (TypeError, ValueError):
        raise EnvError(f"{_name(env)}.step returned an observation of type {type(observation).__name__}; "
                       "expected text, token ids or None") from None
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise EnvError(f"{_name(env)}.step returned observation token id {bad}, outside the vocabulary "
                       f"[0, {vocab_size})")
    return ids


def _call(env, method: str, *args):
    try:
        return getattr(env, method)(*args)
    except EnvError:
        raise
    except Exception as e:
        text = " ".join(str(e).split())
        raise EnvError(f"{_name(env)}.{method} raised {type(e).__name__}" + (f": {text}" if text else "")) from e


def _reward(env, method: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise EnvError(f"{_name(env)}.{method} gave a reward of type {type(value).__name__}, expected a float") from None
    if not math.isfinite(number):
        raise EnvError(f"{_name(env)}.{method} gave the reward {number}, expected a finite float")
    return number


def _name(env) -> str:
    return type(env).__name__


__all__ = ["Episode", "EpisodeLimits", "run_episodes"]
