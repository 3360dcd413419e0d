"""Public fused LM head ops: ``logprob_entropy`` (trainer and rollout) and ``lm_logits`` (sampler).

The distribution is softmax(z) with z = (hidden @ weight.T) / temperature.

Strict profile (exact formula in :mod:`rlalign.ops.torch_backend.logprob`):
    logits of one token chunk x one vocab chunk by ``tile_mm`` (fp32 GEMM on fixed 64-row blocks),
    then z = logits / fp32(temperature) in fp32 -- skipped when temperature == 1.0;
    the vocab is reduced in blocks of VOCAB_BLOCK (=1024, the last one shorter) at absolute offsets:
    m_b = max z, s_b = tree_sum(exp(z - m_b)), w_b = tree_sum(exp(z - m_b) * z);
    blocks folded strictly left to right: m' = max(m, m_b), s = s*exp(m - m') + s_b*exp(m_b - m'),
    same for w; lse = m + log(s); logprob = z[target] - lse; entropy = lse - w / s.
    token_chunk / vocab_chunk are rounded UP to multiples of TOKEN_BLOCK (64) / VOCAB_BLOCK and only
    set memory (peak extra O(token_chunk x vocab_chunk); [T, V] is never materialised): a token's
    logprob and entropy do not depend on them, nor on how many tokens share the call or where.
    Backward: custom autograd.Function recomputing the logits chunk by chunk;
    d logprob/dz = onehot - p, d entropy/dz = -p (z - E_p[z]), chained through /temperature and the
    GEMM; dh accumulated over vocab blocks in order, dW over token chunks in order, in fp32; no atomics.

Native profile: the materialising baseline
    logp = log_softmax(hidden.float() @ weight.float().T / temperature); logprob = logp.gather(target);
    entropy = -(exp(logp) * logp).sum(-1).

``weight`` is not scanned for NaN/inf (that would double the cost of a decode step); ``hidden`` is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlalign.contract import spec
from rlalign.contract.errors import fail
from rlalign.contract.profiles import Profile, as_profile
from rlalign.contract.spec import DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK
from rlalign.ops import _checks as chk
from rlalign.ops._dispatch import strict_impl



def logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    temperature: float = 1.0, token_chunk: int | None = None, vocab_chunk: int | None = None,
                    with_entropy: bool = True, profile=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` and entropy under softmax(hidden @ weight.T / temperature).

    hidden [T, H] and weight [V, H] (LM head) in one of bfloat16/float32; targets [T] int64 (int32 is
    accepted and widened). Returns (logprob fp32 [T], entropy fp32 [T] or None when
    ``with_entropy=False``), differentiable w.r.t. hidden and weight. Defaults: token_chunk 1024,
    vocab_chunk 8192 (about 32 MiB of fp32 logits per chunk).
    """
    op = "logprob_entropy"
    _check_shapes(op, hidden, weight)
    check_targets(op, targets, hidden.shape[0], weight.shape[0])
    temperature = check_temperature(op, temperature)
    if as_profile(profile) is Profile.NATIVE:
        return _native_logprob_entropy(hidden, weight, targets, temperature, with_entropy)
    check_strict_inputs(op, hidden, weight, targets)
    tokens = _round_chunk(op, "token_chunk", token_chunk, DEFAULT_TOKEN_CHUNK, spec.TOKEN_BLOCK)
    vocab = _round_chunk(op, "vocab_chunk", vocab_chunk, DEFAULT_VOCAB_CHUNK, spec.VOCAB_BLOCK)
    impl = strict_impl(op, hidden.device)
    return impl(hidden, weight, targets, temperature, tokens, vocab, bool(with_entropy))


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, *, temperature: float = 1.0,
              profile=None) -> torch.Tensor:
    """Materialised fp32 logits [S, V] = (hidden @ weight.T) / temperature for the few rows the sampler needs.

    Strict: exactly the z of :func:`logprob_entropy` (tile_mm in fp32 per default vocab chunk, then
    / fp32(temperature) when temperature != 1.0), so a row's bits equal the logits that
    logprob_entropy reduces for that token. Not differentiable in strict (it feeds the sampler).
    """
    op = "lm_logits"
    _check_shapes(op, hidden, weight)
    temperature = check_temperature(op, temperature)
    if as_profile(profile) is Profile.NATIVE:
        logits = hidden.float() @ weight.float().T
        return logits if temperature == 1.0 else logits / temperature
    check_strict_inputs(op, hidden, weight)
    return strict_impl(op, hidden.device)(hidden, weight, temperature, DEFAULT_VOCAB_CHUNK)


# ---- native baseline ---------------------------------------------------------------------------

def _native_logprob_entropy(hidden, weight, targets, temperature, with_entropy):
    logits = hidden.float() @ weight.float().T
    logp = F.log_softmax(logits / temperature, dim=-1)
    logprob = logp.gather(1, targets.long().unsqueeze(1)).squeeze(1)
    if not with_entropy:
        return logprob, None
    return logprob, -(logp.exp() * logp).sum(-1)


# ---- validation --------------------------------------------------------------------------------

def _check_shapes(op: str, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    chk.ndim(op, "hidden", hidden, 2)
    chk.ndim(op, "weight", weight, 2)
    if hidden.shape[1] != weight.shape[1]:
        raise fail(op, f"hidden has {hidden.shape[1]} features but weight is {tuple(weight.shape)} ([V, H])")
    if weight.shape[0] == 0:
        raise fail(op, "weight has an empty vocabulary (V = 0)")


def check_targets(op: str, targets: torch.Tensor, tokens: int, vocab: int) -> None:
    chk.index_dtype(op, "targets", targets)
    if tuple(targets.shape) != (tokens,):
        raise fail(op, f"targets must be [T] = ({tokens},), got shape {tuple(targets.shape)}")
    bad = ((targets < 0) | (targets >= vocab)).nonzero()
    if bad.numel():
        pos = int(bad[0, 0])
        raise fail(op, f"target id {int(targets[pos])} at position {pos} is outside the vocabulary [0, {vocab})")


def check_temperature(op: str, temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise fail(op, f"temperature must be a Python number, got {type(temperature).__name__}")
    value = float(temperature)
    if not math.isfinite(value) or value <= 0.0:
        raise fail(op, f"temperature must be finite and > 0, got {value}")
    return value


def check_strict_inputs(op: str, hidden, weight, targets=None) -> None:
    chk.dtype_ok(op, hidden, weight)
    chk.same_device(op, hidden, weight, *(() if targets is None else (targets,)))
    chk.finite(op, "hidden", hidden)
    chk.flush()  # results go to the host next: raise for any deferred GPU finiteness failure now


def _round_chunk(op: str, name: str, value, default: int, multiple: int) -> int:
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise fail(op, f"{name} must be a positive int, got {value!r}")
    return -(-value // multiple) * multiple


__all__ = ["logprob_entropy", "lm_logits", "DEFAULT_TOKEN_CHUNK", "DEFAULT_VOCAB_CHUNK"]
