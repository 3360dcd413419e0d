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

Native profile: the fast non-deterministic stack's fused loss (what Liger-style trainers run):
    per chunk of ``token_chunk`` tokens, z = (hidden @ weight.T) / temperature with fp32 output
    (bf16 tensor cores with an fp32 result on CUDA, an fp32 GEMM elsewhere), lse = logsumexp(z),
    logprob = z[target] - lse, entropy = lse - sum(softmax(z) * z); backward recomputes z chunk by
    chunk (no [T, V] logits kept, like strict). No vocab blocking, no fixed reduction order.

``weight`` is not scanned for NaN/inf (that would double the cost of a decode step); ``hidden`` is.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from rlalign.contract import spec
from rlalign.contract.errors import fail
from rlalign.contract.profiles import Profile, as_profile
from rlalign.contract.spec import DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK
from rlalign.ops import _checks as chk
from rlalign.ops._dispatch import strict_impl

_log = logging.getLogger(__name__)



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
        tokens = _round_chunk(op, "token_chunk", token_chunk, DEFAULT_TOKEN_CHUNK, spec.TOKEN_BLOCK)
        return _native_logprob_entropy(hidden, weight, targets, temperature, tokens, with_entropy)
    check_strict_inputs(op, hidden, weight, targets)
    tokens = _round_chunk(op, "token_chunk", token_chunk, DEFAULT_TOKEN_CHUNK, spec.TOKEN_BLOCK)
    vocab = _round_chunk(op, "vocab_chunk", vocab_chunk, DEFAULT_VOCAB_CHUNK, spec.VOCAB_BLOCK)
    impl = strict_impl(op, hidden.device, profile)
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
    if as_profile(profile) is Profile.NATIVE:   # bf16 tensor cores into fp32 on CUDA (no widened LM head copy)
        logits = _mm_fp32(hidden, weight.t())
        return logits if temperature == 1.0 else logits / temperature
    check_strict_inputs(op, hidden, weight)
    return strict_impl(op, hidden.device, profile)(hidden, weight, temperature, DEFAULT_VOCAB_CHUNK)


# ---- native baseline ---------------------------------------------------------------------------

def _native_logprob_entropy(hidden, weight, targets, temperature, token_chunk, with_entropy):
    lp, ent = _NativeFusedLogprob.apply(hidden, weight, targets.long(), temperature, token_chunk, bool(with_entropy))
    return lp, (ent if with_entropy else None)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result: bf16/fp16 tensor cores accumulating in fp32 on CUDA (one GEMM, no
    fp32 copies of the operands); an fp32 GEMM of widened operands elsewhere."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype and _mm_out_dtype_ok(a.device,
                                                                                                           a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


@functools.lru_cache(maxsize=None)
def _mm_out_dtype_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.mm(..., out_dtype=float32) runs here (torch >= 2.8 on CUDA), probed once on a
    tiny call with a transposed operand; otherwise the native profile widens the operands (logged)."""
    try:
        a = torch.ones(2, 3, device=device, dtype=dtype)
        ok = bool(torch.mm(a, a.t(), out_dtype=torch.float32).eq(3).all())
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        ok, why = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    else:
        why = "a wrong result on the probe"
    if not ok:
        _log.warning("native logprob_entropy: fp32 GEMMs of widened operands (torch.mm out_dtype=float32 "
                     "unavailable: %s)", why)
    return ok


class _NativeFusedLogprob(torch.autograd.Function):
    """Token-chunked log_softmax + gather (+ entropy) with a recomputing backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, token_chunk, with_entropy):
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if with_entropy else None
        wt = weight.t()
        for a in range(0, n, token_chunk):
            b = min(a + token_chunk, n)
            z = _mm_fp32(hidden[a:b], wt)
            if temperature != 1.0:
                z /= temperature
            lse[a:b] = torch.logsumexp(z, dim=-1)
            lp[a:b] = z.gather(1, targets[a:b, None])[:, 0] - lse[a:b]
            if with_entropy:   # E_p[z]: p * z formed in p's buffer (no third [chunk, V] buffer)
                ent[a:b] = lse[a:b] - torch.exp(z - lse[a:b, None]).mul_(z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, *(() if ent is None else (ent,)))
        ctx.temperature, ctx.token_chunk = temperature, token_chunk
        return lp, (ent if with_entropy else lp.new_zeros(0))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, *rest = ctx.saved_tensors
        ent = rest[0] if rest else None
        n, t = hidden.shape[0], ctx.temperature
        dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        wt = weight.t()
        for a in range(0, n, ctx.token_chunk):
            b = min(a + ctx.token_chunk, n)
            z = _mm_fp32(hidden[a:b], wt)
            if t != 1.0:
                z /= t
            dz = _grad_logits_(z, lse[a:b], None if ent is None else ent[a:b], targets[a:b],
                               None if g_lp is None else g_lp[a:b],
                               None if g_ent is None or not g_ent.numel() else g_ent[a:b])
            if t != 1.0:
                dz /= t
            dz = dz.to(hidden.dtype) if hidden.is_cuda else dz   # the fast stack's bf16 GEMM operands on CUDA
            if dh is not None:
                dh[a:b] = _mm_fp32(dz, weight).to(hidden.dtype)
            if dw is not None:
                dw += _mm_fp32(dz.t(), hidden[a:b])
        return dh, (None if dw is None else dw.to(weight.dtype)), None, None, None, None


def _grad_logits_(z, lse, ent, targets, g_lp, g_ent):
    """d loss / dz for one chunk, written over z (at most one more [chunk, V] buffer):
    d logprob / dz = onehot(target) - p;  d entropy / dz = -p (z - E_p[z]), E_p[z] = lse - entropy;
    so dz = -p (g_lp + g_ent (z - E_p[z])) + onehot(target) g_lp."""
    p = torch.exp(z - lse[:, None])
    if ent is not None and g_ent is not None:
        coef = z.sub_((lse - ent)[:, None]).mul_(g_ent[:, None])       # g_ent (z - E_p[z]), over z
        if g_lp is not None:
            coef.add_(g_lp[:, None])
        dz = coef.mul_(p).neg_()
    else:
        dz = p.mul_(-g_lp[:, None]) if g_lp is not None else p.zero_()
    if g_lp is not None:
        dz.scatter_add_(1, targets[:, None], g_lp[:, None])
    return dz


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
    if chk.static_shapes():   # CUDA-graph capture (the sampler's tokens): a device verdict, no host read
        chk.deferred(op, f"a target id is outside the vocabulary [0, {vocab}) (static form: checked on the device)",
                     ((targets >= 0) & (targets < vocab)).all())
        return
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
