"""The rollout engine: continuous batching, paged KV cache with prefix sharing, strict sampling, weight updates.

    engine = RolloutEngine(model, RolloutConfig(profile="strict"), tokenizer=None)
    completions = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=256, seed=step))
    engine.update_weights(trainer_model.state_dict())     # between rollouts; bumps engine.weights_version

Every completion's logprobs equal the trainer's packed-forward logprobs bit for bit (strict profile),
and the sampled tokens do not depend on any engine setting (batch size, page size, chunking,
prefix sharing, preemption, request order).
"""

from rlalign.rollout.completions import generate_completions
from rlalign.rollout.config import RolloutConfig, SamplingParams
from rlalign.rollout.engine import RolloutEngine
from rlalign.rollout.errors import (KVCacheTooSmallError, RequestError, RolloutConfigError, RolloutError,
                                    WeightsUpdateError)
from rlalign.rollout.sequence import Completion, StepOutput

__all__ = ["RolloutEngine", "RolloutConfig", "SamplingParams", "Completion", "StepOutput", "generate_completions",
           "RolloutError", "KVCacheTooSmallError", "WeightsUpdateError", "RequestError", "RolloutConfigError"]
