"""Registers the portable profile's implementations as backend ``portable`` (forward only) and owns its refusal.

Every registered op refuses autograd (one line: the portable profile has no backward); an op with no portable
implementation (MoE, tensor-parallel shards, sampled log-probs, ...) fails closed in
:func:`rlalign.ops._dispatch.strict_impl` -- never a fallback to the strict or native implementation.
"""

from __future__ import annotations

import functools

import torch

from rlalign.contract.errors import fail
from rlalign.ops._registry import register
from rlalign.ops.portable import attention, dense, logprob, sample

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


for _op, _fn in (("linear", dense.linear), ("linear_group", dense.linear_group), ("rms_norm", dense.rms_norm),
                 ("rope", dense.rope), ("silu_mul", dense.silu_mul), ("rope_write_kv", dense.rope_write_kv),
                 ("attention_varlen", attention.attention_varlen), ("attention_paged", attention.attention_paged),
                 ("logprob_entropy", logprob.logprob_entropy), ("lm_logits", logprob.lm_logits),
                 ("sample", sample.sample)):
    register(_op, BACKEND)(_forward_only(_op, _fn))
