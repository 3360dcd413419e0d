"""``generate_completions``: the engine behind ``rlalign generate``, a drop-in for :func:`rlalign.models.generate.generate`.

Same arguments, the same :class:`rlalign.models.completion.Completion` fields and, in the strict profile,
the same tokens and logprobs bit for bit: seeds are keyed by the prompt's content
(``SamplingParams.seed_by="content"``), stop tokens default to the model's and tokenizer's eos ids,
and nothing is cut at max_position_embeddings (the simple loop does not cut either).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from rlalign.contract.profiles import current_profile
from rlalign.models.generate import encode_prompt
from rlalign.rollout.config import RolloutConfig, SamplingParams
from rlalign.rollout.engine import RolloutEngine


def generate_completions(model, prompts: Sequence[str] | Sequence[Sequence[int]], *, tokenizer=None, n: int = 1,
                         max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                         seed: int = 0, chat: bool = False, stop_token_ids: Sequence[int] | None = None,
                         page_size: int = 16, config: RolloutConfig | None = None, stop: Sequence[str] = ()):
    """Sample ``n`` completions per prompt with :class:`RolloutEngine`; returned in prompt order, then sample order.

    ``config`` defaults to ``RolloutConfig(page_size=page_size, profile=<current profile>)``.
    ``stop_token_ids`` given: exactly those end a sample; None: the eos ids. ``stop``: stop strings.
    """
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n and max_new_tokens must be >= 1 (got n={n}, max_new_tokens={max_new_tokens})")
    encoded = [encode_prompt(p, tokenizer, chat) for p in prompts]
    if config is None:
        longest = max(len(ids) for ids in encoded) + max_new_tokens
        config = RolloutConfig(page_size=page_size, profile=current_profile().value,
                               max_model_len=max(longest, model.config.max_position_embeddings))
    sampling = SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
                              seed=seed, stop_token_ids=tuple(stop_token_ids or ()),
                              ignore_eos=stop_token_ids is not None, stop=tuple(stop), seed_by="content")
    engine = RolloutEngine(model, config, tokenizer=tokenizer)
    out = []
    for c in engine.generate(encoded, sampling):   # as the simple loop: the prompt's text, "" without a tokenizer
        prompt = prompts[c.prompt_index]
        out.append(dataclasses.replace(c, prompt=prompt if isinstance(prompt, str) else None, text=c.text or ""))
    return out

