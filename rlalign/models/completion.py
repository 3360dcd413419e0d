"""The one record of a finished sample that every generator in rlalign returns."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Completion:
    """One finished sample, from any generator: the rollout engine (:mod:`rlalign.rollout`), the simple loop
    (:func:`rlalign.models.generate.generate`) or an integration's engine (vLLM).

    tokens: generated ids (a stop token that ended the sample is included); logprobs[i] = log p(tokens[i])
    under softmax(logits / T) at the request's logprob temperature, fp32 values (exact as Python floats).
    finish_reason: "stop" (stop token or string), "length" (max_new_tokens or max_model_len) or "abort".
    stop_reason: the stop token id or stop string that ended it (None otherwise).
    weights_version: the engine's weights version the sample's tokens were sampled with (0 for the simple loop,
    which has no weight updates); with a weight update during the sample (partial rollouts:
    :meth:`rlalign.rollout.RolloutEngine.plan_weight_update`) the version of its first token, and
    ``token_versions`` the version of each token.
    seed: the sample's random stream key (``ops.derive_seed`` of the request seed, prompt and sample index).
    prompt / text: the prompt as text when it was given as text, and the decoded completion when a
    tokenizer was at hand (else None).
    routing: for a mixture-of-experts model whose engine records routing (``RolloutConfig.record_routing``),
    the expert ids every fed row was routed to: int16 [rows, sparse layers, k] (CPU), row p = the token at
    absolute position p; rows = len(prompt_tokens) + len(tokens) - 1 (the last sampled token is never fed;
    an aborted sample has the rows computed before the abort), sparse layers in increasing layer index, each row's k ids in the router's top-k order (best
    first). A row the engine did not compute itself (a prefix-cache hit, a forked sample's shared prompt)
    holds the ids of the forward that wrote those K/V pages: the rows this sample's tokens attended
    through. None for dense models, when not recorded, and from generators that do not record (the simple
    loop, vLLM).
    """

    request_id: str
    prompt_index: int
    sample_index: int
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    weights_version: int
    seed: int
    stop_reason: int | str | None = None
    prompt: str | None = None
    text: str | None = None
    num_preemptions: int = 0
    routing: torch.Tensor | None = None
    token_versions: list[int] | None = None   # per token, only when several weights versions sampled the sample

    def versions(self) -> list[int]:
        """The weights version of each token."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.weights_version] * len(self.tokens)


__all__ = ["Completion"]
