"""Triton backend (CUDA): the strict ops as Triton kernels at vendor speed.

Importing this package registers its implementations with the dispatcher; it raises ImportError
when Triton or a CUDA device is missing (the dispatcher then uses the torch backend). On CUDA an
op this backend does not register raises in strict (no fallback); one named in
``RLALIGN_TRITON_DISABLE`` (comma-separated op names, e.g. ``attention_paged,sample``) runs on the
torch backend instead -- a debugging switch: cuBLAS on an H200 breaks properties the torch backend
relies on, so the contract is not guaranteed for those ops. Set it for both engines of a run alike. Ops that
must agree bit for bit go together (``_registry.SAME_BACKEND``: naming ``rope`` also disables ``rope_write_kv``,
and the other way round).

Kernels: :mod:`.gemm` (linear, LM head GEMMs), :mod:`.attention`, :mod:`.logprob`,
:mod:`.elementwise` (rms_norm, rope, silu_mul, rope_write_kv), :mod:`.sample`, :mod:`.grouped` (the MoE experts'
grouped GEMMs, :mod:`.moe`), :mod:`.route` and :mod:`.combine` (MoE routing and combine), :mod:`.gated_delta` (Gated-DeltaNet's chunked
rule). docs/design/tile-shapes.md
says what was verified on the H200 and which tile shapes are bitwise interchangeable.
"""

from __future__ import annotations

import os

try:
    import torch
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the machine
    raise ImportError(f"rlalign triton backend: triton is not importable ({exc})") from exc

# Under the CPU interpreter (TRITON_INTERPRET=1, the CI's indexing tests) the kernels import but
# nothing is registered: strict ops on CPU tensors always use the torch backend.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not torch.cuda.is_available() and not _INTERPRET:
    raise ImportError("rlalign triton backend: no CUDA device")

from rlalign import envvars  # noqa: E402
from rlalign.ops._registry import disabled_ops, register  # noqa: E402
from rlalign.ops.triton_backend import (attention, combine, elementwise, gated_delta, linear, logprob, moe,  # noqa: E402
                                        route, sample, shard)

IMPLEMENTATIONS = {
    "linear": linear.linear,
    "linear_group": linear.linear_group,
    "rms_norm": elementwise.rms_norm,
    "rope": elementwise.rope,
    "rope_write_kv": elementwise.rope_write_kv,
    "silu_mul": elementwise.silu_mul,
    "attention_varlen": attention.attention_varlen,
    "attention_paged": attention.attention_paged,
    "logprob_entropy": logprob.logprob_entropy,
    "lm_logits": logprob.lm_logits,
    "sample": sample.sample,
    # routing: one kernel per token with the torch formulation's arithmetic (a power-of-two number of
    # experts; other widths run the torch formulation, which is elementwise + a written-out tree: strict on
    # CUDA as it stands)
    "moe_route": route.route,
    "moe_expert_ffn": moe.expert_ffn,
    "moe_experts": moe.experts,          # the dispatch kernel + the grouped FFN (ops.moe_experts, strict)
    "moe_combine": combine.combine,
    "delta_chunks": gated_delta.delta_chunks_forward,   # Gated-DeltaNet's chunked rule (ops.gated_delta)
    "delta_chunks_backward": gated_delta.delta_chunks_backward,
    **shard.IMPLEMENTATIONS,   # tensor-parallel shard entries (rlalign.ops.shard)
}
DISABLED = disabled_ops(envvars.read("RLALIGN_TRITON_DISABLE"))

if torch.cuda.is_available():
    for _op, _fn in IMPLEMENTATIONS.items():
        if _op not in DISABLED:
            register(_op, "triton")(_fn)
