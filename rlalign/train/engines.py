"""Which rollout engine a training run talks to (``rollout.engine``, and ``launcher``).

The trainer needs three things of an engine: ``generate(prompts, sampling) -> list[Completion]``
(completions in prompt-major order, each with ``prompt_index``, ``prompt_tokens``, ``tokens``,
``logprobs``, ``finish_reason``, ``weights_version``), ``update_weights(state_dict, version=)`` and the
``weights_version`` attribute. Every builder returns an object with exactly that surface, holding
its own copy of the policy's weights (the trainer updates it after each optimizer step).

Two registries, filled from above: rlalign's own engine is registered here; the integrations register
theirs when ``rlalign.integrations`` is imported (the ``rlalign`` CLI and the Ray workers do that):
``rollout.engine=vllm`` (:mod:`rlalign.integrations.vllm`) and, for ``launcher=ray``, the pool of Ray
rollout workers (:mod:`rlalign.integrations.ray`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

from rlalign.contract.errors import RLAlignError
from rlalign.models.moe import sparse_layer_indices
from rlalign.rollout.config import RolloutConfig
from rlalign.rollout.engine import RolloutEngine

# rollout.engine name -> builder(cfg, policy, tokenizer, model_dir) of one engine in this process
ENGINES: dict[str, Callable] = {}
# launcher name -> builder(cfg, policy) of the engine the trainer talks to under that launcher (e.g. a pool of
# remote workers, each holding an ENGINES engine); "local" is not here: it builds ENGINES[rollout.engine] directly
LAUNCHER_ENGINES: dict[str, Callable] = {}

INTEGRATIONS_HINT = "the integrations register theirs when rlalign.integrations is imported (the rlalign CLI does)"


class EngineNotRegisteredError(RLAlignError, ValueError):
    """``rollout.engine`` or ``launcher`` names an engine nobody registered in this process."""


def register_engine(name: str, builder: Callable) -> None:
    """Make ``rollout.engine=name`` build its engine with ``builder(cfg, policy, tokenizer, model_dir)``."""
    ENGINES[name] = builder


def register_launcher_engine(launcher: str, builder: Callable) -> None:
    """Make ``launcher=name`` give the trainer ``builder(cfg, policy)`` as its engine."""
    LAUNCHER_ENGINES[launcher] = builder


def rlalign_engine(cfg, policy, tokenizer, model_dir: Path) -> RolloutEngine:
    """rlalign's continuous-batching engine on a deep copy of the policy (``rollout.engine=rlalign``); it records
    MoE routing (``Completion.routing``) when the policy has sparse layers and ``rollout.record_routing``."""
    r = cfg.rollout
    config = RolloutConfig(profile=cfg.run.profile, page_size=r.page_size, max_num_seqs=r.max_num_seqs,
                           max_num_batched_tokens=r.max_num_batched_tokens, kv_cache_bytes=r.kv_cache_bytes,
                           decode_graphs=r.decode_graphs, overlap=r.overlap,
                           record_routing=r.record_routing and bool(sparse_layer_indices(policy.config)))
    return RolloutEngine(copy.deepcopy(policy).eval(), config, tokenizer=tokenizer)


register_engine("rlalign", rlalign_engine)


def build_rollout_engine(cfg, policy, tokenizer, model_dir):
    if cfg.launcher != "local":   # e.g. ray: a pool of actors, each holding one engine built here with launcher=local
        if cfg.launcher not in LAUNCHER_ENGINES:
            raise EngineNotRegisteredError(f"launcher={cfg.launcher} has no registered engine ({INTEGRATIONS_HINT})")
        return LAUNCHER_ENGINES[cfg.launcher](cfg, policy)
    if cfg.rollout.engine not in ENGINES:
        raise EngineNotRegisteredError(f"rollout.engine={cfg.rollout.engine} is not registered in this process "
                                       f"(registered: {', '.join(sorted(ENGINES))}; {INTEGRATIONS_HINT})")
    return ENGINES[cfg.rollout.engine](cfg, policy, tokenizer, Path(model_dir))


__all__ = ["ENGINES", "LAUNCHER_ENGINES", "EngineNotRegisteredError", "register_engine", "register_launcher_engine",
           "rlalign_engine", "build_rollout_engine"]
