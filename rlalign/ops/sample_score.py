"""Sample-and-score: the one place a rollout computes a sampled token and the log-prob it reports.

For every row i, with h_i the final hidden row of its sequence, W the LM head, s_i the per-sample
seed, p_i the absolute position the new token takes, T_i / top_k_i / top_p_i its sampling settings:

    logits_i  = ops.lm_logits(h_i, W)                                   fp32, temperature 1
    token_i   = ops.sample(logits_i, seeds=s_i, seq_ids=s_i, positions=p_i,
                           temperature=T_i, top_k=top_k_i, top_p=top_p_i)
    logprob_i = ops.logprob_entropy(h_i, W, token_i, temperature=logprob_temperature(T_i))[0]

(the temperature rule, sampling and scoring: :mod:`rlalign.ops.temperature`). With ``logprobs="sampled"`` the
reported log-prob is instead that of the distribution the token was drawn from, the kept set renormalised:

    logprob_i = ops.sampled_logprob(h_i, W, token_i, temperature=T_i, top_k=top_k_i, top_p=top_p_i,
                                    min_p=min_p_i).logprob

(:mod:`rlalign.ops.sampled_logprob`), which the trainer calls on its own hidden rows: the same bits. The invariant this
owns, in the strict profile: ``logprob_i`` is the trainer's op (``CausalLM.logprobs`` /
``head_logprobs`` -> ``ops.logprob_entropy``) on the same hidden row at the same temperature, and a
strict row does not depend on the other rows of a call, so it equals the trainer's packed-forward
logprob of that token bit for bit; ``token_i`` depends only on (logits_i, s_i, p_i, T_i, top_k_i,
top_p_i), never on the batch. Rows are scored in groups of equal logprob temperature, in increasing
order of it (a single call when all rows share one), which changes no bit in strict.

The callers: the rollout engine (:mod:`rlalign.rollout.runner`), the simple generate loop
(:mod:`rlalign.models.generate`) and vLLM's sampler hook (:mod:`rlalign.integrations.vllm.sampler`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlalign.contract.errors import fail
from rlalign.ops import _checks as chk
from rlalign.ops.logprob import lm_logits, logprob_entropy
from rlalign.ops.sample import sample
from rlalign.ops.sampled_logprob import sampled_logprob
# the rule is read from its module at each call, so every user sees one definition (a test plants a wrong one)
from rlalign.ops import temperature as temperature_rule

OP = "sample_and_score"
LOGPROB_MODES = ("full", "sampled")


def sample_and_score(hidden: torch.Tensor, weight: torch.Tensor, *, seeds, positions, temperature=1.0, top_k=0,
                     top_p=1.0, min_p=0.0, logits: torch.Tensor | None = None, with_logprobs: bool = True,
                     score_temperature: float | None = None, logprobs: str = "full",
                     profile=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per row of ``hidden`` [S, H] and score it (module docstring); returns
    (tokens int64 [S], logprobs fp32 [S] or None when ``with_logprobs=False``).

    seeds, positions: int64 [S] tensors or ints (the seed is also the sequence id of the RNG key).
    temperature (0 = greedy), top_k (0 = off), top_p (1 = off): a number, a per-row list, or a [S]
    tensor (fp32 temperature / top_p, int top_k). ``logits``: the rows' ``ops.lm_logits(hidden,
    weight)`` when the caller already has them (vLLM computes them before its sampler and may mask
    tokens in place with -inf: those are then sampled as masked, the logprob stays the policy's);
    computed here otherwise. ``profile`` is passed to every op (None: the current one).

    ``score_temperature``: every row's logprob temperature (``logprob_temperature(T_i)``), when the
    caller knows it is one number: with a [S] tensor ``temperature`` the rows are then scored in one
    call without reading the temperatures on the host (the per-row rule is checked by a device verdict:
    a row whose rule disagrees raises). Required in the static form (inside a CUDA-graph capture or
    ``ops.static_decode()``; the rollout engine's decode graphs), where the op reads nothing on the
    host and allocates no data-dependent shape (``ops.sample``'s static form): the same bits.

    min_p (0 = off): a number, a per-row list or an fp32 [S] tensor (``ops.sample``). ``logprobs``: ``"full"``
    (the full softmax at the logprob temperature, above) or ``"sampled"`` (the kept set's renormalised
    distribution, :func:`rlalign.ops.sampled_logprob`; strict, eager form only).
    """
    if logprobs not in LOGPROB_MODES:
        raise fail(OP, f"logprobs must be one of {LOGPROB_MODES}, got {logprobs!r}")
    chk.ndim(OP, "hidden", hidden, 2)
    rows = hidden.shape[0]
    if logits is None:
        logits = lm_logits(hidden, weight, profile=profile)
    elif logits.dim() != 2 or logits.shape[0] != rows:
        raise fail(OP, f"logits must be [S, V] with one row per hidden row (S = {rows}), got {tuple(logits.shape)}")
    dev = logits.device
    tokens = sample(logits, seeds=seeds, seq_ids=seeds, positions=positions,
                    temperature=_uniform_or_rows("temperature", temperature, rows, torch.float32, dev),
                    top_k=_uniform_or_rows("top_k", top_k, rows, torch.int64, dev),
                    top_p=_uniform_or_rows("top_p", top_p, rows, torch.float32, dev),
                    min_p=_uniform_or_rows("min_p", min_p, rows, torch.float32, dev), profile=profile)
    if not with_logprobs:
        return tokens, None
    if logprobs == "sampled":
        return tokens, _score_sampled(hidden, weight, tokens, rows, temperature, top_k, top_p, min_p, profile)
    if score_temperature is not None:
        _check_score_temperature(temperature, score_temperature, rows, dev)
        return tokens, _score(hidden, weight, tokens, [score_temperature] if rows else [], profile)
    if chk.static_shapes() and isinstance(temperature, torch.Tensor):
        raise fail(OP, "a [S] temperature tensor in the static form (CUDA-graph capture) needs score_temperature= "
                       "(the rows' one logprob temperature): grouping rows by temperature reads them on the host")
    return tokens, _score(hidden, weight, tokens, _logprob_temperatures(temperature, rows), profile)


def _check_score_temperature(temperature, score_temperature: float, rows: int, device) -> None:
    """Every row's logprob temperature (the rule of ops/temperature.py) equals ``score_temperature``:
    on the host for numbers and lists, as a device verdict for a tensor (no host read)."""
    if isinstance(temperature, torch.Tensor):
        rule = torch.where(temperature == 0, 1.0, temperature)   # logprob_temperature, elementwise
        chk.deferred(OP, f"score_temperature={score_temperature} is not every row's logprob temperature "
                         "(T, or 1.0 for greedy rows)", (rule == score_temperature).all())
        return
    wrong = [t for t in set(_logprob_temperatures(temperature, rows)) if t != score_temperature]
    if wrong:
        raise fail(OP, f"score_temperature={score_temperature} but a row's logprob temperature is {wrong[0]} "
                       "(T, or 1.0 for greedy rows); pass score_temperature=None to score rows by their own")


def _score_sampled(hidden, weight, tokens, rows: int, temperature, top_k, top_p, min_p, profile) -> torch.Tensor:
    """Each row's token under its kept-set distribution (``ops.sampled_logprob``, every setting per row)."""
    if chk.static_shapes():
        raise fail(OP, "logprobs='sampled' is scored eagerly (not inside a CUDA-graph capture): the rollout engine "
                       "samples such steps outside its decode graphs")
    dev = tokens.device

    def rows_of(name, value, dtype):
        value = _uniform_or_rows(name, value, rows, dtype, dev)
        return value if isinstance(value, torch.Tensor) else torch.full((rows,), value, dtype=dtype, device=dev)
    return sampled_logprob(hidden, weight, tokens, temperature=rows_of("temperature", temperature, torch.float32),
                           top_k=rows_of("top_k", top_k, torch.int64), top_p=rows_of("top_p", top_p, torch.float32),
                           min_p=rows_of("min_p", min_p, torch.float32), profile=profile).logprob


def _score(hidden, weight, tokens, temps: list[float], profile) -> torch.Tensor:
    """logprob of each row's token at its logprob temperature, one call per distinct temperature."""
    groups = sorted(set(temps))
    if not groups:
        return torch.empty(0, dtype=torch.float32, device=tokens.device)
    if len(groups) == 1:
        return logprob_entropy(hidden, weight, tokens, temperature=groups[0], with_entropy=False, profile=profile)[0]
    out = torch.empty(tokens.shape[0], dtype=torch.float32, device=tokens.device)
    for temp in groups:
        idx = torch.tensor([i for i, t in enumerate(temps) if t == temp], dtype=torch.int64, device=tokens.device)
        out[idx] = logprob_entropy(hidden.index_select(0, idx), weight, tokens.index_select(0, idx), temperature=temp,
                                   with_entropy=False, profile=profile)[0]
    return out


def _logprob_temperatures(temperature, rows: int) -> list[float]:
    """Each row's logprob temperature (the rule of ops/temperature.py on its sampling temperature)."""
    if isinstance(temperature, torch.Tensor):
        values = temperature.expand(rows).tolist() if temperature.dim() == 0 else temperature.tolist()
    elif isinstance(temperature, Sequence):
        values = list(temperature)
    else:
        return [temperature_rule.logprob_temperature(temperature)] * rows   # one number: the rule once
    return [temperature_rule.logprob_temperature(t) for t in values]


def _uniform_or_rows(name: str, value, rows: int, dtype: torch.dtype, device: torch.device):
    """A per-row list as ops.sample takes it: its one value when every row shares it (cheaper), else a
    [S] ``dtype`` tensor on ``device``; a number or a tensor passes through (ops.sample checks them)."""
    if not isinstance(value, Sequence):
        return value
    values = list(value)
    if len(values) != rows:
        raise fail(OP, f"{name} has {len(values)} values for {rows} rows (give one per row, or one number)")
    if values and all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=dtype, device=device)


__all__ = ["sample_and_score"]
