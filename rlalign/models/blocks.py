"""The decoder's math, once: functional per-block cores shared by ``CausalLM`` and the transformers patch.

Each core takes the module that holds the weights (duck-typed: rlalign's own modules, or Hugging
Face modules whose ``forward`` the patch has rebound to rlalign ops) and the token-major packed
rows [T, ...]; engines differ only in ``attend`` (how q/k/v meet: packed varlen, paged KV cache,
transformers' AttentionInterface) and in how their inputs are laid out. Boundary taps are made
here, under the names of :mod:`rlalign.models.taps`.

Per layer (stream dtype = parameter dtype):

    x, r  = input_layernorm(h, residual=r)              # fused: h + r rounded once, then RMSNorm
    q,k,v = q_proj(x), k_proj(x), v_proj(x)              # biases only where config.qkv_bias
    q,k   = q_norm(q), k_norm(k)                         # only where config.qk_norm, over head_dim
    q,k   = rope(q, cos, sin), rope(k, cos, sin)          # paged: rope_write_kv (the norms too; writes k, v to the cache)
    a     = attend(q, k, v)                              # causal, scale = head_dim ** -0.5 (a window, sinks: gpt-oss)
    h     = o_proj(a)                                    # canonical K partition
    x, r  = post_attention_layernorm(h, residual=r)
    h     = ffn(x)                                       # dense: down(silu_mul(gate(x), up(x)))
"""

from __future__ import annotations

from typing import Callable

import torch

from rlalign import ops
from rlalign.models import recompute
from rlalign.models.modules import RMSNorm, project
from rlalign.models.taps import FINAL_NORM, layer_tap, tap

# attend(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], layer index, scale) -> [T, Hq, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


class PagedAttend:
    """Attention through a ForwardBatch's paged KV cache, in two steps per layer: :meth:`rope_write` (rope of
    q and k, and the rotated k and v written to the layer's cache: one ``ops.rope_write_kv`` call, one kernel
    on the Triton backend), then the call (paged attention over the cache)."""

    def __init__(self, batch):
        self.batch = batch

    def rope_write(self, q, k, v, cos, sin, layer: int, qk_norm=None) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch
        return ops.rope_write_kv(q, k, v, cos, sin, b.kv_cache.k[layer], b.kv_cache.v[layer], b.slot_mapping,
                                 qk_norm=qk_norm)

    def __call__(self, q, k, v, layer: int, scale: float, **window_sinks) -> torch.Tensor:
        b = self.batch
        return ops.attention_paged(q, b.kv_cache.k[layer], b.kv_cache.v[layer], b.block_table, b.seq_lens,
                                   b.cu_seqlens, scale=scale, **window_sinks)


class PackedAttend:
    """Attention over a packed ForwardBatch (``ops.attention_varlen``: whole sequences, no cache)."""

    def __init__(self, batch):
        self.batch = batch

    def __call__(self, q, k, v, layer: int, scale: float, **window_sinks) -> torch.Tensor:
        return ops.attention_varlen(q, k, v, self.batch.cu_seqlens, scale=scale, **window_sinks)


def batch_attend(batch) -> PackedAttend | PagedAttend:
    """Attention over a ForwardBatch: packed varlen, or its paged KV cache; ``.batch`` is the batch (what a token
    mixer that keeps other per-sequence state, Gated-DeltaNet, reads)."""
    return PagedAttend(batch) if batch.kv_cache is not None else PackedAttend(batch)


def rope_inv_freq(config) -> torch.Tensor:
    """float64 inverse frequencies of ``config``'s rope (over ``rope_head_dim`` where only part of a head rotates, MLA),
    on the CPU whatever the default device (a model built under a meta-device context must still get real tables;
    callers copy them to the batch's device)."""
    with torch.device("cpu"):
        return ops.rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)


def attention_block(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, *, layer: int,
                    num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: bool,
                    window: int | None = None) -> torch.Tensor:
    """o_proj(attend(rope(norm(q)), rope(norm(k)), v)) of rows ``x`` [T, hidden]; ``attn`` holds
    q_proj/k_proj/v_proj/o_proj (and q_norm/k_norm when ``qk_norm``); head counts are rank-local.
    ``window``: the layer's sliding window; ``attn.sinks`` (when the module has one that is not None): the
    per-head sink logits (gpt-oss); both are passed on to ``attend`` only when set."""
    t = x.shape[0]
    paged = isinstance(attend, PagedAttend)
    # one GEMM at decode sizes (same bits); paged, its outputs may be column views of one tensor (rope_write_kv
    # reads them in place)
    q, k, v = project(x, attn.q_proj, attn.k_proj, attn.v_proj, views=paged)
    q, k, v = q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)
    q_in, k_in = q, k
    fused_norms = paged and qk_norm and _fusable_norms(attn)
    if qk_norm and not fused_norms:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if paged:   # the cache write (and the q/k norms where they are ours) folded into the rope: same bits, same checks
        norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if fused_norms else None
        q, k = attend.rope_write(q, k, v, cos, sin, layer, qk_norm=norms)
    else:
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        if qk_norm:
            _rebuildable_rope(attn.q_norm, q, q_in, cos, sin, "rope(q_norm(q))")
            _rebuildable_rope(attn.k_norm, k, k_in, cos, sin, "rope(k_norm(k))")
    tap(layer_tap(layer, "q"), q), tap(layer_tap(layer, "k"), k), tap(layer_tap(layer, "v"), v)
    sinks = getattr(attn, "sinks", None)
    extra = {**({"window": window} if window is not None else {}), **({"sinks": sinks} if sinks is not None else {})}
    out = attend(q, k, v, layer, head_dim ** -0.5, **extra)
    out = tap(layer_tap(layer, "attn"), out.reshape(t, num_heads * head_dim))
    return tap(layer_tap(layer, "o_proj"), attn.o_proj(out))


def _fusable_norms(attn) -> bool:
    """Whether ``attn``'s q/k norms are rlalign RMSNorms of one eps (what ops.rope_write_kv's qk_norm computes);
    other modules (e.g. a patched Hugging Face model's) are called as they are."""
    return (isinstance(attn.q_norm, RMSNorm) and isinstance(attn.k_norm, RMSNorm)
            and attn.q_norm.eps == attn.k_norm.eps)


def _rebuildable_rope(norm, roped: torch.Tensor, projected: torch.Tensor, cos, sin, name: str) -> None:
    """The roped q (or k) that attention saves is rebuilt from the projection's output, which the q/k norm saves
    for its own backward anyway (as do the rope's tables): ``rope(norm(projected))`` is the forward's two calls
    on the same inputs -- the same bits. Without a q/k norm nothing keeps the projection's output, so there is
    nothing to rebuild from for free (and nothing is registered)."""
    recompute.register(name, roped, lambda: ops.rope(norm(projected), cos, sin), projected, norm.weight, cos, sin)


def dense_ffn_block(mlp, x: torch.Tensor) -> torch.Tensor:
    """down_proj(silu(gate_proj(x)) * up_proj(x)) (silu_mul: one rounding of the product). In training,
    down_proj's saved input is rebuilt from gate and up in the backward (:mod:`rlalign.models.recompute`)."""
    gate, up = project(x, mlp.gate_proj, mlp.up_proj, views=True)   # silu_mul reads strided rows in place
    act = ops.silu_mul(gate, up)
    recompute.register("silu_mul", act, lambda: ops.silu_mul(gate, up), gate, up)
    return mlp.down_proj(act)


def decoder_layer_block(layer, h: torch.Tensor, residual: torch.Tensor | None, attention: Callable, index: int):
    """(h, residual) -> (FFN output, residual stream before the FFN); residual None on layer 0.

    ``layer`` holds input_layernorm / post_attention_layernorm (called as ``norm(x, residual)`` ->
    (normed, x + residual)), ``mlp``; ``attention(x)`` runs the layer's attention block.
    Per-op finiteness errors name the layer (``ops.check_scope``)."""
    with ops.check_scope(f"layers.{index}"), recompute.layer_session():
        return _decoder_layer(layer, h, residual, attention, index)


def _decoder_layer(layer, h, residual, attention, index: int):
    if residual is None:
        x, residual = layer.input_layernorm(h), h
    else:
        x, residual = layer.input_layernorm(h, residual)
    _rebuildable_norm(layer.input_layernorm, x, residual)
    tap(layer_tap(index, "input_norm"), x)
    h = attention(x)
    x, residual = layer.post_attention_layernorm(h, residual)
    _rebuildable_norm(layer.post_attention_layernorm, x, residual)
    tap(layer_tap(index, "post_norm"), x)
    h = tap(layer_tap(index, "mlp"), layer.mlp(x))
    # the residual stream after the attention add; the next norm adds h to it (fused residual)
    tap(layer_tap(index, "residual"), residual)
    return h, residual


def _rebuildable_norm(norm, normed: torch.Tensor, stream: torch.Tensor) -> None:
    """The norm's output (what q/k/v_proj, gate/up_proj or the router save) is rebuilt from the residual
    stream it normalised: ``norm(h, r)`` rounds h + r once and normalises that sum (``stream``), so
    ``norm(stream)`` is the same call on the same input -- the same bits."""
    recompute.register("rms_norm", normed, lambda: norm(stream), stream, norm.weight)


def final_norm_block(norm, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """Final RMSNorm of the last layer's output plus the residual stream (no layers: of h)."""
    if residual is None:
        return tap(FINAL_NORM, norm(h))
    return tap(FINAL_NORM, norm(h, residual)[0])


__all__ = ["Attend", "PackedAttend", "PagedAttend", "batch_attend", "rope_inv_freq", "attention_block", "dense_ffn_block", "decoder_layer_block", "final_norm_block"]
