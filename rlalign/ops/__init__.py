"""rlalign.ops: every op the models use, each honouring the strict contract or failing closed.

Functional API (the only way models and engines compute):

    linear, rms_norm, rope, rope_inv_freq, rope_cos_sin, silu_mul, embedding   (ops.basic)
    attention_varlen, attention_paged, write_kv_cache                          (ops.attention)
    logprob_entropy, lm_logits                                                 (ops.logprob)
    sample                                                                     (ops.sample)
    router_logits, moe_route, moe_experts, moe_combine, load_balancing_loss    (ops.moe)

Each takes ``profile=`` (``"strict"`` | ``"native"`` | None for the current context, see
:func:`rlalign.contract.use_profile`).
"""

from rlalign.ops.basic import embedding, linear, rms_norm, rope, rope_cos_sin, rope_inv_freq, silu_mul
from rlalign.ops.attention import attention_paged, attention_varlen, write_kv_cache
from rlalign.ops.logprob import lm_logits, logprob_entropy
from rlalign.ops.sample import sample
from rlalign.ops.moe import load_balancing_loss, moe_combine, moe_experts, moe_route, router_logits

__all__ = [
    "linear", "rms_norm", "rope", "rope_inv_freq", "rope_cos_sin", "silu_mul", "embedding",
    "attention_varlen", "attention_paged", "write_kv_cache",
    "logprob_entropy", "lm_logits", "sample",
    "router_logits", "moe_route", "moe_experts", "moe_combine", "load_balancing_loss",
]
