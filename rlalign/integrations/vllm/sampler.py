"""The sampler hook: vLLM's ``Sampler.forward`` samples rlalign's way when the rlalign model produced the logits.

For the rows of one step (one per running request), with h the final hidden row the rlalign model
left in :data:`~rlalign.integrations.vllm.model.PENDING`, s the request's seed
(``SamplingParams(seed=s)``), p the position the new token takes, T its temperature:

    token, logprob = ops.sample_and_score(h, W, seeds=s, positions=p, temperature=T, top_k, top_p,
                                          logits=logits)

the one owner of sample-and-score that rlalign's rollout engine calls too (so tokens match it for a
sequence with per-sample seed s), whose logprob is the op the trainer runs on the same hidden row
(so logprobs match the trainer bit for bit). vLLM's request-level logits transforms (penalties, bad words,
allowed token ids, logit bias, min_tokens, min_p, ...) and top-k alternative logprobs are refused.
Logits vLLM masked in place before the sampler (structured output) are sampled as masked.
"""

from __future__ import annotations

import torch

from rlalign import ops
from rlalign.contract.profiles import use_profile
from rlalign.integrations.vllm.errors import UnsupportedVLLMConfigError
from rlalign.integrations.vllm.model import MODELS_BUILT, PENDING, PendingSample

_SAMPLING_EPS = 1e-5        # vLLM's: temperatures below it are greedy
_ORIGINAL = "_rlalign_original_forward"


_ORIGINAL_LOGPROBS = "_rlalign_original_compute_logprobs"


def install() -> None:
    """Route ``Sampler.forward`` through :func:`_forward` and ``Sampler.compute_logprobs`` (vLLM's
    prompt-logprob path) through :func:`_compute_logprobs` (idempotent)."""
    from vllm.v1.sample.sampler import Sampler  # lazy: optional, heavy
    if getattr(Sampler, _ORIGINAL, None) is None:
        setattr(Sampler, _ORIGINAL, Sampler.forward)
        setattr(Sampler, _ORIGINAL_LOGPROBS, Sampler.compute_logprobs)
        Sampler.forward = _forward
        Sampler.compute_logprobs = staticmethod(_compute_logprobs)


def uninstall() -> None:
    from vllm.v1.sample.sampler import Sampler  # lazy: optional, heavy
    original = getattr(Sampler, _ORIGINAL, None)
    if original is not None:
        Sampler.forward = original
        Sampler.compute_logprobs = staticmethod(getattr(Sampler, _ORIGINAL_LOGPROBS))
        delattr(Sampler, _ORIGINAL)
        delattr(Sampler, _ORIGINAL_LOGPROBS)


def _forward(self, logits: torch.Tensor, sampling_metadata, predict_bonus_token: bool = False,
             logprobs_mode_override=None):
    pending = PENDING.pop("sample", None)
    ours = pending is not None and pending.logits is logits
    if (ours and pending.warmup) or (not ours and not MODELS_BUILT[0]):
        return getattr(type(self), _ORIGINAL)(self, logits, sampling_metadata, predict_bonus_token,
                                              logprobs_mode_override)
    if not ours or pending.positions is None:
        raise UnsupportedVLLMConfigError("vLLM's sampler got logits that are not one row per sequence of the rlalign "
                                         "model's last forward (speculative decoding, pipeline parallelism or another "
                                         "feature that re-samples logits is not supported)")
    return strict_sample(self, pending, sampling_metadata)


def _compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    pending = PENDING.get("sample")
    if pending is not None and pending.logits is logits and not pending.warmup:
        raise UnsupportedVLLMConfigError("prompt_logprobs is not supported (vLLM would compute them with its own "
                                         "log_softmax, not bitwise): score prompts with rlalign's trainer forward")
    return getattr(_sampler_class(), _ORIGINAL_LOGPROBS)(logits)


def _sampler_class():
    from vllm.v1.sample.sampler import Sampler  # lazy: optional, heavy
    return Sampler


def strict_sample(sampler, pending: PendingSample, meta):
    from vllm.v1.outputs import SamplerOutput  # lazy: optional, heavy

    _refuse_transforms(sampler, pending.logits, meta)
    rows = pending.logits.shape[0]
    dev = pending.logits.device
    temperature = _temperatures(meta, rows, dev)
    seeds = _seeds(meta, temperature)
    with use_profile(pending.profile):
        tokens, logprobs = ops.sample_and_score(pending.hidden, pending.lm_head_weight, seeds=seeds,
                                                positions=pending.positions, temperature=temperature,
                                                top_k=_top_k(meta, rows, dev), top_p=_top_p(meta, rows, dev),
                                                logits=pending.logits, with_logprobs=meta.max_num_logprobs is not None)
    return SamplerOutput(sampled_token_ids=tokens.to(torch.int32).unsqueeze(-1),
                         logprobs_tensors=_logprobs_tensors(pending.logits, tokens, logprobs))


def _logprobs_tensors(logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor | None):
    """vLLM's sampled-token-only logprobs (``SamplingParams(logprobs=0)``); rank from the fp32 logits."""
    if logprobs is None:
        return None
    from vllm.v1.outputs import LogprobsTensors  # lazy: optional, heavy
    chosen = logits.gather(1, tokens.unsqueeze(1))
    ranks = (logits > chosen).sum(dim=1) + 1
    return LogprobsTensors(tokens.to(torch.int32).unsqueeze(1), logprobs.unsqueeze(1), ranks)


# ---- per-row parameters -----------------------------------------------------------------------------------

def _temperatures(meta, rows: int, dev) -> torch.Tensor:
    """fp32 [R]; 0 = greedy (vLLM: all_greedy, or a temperature below its epsilon)."""
    if meta.all_greedy or meta.temperature is None:
        return torch.zeros(rows, dtype=torch.float32, device=dev)
    t = meta.temperature[:rows].to(torch.float32)
    return torch.where(t < _SAMPLING_EPS, torch.zeros_like(t), t)


def _seeds(meta, temperature: torch.Tensor) -> torch.Tensor:
    seeds = torch.zeros(temperature.shape[0], dtype=torch.int64)
    for i, greedy in enumerate((temperature == 0).tolist()):
        gen = meta.generators.get(i)
        if gen is not None:
            seeds[i] = _as_int64(gen.initial_seed())
        elif not greedy:
            raise UnsupportedVLLMConfigError("a sampled request has no seed: the strict sampler keys its random "
                                             "numbers by (seed, position); pass SamplingParams(seed=...)")
    return seeds.to(temperature.device)


def _as_int64(seed: int) -> int:
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def _top_k(meta, rows: int, dev):
    if meta.top_k is None:
        return 0
    k = meta.top_k[:rows].to(torch.int64).to(dev)
    return torch.where(k < 0, torch.zeros_like(k), k)


def _top_p(meta, rows: int, dev):
    return 1.0 if meta.top_p is None else meta.top_p[:rows].to(torch.float32).to(dev)


# ---- refusals ------------------------------------------------------------------------------------------------

def _refuse_transforms(sampler, logits: torch.Tensor, meta) -> None:
    if meta.max_num_logprobs not in (None, 0):
        raise UnsupportedVLLMConfigError(f"logprobs={meta.max_num_logprobs} is not supported: only the sampled "
                                         "token's logprob is computed bitwise (use SamplingParams(logprobs=0))")
    if meta.logprob_token_ids:
        raise UnsupportedVLLMConfigError("logprob_token_ids is not supported (use SamplingParams(logprobs=0))")
    if any(getattr(meta, "spec_token_ids", None) or ()):
        raise UnsupportedVLLMConfigError("speculative decoding is not supported")
    # Anything else vLLM would do to the logits (penalties, bad words, allowed token ids, logit bias,
    # min_tokens, min_p, thinking budgets, custom processors) shows as a change to a copy of them.
    probe = logits.clone()
    probe = sampler.apply_logits_processors(probe, meta, False)
    for processor in meta.logitsprocs.argmax_invariant:
        probe = processor.apply(probe)
    if not torch.equal(probe, logits):
        raise UnsupportedVLLMConfigError("a request uses a logits transform (repetition/frequency/presence penalty, "
                                         "bad_words, allowed_token_ids, logit_bias, min_tokens, min_p or a logits "
                                         "processor); the strict sampler supports temperature, top_k and top_p only")
