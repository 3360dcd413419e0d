"""Strict attention on the torch backend: packed varlen (training) and paged KV (rollout).

Both entry points run the same per-row arithmetic, so a query's output has the same bits in a
packed training forward, a one-shot or chunked prefill, and step-by-step decode:

* Work items. Each sequence's query rows, one row per (query token, query head), are grouped by
  kv head (GQA: the ``g = Hq // Hkv`` heads of one kv head, token-major) and cut into tiles of
  exactly ``ATTN_Q_TILE`` = 16 rows, zero-padded. An item is one (sequence, kv head, tile).
* Keys are visited in blocks of ``ATTN_KV_BLOCK`` = 64 ABSOLUTE positions (0..63, 64..127, ...),
  whatever the page size. Per key block j, for all items that need it at once (Python loops over
  j and over chunks of items only; chunks bound memory, a bmm item's bits do not depend on them):

      s     = bmm(Q_tile[16, D], K_j^T[D, 64]) * scale                          (fp32)
      s     = where(key_pos <= row_pos, s, -inf)      K_j / V_j rows outside the context are 0
      m'    = max(m, rowmax(s));  p = exp(s - m');  alpha = exp(m - m')
      l'    = l * alpha + tree_sum(p)
      acc'  = acc * alpha + bmm(p[16, 64], V_j[64, D])                          (fp32)
      (m, l, acc) = where(row_pos >= 64 j, (m', l', acc'), (m, l, acc))

  A block a row cannot see at all leaves its state untouched (selected, not multiplied by 1).
* Sliding window w (gpt-oss): the mask is also key_pos > row_pos - w, and ``sees`` also asks that the block
  holds a key of the window; the blocks stay on the absolute grid. Sinks: after the last block the head's sink
  logit s joins as one more step, m' = max(m, s), l' = l exp(m - m') + exp(s - m'), acc' = acc exp(m - m').
  Both run the torch formulation only (:mod:`.formula`), for packed, prefill and decode alike.
* out = acc / l + 0.0, rounded once to the input dtype. The ``+ 0.0`` maps -0.0 to +0.0 and
  changes nothing else: keys past a row's position but inside the block contribute 0 * V, whose
  sign of zero depends on whether V is a real row (packed forward) or a masked 0 (decode).

What is left to the libraries (a bmm of fixed per-item shapes gives an item the same bits whatever
its index, the row's position in the tile and the other rows; exp is position invariant) is listed
in :func:`rlalign.contract.spec.cpu_backend_assumptions` and checked by ``rlalign doctor``. On the
CPU the bmm batch count may vary too (MKL, checked); the row invariance of the bmm is checked per
shape and thread count before first use, and the shapes where the library breaks it (p @ v at narrow
D) run the compiled row kernel per item (:mod:`.gemms`). On GPUs every bmm is padded to one fixed
batch count, because cuBLAS chooses kernels by batch count.

This package's entry points (:func:`attention_varlen`, :func:`attention_paged`) pick the route; the rooms:

* :mod:`.formula` -- the formula above with torch ops (the reference; GPUs and the CPU);
* :mod:`.compiled` -- the same arithmetic row by row in csrc/attention.c (CPU), used for a head_dim only
  after reproducing the formulation's bits on it;
* :mod:`.gemms` -- the formulation's batched GEMMs on the CPU: the library's bmm where it is row invariant
  for the shape here (checked), else the compiled row kernel per item;
* :mod:`.plan` -- speed only (no bit depends on it): the index work of a call (tiles, their order, key
  rows, masks), a plan built once per forward from the batch's index tensors (``chk.memo``: every layer
  passes the same ones);
* :mod:`.scratch` -- on the CPU the big temporaries are per-thread scratch buffers;
* :mod:`.backward` -- the varlen backward (:class:`_VarlenAttention`) recomputes probabilities flash-style
  from the saved log-sum-exp; it is deterministic run to run (fixed-shape GEMMs, no atomics, no
  index_add) but, like dW of a linear, not invariant to how sequences are packed;
* :mod:`.compiled_backward` -- the backward's length buckets row by row in csrc/attention.c (CPU), for the
  buckets whose GEMM shapes the kernel reproduces, after a bit-for-bit self-check per head_dim, GQA group and
  thread count; the other buckets run :mod:`.backward`'s formulation.
"""

from __future__ import annotations

import torch

from rlalign.ops._registry import register
# the compiled route and the formulation are looked up at each call (the tests swap in instrumented versions)
from rlalign.ops.torch_backend.attention import compiled, compiled_backward, formula
from rlalign.ops.torch_backend.attention.backward import varlen_backward


def _varlen_forward(q, k, v, cu_seqlens, scale: float, window: int | None = None, sinks: torch.Tensor | None = None):
    """Returns (out [T, Hq, D] in q.dtype, lse [T, Hq] fp32, sink-inclusive). A sliding window or sinks run the
    torch formulation (the compiled kernels implement neither): the same route for packed, prefill and decode."""
    t, hq, d = q.shape
    if t == 0:
        return q.new_empty(q.shape), q.new_empty((0, hq), dtype=torch.float32)
    if window is None and sinks is None and compiled.compiled_applies(q.device, d):
        return compiled.varlen_compiled(q, k, v, cu_seqlens, scale)
    return formula.varlen_formula(q, k, v, cu_seqlens, scale, window, sinks)


class _VarlenAttention(torch.autograd.Function):
    """The varlen forward with its flash-style backward (:mod:`.backward`); sinks get a gradient too."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, window, sinks):
        out, lse = _varlen_forward(q, k, v, cu_seqlens, scale, window, sinks)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, sinks)
        ctx.scale, ctx.window = scale, window
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = varlen_backward(q, k, v, out, lse, cu_seqlens, grad_out.contiguous(), ctx.scale,
                                             ctx.window, sinks, bucket_route=compiled_backward.bucket_compiled)
        return dq, dk, dv, None, None, None, dsinks


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """x with zero head columns appended up to ``width`` (x itself when already that wide)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Strict causal varlen attention (inputs validated by :func:`rlalign.ops.attention_varlen`).

    V of another head width than Q and K: the narrower side gets zero columns up to the wider (zero q.k
    products and zero output columns, dropped; the same padding in every path, so the paths still agree bit for
    bit), through autograd."""
    if v.shape[-1] != q.shape[-1]:
        width = max(q.shape[-1], v.shape[-1])
        out = attention_varlen(_widen(q, width), _widen(k, width), _widen(v, width), cu_seqlens, scale, window,
                               sinks)
        return out[..., :v.shape[-1]].contiguous()
    grads = [q, k, v] + ([sinks] if sinks is not None else [])
    if torch.is_grad_enabled() and any(x.requires_grad for x in grads):
        return _VarlenAttention.apply(q, k, v, cu_seqlens, scale, window, sinks)
    return _varlen_forward(q, k, v, cu_seqlens, scale, window, sinks)[0]


# ---- paged (rollout) --------------------------------------------------------------------------------

def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Strict paged attention (inputs validated by :func:`rlalign.ops.attention_paged`).

    Non-finite K/V inside a context are detected on the way (score and accumulator checks) and
    raise; the rest of the cache is never read into the math (masked to exact zeros). A v_cache of another head
    width than k_cache: widened as :func:`attention_varlen` does (a padded copy of the narrower cache per call:
    the reference's route, not a fast one).
    """
    if v_cache.shape[-1] != q.shape[-1]:
        width = max(q.shape[-1], v_cache.shape[-1])
        out = attention_paged(_widen(q, width), _widen(k_cache, width), _widen(v_cache, width), block_table,
                              seq_lens, cu_seqlens_q, scale, window, sinks)
        return out[..., :v_cache.shape[-1]].contiguous()
    t, hq, d = q.shape
    if t == 0:
        return q.new_empty(q.shape)
    if window is not None or sinks is not None:
        return formula.paged_formula(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, window, sinks)
    paged = compiled.paged_compiled if compiled.compiled_applies(q.device, d) else formula.paged_formula
    return paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale)


register("attention_varlen", "torch")(attention_varlen)
register("attention_paged", "torch")(attention_paged)
