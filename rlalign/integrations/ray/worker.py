"""The rollout worker: a Ray actor holding one rollout engine (``rollout.engine``) and its own policy copy."""

from __future__ import annotations

import dataclasses
import inspect

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import use_profile
from rlalign.integrations.ray.errors import RayLaunchError
from rlalign.integrations.ray.weight_sync import open_group, receive_into
from rlalign.train.engines import build_rollout_engine
from rlalign.train.setup import load_policy


class RolloutWorker:
    """Built on its node from the run's config (the same checkpoint the trainer loads); its weights are
    then overwritten by the trainer's before the first rollout, so the two never start apart."""

    def __init__(self, cfg, index: int, threads: int):
        torch.set_num_threads(threads)
        self.index, self.cfg, self.group = index, cfg, None
        self.setup_error = None
        try:
            self._build(cfg)
        except RLAlignError as exc:   # Ray keeps only the text of a constructor's error; ready() re-raises this one
            self.setup_error = exc

    def _build(self, cfg) -> None:
        policy, tokenizer, model_dir = load_policy(cfg.model)
        self.device = next(policy.parameters()).device
        self.engine = build_rollout_engine(dataclasses.replace(cfg, launcher="local"), policy, tokenizer, model_dir)
        _check_prompt_indices(self.engine, cfg.rollout.engine)

    def ready(self) -> int:
        if self.setup_error is not None:
            raise self.setup_error
        return self.index

    def generate(self, prompts, sampling, prompt_indices):
        with use_profile(self.cfg.run.profile):
            return self.engine.generate(prompts, sampling, prompt_indices=prompt_indices)

    def load_weights(self, state_dict, version: int) -> int:
        return self.engine.update_weights(state_dict, version=version)

    def join_weight_group(self, host: str, port: int, rank: int, world: int, backend: str) -> None:
        self.group = open_group(host, port, rank, world, backend)

    def receive_weights(self, meta, version: int) -> int:
        return self.engine.update_weights(receive_into(self.group, meta, self.device), version=version)


def _check_prompt_indices(engine, name: str) -> None:
    """Splitting a step's prompts across workers keeps every sample's seed only if the engine takes the
    prompts' global indices; an engine that cannot is refused rather than silently resampled."""
    if "prompt_indices" not in inspect.signature(engine.generate).parameters:
        raise RayLaunchError(f"rollout.engine={name} cannot run under launcher=ray: its generate() takes no "
                             "prompt_indices, which keep sample seeds global when prompts are split across workers")
