"""rlalign.ops: every op the models use, each honouring the strict contract or failing closed.

Functional API (the only way models and engines compute):

    linear, linear_group, rms_norm, rope, rope_inv_freq, rope_attention_scaling, rope_cos_sin, silu_mul,
    embedding                                                                  (ops.basic)
    stacked_rows: the one tensor of weights laid back to back (what linear_group runs as one GEMM) (ops.stacking)
    attention_varlen, attention_paged, write_kv_cache, rope_write_kv           (ops.attention)
    logprob_entropy, lm_logits                                                 (ops.logprob)
    sample                                                                     (ops.sample)
    sampled_logprob: a token's log-prob under the kept set it was sampled from  (ops.sampled_logprob)
    sample_and_score: a rollout's sampled token and its logprob, the one owner  (ops.sample_score)
    logprob_temperature: the temperature a sampled token is scored at           (ops.temperature)
    router_logits, moe_route, moe_experts, moe_combine                         (ops.moe)
    moe_route_replay: the gate weights of recorded experts (routing replay, native)          (ops.moe)
    moe_route_topk_softmax, clamped_swiglu: gpt-oss's router and expert activation (ops.moe)
    moe_route_grouped_sigmoid: DeepSeek-V3's router (sigmoid, group-limited, bias for the choice)  (ops.moe)
    shared_expert_gate: a shared expert's output times sigmoid of its gate's logit (Qwen3-Next)     (ops.moe)

For CUDA-graph capture (the rollout engine's decode graphs): ``capturing_graph(**hints)`` (the ops record
their deferred finiteness verdicts into the graph), ``requeue_deferred_checks(verdicts)`` after each replay,
``flush_deferred_checks()`` (raise for the first failed verdict); ``static_decode()`` marks a forward as a
static-shape decode step (one query per sequence). ``backend_name(device)`` says which backend
(``torch`` | ``triton``) runs the strict ops there.

Where strict forwards look for NaN/inf (docs/gpu.md, "Finiteness checks"): ``check_policy(device)``
(``"per-op"`` on the CPU, ``"boundary"`` on GPUs; env ``RLALIGN_CHECKS``), ``use_check_policy(policy)``
to force one, ``check_scope(label)`` to name the part of a forward (``layers.3``) in per-op messages.

Each op takes ``profile=`` (``"strict"`` | ``"native"`` | ``"portable"`` | None for the current context, see
:func:`rlalign.contract.use_profile`); ``portable`` runs :mod:`rlalign.ops.portable` (the same bits on the CPU and
on CUDA, forward only) or refuses.
"""

from rlalign.ops._checks import (capturing_graph, check_policy, check_scope, flush as flush_deferred_checks,
                                 requeue as requeue_deferred_checks, static_decode, use_check_policy)
from rlalign.ops._dispatch import backend_name
from rlalign.ops.basic import (embedding, linear, linear_group, rms_norm, rope, rope_attention_scaling, rope_cos_sin,
                              rope_inv_freq, silu_mul)
from rlalign.ops.stacking import stacked_rows
from rlalign.ops.attention import attention_paged, attention_varlen, rope_write_kv, write_kv_cache
from rlalign.ops.logprob import lm_logits, logprob_entropy
from rlalign.ops.sample import sample
from rlalign.ops.sampled_logprob import SampledLogprobs, sampled_logprob
from rlalign.ops.sample_score import sample_and_score
from rlalign.ops.temperature import logprob_temperature
from rlalign.ops.moe import (clamped_swiglu, moe_combine, moe_experts, moe_route, moe_route_grouped_sigmoid,
                             moe_route_replay, moe_route_topk_softmax, router_logits, shared_expert_gate)

__all__ = [
    "linear", "linear_group", "stacked_rows", "rms_norm", "rope", "rope_inv_freq", "rope_cos_sin", "silu_mul",
    "embedding",
    "attention_varlen", "attention_paged", "write_kv_cache", "rope_write_kv",
    "logprob_entropy", "lm_logits", "sample", "sampled_logprob", "SampledLogprobs", "sample_and_score", "logprob_temperature", "backend_name",
    "capturing_graph", "flush_deferred_checks", "requeue_deferred_checks", "static_decode",
    "check_policy", "use_check_policy", "check_scope",
    "router_logits", "moe_route", "moe_experts", "moe_combine", "moe_route_topk_softmax", "clamped_swiglu",
    "moe_route_grouped_sigmoid", "shared_expert_gate", "moe_route_replay",
    "rope_attention_scaling",
]
