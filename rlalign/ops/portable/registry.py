"""Registers the portable profile's implementations as backend ``portable`` and owns its refusal.

The ops a training step runs (linear, linear_group, rms_norm, rope, silu_mul, attention_varlen, logprob_entropy)
are differentiable with a portable backward (:mod:`.grad`); the rollout-only ops (paged attention, the fused
rope + cache write, lm_logits, sample) refuse autograd with one line; an op with no portable
implementation (MoE, tensor-parallel shards, sampled log-probs, ...) fails closed in
:func:`rlalign.ops._dispatch.strict_impl` -- never a fallback to the strict or native implementation.
"""

from __future__ import annotations

import functools

import torch

from rlalign.contract.errors import fail
from rlalign.ops._registry import register
from rlalign.ops.portable import attention, dense, grad, logprob, sample

BACKEND = "portable"


def refusal(op: str, what: str = "") -> Exception:
    """The one-line error for something the portable profile does not implement."""
    return fail(op, f"{what or 'this op'} is not implemented in the portable profile (it covers dense decoder "
                    "forwards in fp32 / bf16 storage: rollout and scoring; docs/portable.md)")


def _forward_only(op: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            raise refusal(op, "the backward pass (autograd)")
        return fn(*args, **kwargs)
    return run


for _op, _fn in (("linear", grad.linear), ("linear_group", grad.linear_group), ("rms_norm", grad.rms_norm),
                 ("rope", grad.rope), ("silu_mul", grad.silu_mul), ("attention_varlen", grad.attention_varlen),
                 ("logprob_entropy", grad.logprob_entropy)):
    register(_op, BACKEND)(_fn)
for _op, _fn in (("rope_write_kv", dense.rope_write_kv), ("attention_paged", attention.attention_paged),
                 ("lm_logits", logprob.lm_logits), ("sample", sample.sample)):
    register(_op, BACKEND)(_forward_only(_op, _fn))
