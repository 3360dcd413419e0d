"""The rollout engine: continuous batching, paged KV cache with prefix sharing, strict sampling, weight updates.

    engine = RolloutEngine(model, RolloutConfig(profile="strict"), tokenizer=None)
    completions = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=256, seed=step))
    engine.update_weights(trainer_model.state_dict())     # between rollouts; bumps engine.weights_version

Every completion's logprobs equal the trainer's packed-forward logprobs bit for bit (strict profile),
and the sampled tokens do not depend on any engine setting (batch size, page size, chunking,
prefix sharing, preemption, request order).

Names are imported on first use, so ``import rlalign.rollout.benchmark`` (the CLI) does not load torch.
"""

import importlib

_EXPORTS = {
    "RolloutEngine": "engine", "RolloutConfig": "config", "SamplingParams": "config",
    "Completion": "sequence", "StepOutput": "sequence", "generate_completions": "completions",
    "RolloutError": "errors", "KVCacheTooSmallError": "errors", "WeightsUpdateError": "errors",
    "RequestError": "errors", "RolloutConfigError": "errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlalign.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rlalign.rollout.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
