"""Drawing the step's samples: prompts from the task's data stream, the rollout engine's completions, rewards;
DAPO's redraws; and the held-out evaluation.

Each step draws ``rollout.prompts_per_step`` prompts x ``rollout.samples_per_prompt`` samples at
``rollout.temperature`` (seeded by ``run.seed``, the step and the draw round: :func:`rlalign.ops.derive_seed`),
each data-parallel rank generating its share (:mod:`rlalign.train.dp_rollout`), and scores every sample with the
task's reward; with ``task.env`` each sample is instead a multi-turn episode scored by its return
(:mod:`rlalign.train.multiturn`), the one choice made when the :class:`Sampler` is built. With ``algo.dynamic_sampling`` (DAPO) groups whose rewards are all equal are dropped and more
prompts drawn until enough informative groups are kept (:meth:`Sampler.draw_step`). The result is the step's
:class:`~rlalign.train.samples.StepSamples`.
"""

from __future__ import annotations

import time

import torch

from rlalign import algos
from rlalign.contract.profiles import use_profile
from rlalign.distributed.launch import Group
from rlalign.ops.sample import derive_seed
from rlalign.rollout.config import SamplingParams
from rlalign.train import multiturn
from rlalign.train.dp_rollout import generate_sharded
from rlalign.train.samples import StepSamples
from rlalign.train.setup import TaskData


class Sampler:
    """The run's source of samples: the engine, the task (data stream and reward) and the data position."""

    def __init__(self, cfg, task: TaskData, tokenizer, engine, dp: Group):
        self.cfg, self.task, self.tokenizer, self.engine, self.dp = cfg, task, tokenizer, engine, dp
        self.data_pos = 0   # the next training prompt of the task's stream (a checkpoint keeps it)
        self.draw_stats: list[dict] = []   # each draw's own record this step (task.env: episodes/*)
        # how a draw's problems become samples and rewards, chosen once: one-turn completions or multi-turn episodes
        self._generate = self._episodes if task.env is not None else self._completions

    def draw(self, step: int, draw_round: int, count: int, first_group: int) -> StepSamples:
        """``count`` prompts from the data stream x ``samples_per_prompt`` samples, scored; groups numbered from
        ``first_group``."""
        r = self.cfg.rollout
        problems = self.task.train(self.data_pos, count)
        self.data_pos += len(problems)
        sampling = SamplingParams(n=r.samples_per_prompt, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                                  min_p=r.min_p, logprobs=r.logprobs, max_new_tokens=r.max_new_tokens, ignore_eos=r.ignore_eos,
                                  seed=derive_seed(self.cfg.run.seed, step, draw_round))
        samples, rewards, stats = self._generate(problems, sampling)
        self.draw_stats.append(stats)
        return samples.scored(rewards, first_group)

    def draw_step(self, step: int) -> tuple[StepSamples, dict]:
        """The step's samples. With ``algo.dynamic_sampling`` (DAPO): groups whose rewards are all equal are
        dropped and more prompts drawn (at most ``algo.max_draw_rounds`` rounds) until ``prompts_per_step``
        informative groups are kept; extra groups are trimmed, first drawn first kept. Also the
        ``dynamic_sampling/*`` record (empty without it) and each weighted reward term's mean over every sample drawn
        (``reward/term<i>_<label>``, with two terms or more)."""
        target = self.cfg.rollout.prompts_per_step
        self.draw_stats = []
        self.task.take_reward_terms()   # forget what an evaluation scored: the terms' means are this step's draws
        samples = self.draw(step, 0, target, 0)
        if not self.cfg.algo.dynamic_sampling:
            return samples, {**self.task.take_reward_terms(), **self._draw_record()}
        drawn, rounds = target, 1
        while True:
            kept_samples = samples.select(algos.informative_groups(samples.reward_tensor(), samples.group_tensor()))
            kept = kept_samples.num_groups()
            more = algos.groups_to_draw(target, kept, drawn, max_draw=4 * target)
            if more == 0 or rounds >= self.cfg.algo.max_draw_rounds:
                break
            samples = StepSamples.concat([samples, self.draw(step, rounds, more, drawn)])
            drawn += more
            rounds += 1
        stats = {"dynamic_sampling/drawn_groups": drawn, "dynamic_sampling/kept_groups": min(kept, target),
                 "dynamic_sampling/rounds": rounds, **self.task.take_reward_terms(), **self._draw_record()}
        if kept == 0:  # nothing informative: every advantage is 0, the update is a no-op
            return samples, stats
        every = torch.ones(len(kept_samples), dtype=torch.bool)
        return kept_samples.select(algos.first_groups(kept_samples.group_tensor(), every, target)), stats

    def evaluate(self) -> dict:
        """Held-out accuracy (mean exact-answer reward): ``eval/accuracy`` samples ``run.eval_samples``
        completions per problem at the rollout temperature with a fixed seed (the same keys at every
        eval, so curves compare models, not draws); ``eval/accuracy_greedy`` decodes greedily."""
        problems = self.task.eval_problems()
        if not problems:
            return {}
        started = time.perf_counter()
        r = self.cfg.rollout
        out = {}
        for key, sampling in (
                ("eval/accuracy", SamplingParams(n=self.cfg.run.eval_samples, temperature=r.temperature, top_k=r.top_k,
                                                 top_p=r.top_p, min_p=r.min_p, max_new_tokens=r.max_new_tokens,
                                                 seed=derive_seed(self.cfg.run.seed, -1, 0))),
                ("eval/accuracy_greedy", SamplingParams(n=1, temperature=0.0, max_new_tokens=r.max_new_tokens))):
            with use_profile(self.cfg.run.profile):
                rewards = self._generate(problems, sampling)[1]
            out[key] = sum(1.0 for x in rewards if x >= 1.0) / len(rewards)
            if self.task.env is not None:
                out[key.replace("accuracy", "return")] = sum(rewards) / len(rewards)
        out["time/eval_s"] = time.perf_counter() - started
        return out

    def _draw_record(self) -> dict:
        """The step's first draw's own record (task.env: ``episodes/*``; empty without an env)."""
        return dict(self.draw_stats[0]) if self.draw_stats else {}

    def _completions(self, problems, sampling) -> tuple[StepSamples, list[float], dict]:
        """One turn: (the completions, each DP rank generating a share and every rank getting all; each completion's
        reward; no record of its own)."""
        samples = generate_sharded(self.engine, self._prompts(problems), sampling, self.dp)
        return samples, self._rewards(problems, samples), {}

    def _episodes(self, problems, sampling) -> tuple[StepSamples, list[float], dict]:
        """``task.env``: (the episodes as samples, each episode's return, their ``episodes/*`` record)
        (:mod:`rlalign.train.multiturn`)."""
        return multiturn.draw_episodes(self.engine, self.task, self.tokenizer, problems, sampling,
                                       multiturn.limits_of(self.cfg))

    def _prompts(self, problems) -> list[list[int]]:
        return [self.task.encode(p.prompt) for p in problems]

    def _rewards(self, problems, samples: StepSamples) -> list[float]:
        """Each sample's reward: its decoded completion scored against its prompt's problem."""
        texts = [self.tokenizer.decode(tokens) for tokens in samples.completion_token_lists()]
        return self.task.score([problems[i] for i in samples.prompt_index.tolist()], texts)


__all__ = ["Sampler"]
