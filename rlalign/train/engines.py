"""Which rollout engine a training run talks to (``rollout.engine``).

The trainer needs three things of an engine: ``generate(prompts, sampling) -> list[Completion]``
(completions in prompt-major order, each with ``prompt_index``, ``prompt_tokens``, ``tokens``,
``logprobs``, ``finish_reason``, ``weights_version``), ``update_weights(state_dict, version=)`` and the
``weights_version`` attribute. Every builder returns an object with exactly that surface, holding
its own copy of the policy's weights (the trainer updates it after each optimizer step).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable


def _rlalign_engine(cfg, policy, tokenizer, model_dir: Path):
    from rlalign.rollout.config import RolloutConfig
    from rlalign.rollout.engine import RolloutEngine

    r = cfg.rollout
    config = RolloutConfig(profile=cfg.run.profile, page_size=r.page_size, max_num_seqs=r.max_num_seqs,
                           max_num_batched_tokens=r.max_num_batched_tokens, kv_cache_bytes=r.kv_cache_bytes,
                           decode_graphs=r.decode_graphs)
    return RolloutEngine(copy.deepcopy(policy).eval(), config, tokenizer=tokenizer)


def _vllm_engine(cfg, policy, tokenizer, model_dir: Path):
    from rlalign.integrations.vllm.engine import build_training_engine
    return build_training_engine(cfg, policy, tokenizer, model_dir)


# name -> builder(cfg, policy, tokenizer, model_dir); integrations add their engines here.
ENGINES: dict[str, Callable] = {"rlalign": _rlalign_engine, "vllm": _vllm_engine}


def build_rollout_engine(cfg, policy, tokenizer, model_dir):
    if cfg.launcher == "ray":  # a pool of Ray actors, each holding one engine built here with launcher=local
        from rlalign.integrations.ray.pool import RolloutPool
        return RolloutPool(cfg, policy)
    return ENGINES[cfg.rollout.engine](cfg, policy, tokenizer, Path(model_dir))
