"""Public attention ops: packed varlen (trainer), paged KV (rollout engine), KV-cache writes.

Strict: keys in blocks of ``ATTN_KV_BLOCK`` absolute positions, queries in tiles of
``ATTN_Q_TILE`` (query, head) rows, fp32 online softmax (see
:mod:`rlalign.ops.torch_backend.attention` for the exact formula; the Triton backend also cuts the
keys into splits of ``ATTN_KV_SPLIT`` absolute positions merged in order, see
:mod:`rlalign.ops.triton_backend.attention`), so a token's output has the same bits in a packed
training forward, a one-shot or chunked prefill and step-by-step decode, whatever the page layout,
page size or the other sequences in the call. A sliding window and attention sinks (gpt-oss: ``window=`` /
``sinks=``) keep that promise on both backends (the Triton backend's paged calls then take its
one-program-per-item launch). Native: packed varlen is one padded SDPA call with an explicit mask; paged on
CUDA is the Triton paged kernel with the window and the sinks where it runs, else the SDPA gather.
Native (the fast non-deterministic baseline), no guarantee: packed varlen runs the flash-attention
varlen kernel (``aten._flash_attention_forward``/``_backward`` with cu_seqlens: no padding) on CUDA
when it is available for the tensors, else one padded ``scaled_dot_product_attention`` call (with a
log line naming why). Paged (decode, and prefill with a block table) on CUDA reads K/V through the page
table inside the Triton backend's paged kernel, with the launch picked from the batch shape and the SM count
(flash-decoding's split of each sequence's keys over several programs when the batch is too small to fill
the GPU): no K/V gather. Elsewhere (CPU, float16/float64, no Triton) it gathers every context into a padded
tensor for one SDPA call (logged on CUDA with the reason). Native's bits may depend on the batch (its size,
the padding, the launch picked): no invariance promise.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from rlalign.contract.errors import fail
from rlalign.contract.profiles import Profile, as_profile
from rlalign.ops import _checks as chk
from rlalign.ops._dispatch import backend_name, probe_failure, strict_impl, triton_available
from rlalign.ops.basic import check_rms_norm, check_rope, rms_norm, rope
from rlalign.ops.torch_backend.elementwise import write_kv_rows

log = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---- validation ------------------------------------------------------------------------------------

def _check_heads(op: str, q: torch.Tensor, hkv: int, d: int) -> None:
    if q.shape[2] != d:
        raise fail(op, f"q head_dim {q.shape[2]} does not match the keys' head_dim {d}")
    if d == 0 or d % 2:
        raise fail(op, f"head_dim must be even and > 0, got {d}")
    if hkv == 0 or q.shape[1] % hkv:
        raise fail(op, f"query heads ({q.shape[1]}) must be a multiple of kv heads ({hkv})")


def _check_dtypes(op: str, strict: bool, *tensors: torch.Tensor) -> None:
    if strict:
        chk.dtype_ok(op, *tensors)
        return
    for t in tensors:
        if t.dtype not in _FLOAT_DTYPES or t.dtype != tensors[0].dtype:
            raise fail(op, f"q/k/v must share one floating dtype, got {[x.dtype for x in tensors]}")


def _check_cu(op: str, name: str, cu: torch.Tensor, total: int) -> list[int]:
    """cu_seqlens: int, 1-D, starts at 0, non-decreasing, ends at ``total``; returns it as a list."""
    chk.index_dtype(op, name, cu)
    chk.ndim(op, name, cu, 1)
    if cu.numel() == 0:
        raise fail(op, f"{name} must have S + 1 >= 1 entries")
    vals = cu.tolist()
    if vals[0] != 0:
        raise fail(op, f"{name}[0] must be 0, got {vals[0]}")
    for s in range(len(vals) - 1):
        if vals[s + 1] < vals[s]:
            raise fail(op, f"{name} must be non-decreasing; {name}[{s + 1}]={vals[s + 1]} < {name}[{s}]={vals[s]}")
    if vals[-1] != total:
        raise fail(op, f"{name}[-1]={vals[-1]} does not match the {total} query tokens")
    return vals


def _check_value_width(op: str, dv: int) -> None:
    if dv == 0:
        raise fail(op, "v's head_dim must be > 0")


def _check_varlen(q, k, v, cu_seqlens, strict: bool) -> None:
    op = "attention_varlen"
    for name, t in (("q", q), ("k", k), ("v", v)):
        chk.ndim(op, name, t, 3)
    if k.shape[:2] != v.shape[:2]:
        raise fail(op, f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, Hkv, D] and [T, Hkv, Dv] with the "
                       "same T and Hkv")
    _check_value_width(op, v.shape[2])
    if q.shape[0] != k.shape[0]:
        raise fail(op, f"q has {q.shape[0]} tokens but k/v have {k.shape[0]}")
    _check_heads(op, q, k.shape[1], k.shape[2])
    _check_dtypes(op, strict, q, k, v)
    chk.same_device(op, q, k, v)
    chk.memo("cu_seqlens", lambda: _check_cu(op, "cu_seqlens", cu_seqlens, q.shape[0]), cu_seqlens,
             extra=(q.shape[0],))
    if strict:
        for name, t in (("q", q), ("k", k), ("v", v)):
            chk.finite(op, name, t)


def _check_tables(op, block_table, seq_lens, cu_seqlens_q, n_queries: int, num_pages: int, page_size: int) -> bool:
    """The paged batch's index tensors (device syncs: run once per forward through chk.memo)."""
    cu = _check_cu(op, "cu_seqlens_q", cu_seqlens_q, n_queries)
    n_seq = len(cu) - 1
    if seq_lens.shape[0] != n_seq or block_table.shape[0] != n_seq:
        raise fail(op, f"seq_lens {tuple(seq_lens.shape)} and block_table {tuple(block_table.shape)} must have "
                       f"S={n_seq} rows (from cu_seqlens_q)")
    lens = seq_lens.tolist()
    pages_needed = [-(-n // page_size) for n in lens]
    for s, n in enumerate(lens):
        if n < cu[s + 1] - cu[s]:
            raise fail(op, f"sequence {s} has {cu[s + 1] - cu[s]} queries but seq_lens[{s}]={n} "
                           "(seq_lens counts the whole context, new queries included)")
        if pages_needed[s] > block_table.shape[1]:
            raise fail(op, f"block_table has {block_table.shape[1]} pages per sequence but sequence {s} "
                           f"needs {pages_needed[s]} (seq_lens={n}, page_size={page_size})")
    if n_seq and max(pages_needed):
        used = torch.arange(block_table.shape[1], device=block_table.device) < torch.tensor(
            pages_needed, device=block_table.device).unsqueeze(1)
        ids = block_table[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
            s, col = (used & ((block_table < 0) | (block_table >= num_pages))).nonzero()[0].tolist()
            raise fail(op, f"block_table[{s}, {col}]={int(block_table[s, col])} is not a page id in "
                           f"[0, {num_pages})")
    return True


def _check_paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, strict: bool) -> None:
    op = "attention_paged"
    chk.ndim(op, "q", q, 3)
    chk.ndim(op, "k_cache", k_cache, 4)
    chk.ndim(op, "v_cache", v_cache, 4)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise fail(op, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be "
                       "[num_pages, page_size, Hkv, D] and [num_pages, page_size, Hkv, Dv] with the same first three")
    _check_value_width(op, v_cache.shape[3])
    num_pages, page_size, hkv, d = k_cache.shape
    if page_size == 0:
        raise fail(op, "page_size must be > 0")
    _check_heads(op, q, hkv, d)
    _check_dtypes(op, strict, q, k_cache, v_cache)
    chk.same_device(op, q, k_cache, v_cache)
    chk.contiguous(op, "k_cache", k_cache)
    chk.contiguous(op, "v_cache", v_cache)
    chk.index_dtype(op, "block_table", block_table)
    chk.ndim(op, "block_table", block_table, 2)
    chk.index_dtype(op, "seq_lens", seq_lens)
    chk.ndim(op, "seq_lens", seq_lens, 1)
    chk.memo("paged_tables", lambda: _check_tables(op, block_table, seq_lens, cu_seqlens_q, q.shape[0], num_pages,
                                                   page_size), block_table, seq_lens, cu_seqlens_q,
             extra=(q.shape[0], num_pages, page_size))
    if strict:
        chk.finite(op, "q", q)


def _check_window_sinks(op: str, q: torch.Tensor, window, sinks, strict: bool) -> int | None:
    """window: None or an int >= 1; sinks: None or a finite [Hq] float tensor on q's device. Strict: the torch
    and the Triton backends (another backend refuses in one line rather than ignore the window or the sinks).
    Native: packed, one padded SDPA call with an explicit mask; paged, :func:`_native_paged_window_sinks`.
    Returns the window (or None)."""
    if window is None and sinks is None:
        return None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise fail(op, f"window must be an integer >= 1 (or None), got {window!r}")
    if sinks is not None:
        if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
            raise fail(op, f"sinks must be [Hq]=[{q.shape[1]}], got {tuple(sinks.shape)}")
        if not sinks.is_floating_point():
            raise fail(op, f"sinks must be floating point, got {sinks.dtype}")
        chk.same_device(op, q, sinks)
    if not strict:
        return window
    backend = backend_name(q.device)
    if backend not in ("torch", "triton"):
        raise fail(op, f"sliding-window / sink attention is not implemented by the {backend} backend's kernels "
                       "(strict runs it on the torch backend: the CPU, or RLALIGN_BACKEND=torch)")
    if sinks is not None:
        chk.finite(op, "sinks", sinks)
    return window


def _checked_slots(op: str, slot_mapping: torch.Tensor, n_slots: int, device) -> torch.Tensor:
    lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
    if lo < 0 or hi >= n_slots:
        raise fail(op, f"slot {lo if lo < 0 else hi} is outside the cache's [0, {n_slots}) slots")
    slots = slot_mapping.to(device=device, dtype=torch.int64)
    if torch.unique(slots).numel() != slots.numel():
        raise fail(op, "slot_mapping writes the same slot twice")
    return slots


def _check_write(op: str, k, v, k_cache, v_cache, slot_mapping, one_width: bool = True) -> None:
    """A KV-cache write's argument checks (write_kv_cache's and rope_write_kv's). ``one_width``: v's head width
    must be k's (rope_write_kv); otherwise V (and v_cache) may have a head width Dv of its own."""
    for name, t in (("k", k), ("v", v)):
        chk.ndim(op, name, t, 3)
    chk.ndim(op, "k_cache", k_cache, 4)
    chk.ndim(op, "v_cache", v_cache, 4)
    same = (k.shape == v.shape and k_cache.shape == v_cache.shape if one_width
            else k.shape[:2] == v.shape[:2] and k_cache.shape[:3] == v_cache.shape[:3])
    if not same:
        raise fail(op, f"k {tuple(k.shape)} / v {tuple(v.shape)} and k_cache {tuple(k_cache.shape)} / "
                       f"v_cache {tuple(v_cache.shape)} must match pairwise")
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]) or tuple(v.shape[1:]) != tuple(v_cache.shape[2:]):
        raise fail(op, f"k/v [T, Hkv, D]={tuple(k.shape)} / {tuple(v.shape)} do not match the caches' "
                       f"[.., .., Hkv, D]={tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise fail(op, f"k/v dtype {k.dtype} differs from the cache dtype {k_cache.dtype} (the copy must be exact)")
    chk.same_device(op, k, v, k_cache, v_cache)
    chk.contiguous(op, "k_cache", k_cache)
    chk.contiguous(op, "v_cache", v_cache)
    chk.index_dtype(op, "slot_mapping", slot_mapping)
    if tuple(slot_mapping.shape) != (k.shape[0],):
        raise fail(op, f"slot_mapping must be [T]=[{k.shape[0]}], got {tuple(slot_mapping.shape)}")


def _cache_slots(op: str, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """slot_mapping as int64 on the cache's device, validated once per forward (in range, no slot twice);
    inside a graph capture the engine has validated it on the host."""
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    return chk.memo("slot_mapping", lambda: _checked_slots(op, slot_mapping, n_slots, k_cache.device), slot_mapping,
                    extra=(n_slots, k_cache.device),
                    capturing=lambda: slot_mapping.to(device=k_cache.device, dtype=torch.int64))


def _check_k(k: torch.Tensor, verdict: torch.Tensor | None = None) -> None:
    """The one owner of "strict refuses a non-finite key written to the KV cache" (every check policy:
    ("write_kv_cache", "k") is a boundary site). ``verdict``: the fused kernel's isfinite(k).all(), if one
    computed it (rope_write_kv on the Triton backend); else chk.finite computes it."""
    chk.finite("write_kv_cache", "k", k, verdict=verdict)


# ---- public ops ------------------------------------------------------------------------------------

def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
                     profile=None) -> torch.Tensor:
    """Causal self-attention over a packed batch -> [T, Hq, Dv] in q's dtype.

    q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] (GQA: query head h uses kv head h // (Hq // Hkv); Dv: V's head
    width, D by default -- MLA's differs; the portable profile takes Dv = D only);
    sequence s is rows cu_seqlens[s]:cu_seqlens[s+1], its tokens at positions 0..len-1.
    out[t, h] = sum_{u <= t} softmax_u(scale * q[t, h] . k[u, h']) v[u, h'], scale = D ** -0.5
    by default. Differentiable (strict backward: flash-style recompute, deterministic).

    ``window`` (int >= 1, sliding-window attention): token t sees only the keys u with t - window < u <= t.
    ``sinks`` [Hq] (learned attention sinks, gpt-oss): one extra logit per query head in the softmax's
    denominator, with no value: softmax_u = exp(s_u) / (sum_u' exp(s_u') + exp(sinks[h])); differentiable.
    Both: strict profile on the torch and the Triton backends (see :func:`_check_window_sinks`).
    """
    strict = as_profile(profile) is not Profile.NATIVE
    _check_varlen(q, k, v, cu_seqlens, strict)
    window = _check_window_sinks("attention_varlen", q, window, sinks, strict)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not strict:
        if window is not None or sinks is not None:
            return _native_varlen_window_sinks(q, k, v, cu_seqlens, scale, window, sinks)
        return _native_varlen(q, k, v, cu_seqlens, scale)
    impl = strict_impl("attention_varlen", q.device, profile)
    if window is None and sinks is None:
        return impl(q, k, v, cu_seqlens, scale)
    return impl(q, k, v, cu_seqlens, scale, window=window, sinks=sinks)


def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, *, scale: float | None = None,
                    window: int | None = None, sinks: torch.Tensor | None = None, profile=None) -> torch.Tensor:
    """Queries of S sequences against a paged KV cache (prefill chunks and decode) -> [T, Hq, Dv].

    k_cache [num_pages, page_size, Hkv, D], v_cache [num_pages, page_size, Hkv, Dv]; block_table [S, max_pages] page ids in order;
    seq_lens[s] = context length INCLUDING the new queries (whose K/V are already in the cache);
    queries of s are rows cu_seqlens_q[s]:cu_seqlens_q[s+1], the last n_s tokens of its context
    (positions seq_lens[s]-n_s .. seq_lens[s]-1), causal. No autograd. ``window`` / ``sinks``: as in
    :func:`attention_varlen` (the same bits as the packed op for every query).
    """
    strict = as_profile(profile) is not Profile.NATIVE
    _check_paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, strict)
    window = _check_window_sinks("attention_paged", q, window, sinks, strict)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    with torch.no_grad():  # documented: no autograd (a q that requires grad gives a plain result)
        if not strict:
            if window is not None or sinks is not None:
                return _native_paged_window_sinks(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale,
                                                  window, sinks)
            return _native_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale)
        impl = strict_impl("attention_paged", q.device, profile)
        if window is None and sinks is None:
            return impl(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale)
        return impl(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, window=window, sinks=sinks)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, profile=None) -> None:
    """In place: token t's k [Hkv, D] / v [Hkv, Dv] go to page slot_mapping[t] // page_size, offset
    slot_mapping[t] % page_size. An exact copy in every profile (dtypes must match).

    Strict refuses a non-finite k (under every check policy): a key with an inf element can get a
    -inf score, which softmax turns into an exact 0 weight -- the value would vanish instead of
    reaching the output where the per-step check looks (docs/gpu.md, "Finiteness checks")."""
    op = "write_kv_cache"
    _check_write(op, k, v, k_cache, v_cache, slot_mapping, one_width=False)
    if slot_mapping.numel() == 0:
        return
    if as_profile(profile) is not Profile.NATIVE:
        _check_k(k)
    write_kv_rows(k, v, k_cache, v_cache, _cache_slots(op, k_cache, slot_mapping))


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                  qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                  profile=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope(q)``, ``rope(k)`` and ``write_kv_cache(rope(k), v, ...)`` as one op -> (rope(q), rope(k)): the
    paged forward's per-layer step before attention. The same bits and the same errors as the three calls:
    rope's and write_kv_cache's argument checks (named ``rope_write_kv``), write_kv_cache's K check (its
    message, its policy, the "write_kv_cache" site). The torch backend runs exactly those (the K check
    before the write); the Triton backend one kernel that rotates q and k, writes k and v to their slots and
    flags a non-finite k (the check's verdict without a pass of its own; the cache is written before a
    deferred verdict is read, as with write_kv_cache on a GPU). Native: ``rope`` and ``write_kv_cache``.

    ``qk_norm`` = (q weight, k weight, eps): q and k are first ``rms_norm``-ed over the head dim (Qwen3's
    q_norm / k_norm) -- the bits and the checks of the two rms_norm calls (their argument checks and input
    finiteness checks, named ``rms_norm``); the Triton backend normalises in the same launch."""
    op = "rope_write_kv"
    strict = as_profile(profile) is not Profile.NATIVE
    if qk_norm is not None and not strict:
        q = rms_norm(q, qk_norm[0], qk_norm[2], profile=profile)
        k = rms_norm(k, qk_norm[1], qk_norm[2], profile=profile)
        qk_norm = None
    if qk_norm is not None:   # strict: checked as the two rms_norm calls would be, before the rope's checks
        _check_qk_norm(q, k, qk_norm)
        qk_norm = (qk_norm[0], qk_norm[1], float(qk_norm[2]))
    check_rope(op, q, cos, sin, strict)
    check_rope(op, k, cos, sin, strict)
    if not strict:
        q, k = rope(q, cos, sin, profile=profile), rope(k, cos, sin, profile=profile)
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping, profile=profile)
        return q, k
    _check_write(op, k, v, k_cache, v_cache, slot_mapping)
    chk.same_device(op, q, k, cos, sin)
    if slot_mapping.numel() == 0:   # no token: nothing to normalise, rotate or write
        return q.detach().clone(), k.detach().clone()
    slots = _cache_slots(op, k_cache, slot_mapping)
    return strict_impl(op, q.device, profile)(q, k, v, cos, sin, k_cache, v_cache, slots, _check_k, qk_norm=qk_norm)


def _check_qk_norm(q: torch.Tensor, k: torch.Tensor, qk_norm) -> None:
    """The checks of rms_norm(q), rms_norm(k) for the fused q / k norms: its argument checks, then its input
    finiteness check (named ``rms_norm``), in that order for q, then for k."""
    for x, weight in ((q, qk_norm[0]), (k, qk_norm[1])):
        check_rms_norm(x, weight)
        chk.finite("rms_norm", "x", x)


# ---- native profile --------------------------------------------------------------------------------

def _native_varlen(q, k, v, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """The flash varlen kernel when usable for these tensors, else the padded SDPA call (logged once per reason)."""
    cu = cu_seqlens.tolist()
    if q.shape[0] == 0 or len(cu) < 2:
        return q.new_empty(q.shape)
    reason = flash_varlen_unavailable(q, k, v)
    if reason is None:
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        cu_dev = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return _FlashVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_dev, max(lens), scale)
    _log_fallback(reason, q.is_cuda)
    return _padded_sdpa_varlen(q, k, v, cu, scale)


def flash_varlen_unavailable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> str | None:
    """Why the flash varlen kernel cannot run on these tensors (None: it can). Native profile only."""
    if v is not None and v.shape[-1] != q.shape[-1]:
        return f"V's head_dim {v.shape[-1]} differs from Q/K's {q.shape[-1]} (the flash entry point takes one)"
    if not q.is_cuda:
        return f"tensors on {q.device.type}, the flash varlen kernel is CUDA-only"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (flash needs bfloat16 or float16)"
    d = q.shape[-1]
    if d % 8 or d > 256:
        return f"head_dim {d} (flash needs a multiple of 8, at most 256)"
    if not hasattr(torch.ops.aten, "_flash_attention_forward") or not torch.backends.cuda.flash_sdp_enabled():
        return "this torch build has no (enabled) flash attention kernel"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "flash attention needs compute capability >= 8.0"
    return _flash_probe(q.device, q.dtype, q.shape[1], k.shape[1], d)


@functools.lru_cache(maxsize=None)
def _flash_probe(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int) -> str | None:
    """Run the kernel once, forward and backward, on two 1-token sequences of this configuration:
    a torch build whose entry points differ (or refuse the GQA layout) is found here, not mid-run."""
    try:
        with torch.inference_mode(False), torch.enable_grad():   # the caller may be scoring under no_grad
            q = torch.zeros(2, hq, d, device=device, dtype=dtype, requires_grad=True)
            k, v = (torch.zeros(2, hkv, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
            cu = torch.tensor([0, 1, 2], device=device, dtype=torch.int32)
            _FlashVarlen.apply(q, k, v, cu, 1, d ** -0.5).sum().backward()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return probe_failure("the flash varlen kernel failed a probe call", exc)
    return None


@functools.lru_cache(maxsize=None)
def _log_fallback(reason: str, on_cuda: bool) -> None:
    (log.warning if on_cuda else log.info)("native attention_varlen: padded SDPA instead of the flash varlen "
                                           "kernel: %s", reason)


class _FlashVarlen(torch.autograd.Function):
    """Causal packed-varlen flash attention (GQA inside the kernel), forward and backward through
    aten's flash-attention-2 entry points. Positional arguments only: their order is the same in
    torch 2.11 and 2.13 (the RNG outputs are renamed between them; with dropout 0 they are unused)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        out, lse, rng_a, rng_b, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng_a, rng_b)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, rng_a, rng_b = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, rng_a, rng_b,
            scale=ctx.scale)
        return dq, dk, dv, None, None, None


def _padded_sdpa_varlen(q, k, v, cu: list[int], scale: float) -> torch.Tensor:
    """One padded SDPA call: sequences right-padded to the longest, so the plain causal mask
    already hides the padding from every real query; padded rows are dropped."""
    starts, lens = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    dev, l_max = q.device, max(lens)
    lens_t = torch.tensor(lens, device=dev)
    idx = torch.arange(l_max, device=dev).expand(len(lens), l_max)
    valid = idx < lens_t.unsqueeze(1)
    rows = torch.where(valid, torch.tensor(starts, device=dev).unsqueeze(1) + idx, 0)
    qb, kb, vb = (t[rows].transpose(1, 2) for t in (q, k, v))                      # [S, H, L, D]
    out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)[valid]


def native_paged_kernel_unavailable(q: torch.Tensor) -> str | None:
    """Why the native profile's paged attention cannot read K/V through the page table in a kernel (None: it
    can, with the Triton backend's paged kernel); it then gathers the contexts for SDPA instead."""
    if not q.is_cuda:
        return f"tensors on {q.device.type}: the paged kernel (Triton) is CUDA-only"
    if q.dtype not in chk.STRICT_DTYPES:
        return f"dtype {q.dtype} (the Triton paged kernel takes bfloat16 or float32)"
    if not triton_available():
        return "Triton is not installed"
    return None


def _native_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float) -> torch.Tensor:
    """The paged kernel where it runs (:func:`native_paged_kernel_unavailable`), else the SDPA gather: inside
    decode graphs (``chk.decode_step``: static shapes, no host read) the whole block table's width, otherwise
    each context's own length."""
    reason = native_paged_kernel_unavailable(q)
    if reason is None:
        return _native_paged_kernel(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale)
    if q.is_cuda:
        _log_paged_fallback(reason)
    if chk.decode_step():
        return _native_paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale)
    return _native_paged(q, k_cache, v_cache, block_table, seq_lens.tolist(), cu_seqlens_q.tolist(), scale)


def _native_paged_kernel(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float) -> torch.Tensor:
    """The Triton backend's paged kernel: K/V read through the block table (no gather), each sequence up to its
    own length also inside a CUDA graph (the lengths are read on the device). Launch: ``paged_forward``'s pick
    from the batch's shape and the SM count -- the one-program-per-(sequence, kv head) grid when it fills the
    GPU, else each sequence's key splits spread over about ``programs_per_sm`` x SMs programs and merged in
    the kernel (flash-decoding). Unlike the strict op there is no finiteness check of the output."""
    from rlalign.ops.triton_backend.attention import paged_forward   # lazy: Triton is optional
    return paged_forward(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale)


def _native_paged_window_sinks(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float, window,
                               sinks) -> torch.Tensor:
    """Native paged attention with a window and/or sinks: the Triton backend's paged kernel (its
    one-program-per-item launch, the only one that takes them) where it runs
    (:func:`native_paged_kernel_unavailable`), else one padded SDPA call over the gathered contexts, which reads
    the lengths on the host -- refused while a CUDA graph is captured, where no host read can run."""
    reason = native_paged_kernel_unavailable(q)
    if reason is None:
        from rlalign.ops.triton_backend.attention import paged_forward   # lazy: Triton is optional
        return paged_forward(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, window=window,
                             sinks=sinks)
    if chk.is_capturing():
        raise fail("attention_paged", f"sliding-window / sink attention in a captured CUDA graph needs the Triton "
                                      f"paged kernel ({reason}); use the strict profile or no decode graphs")
    if q.is_cuda:
        _log_paged_fallback(reason)
    return _native_paged(q, k_cache, v_cache, block_table, seq_lens.tolist(), cu_seqlens_q.tolist(), scale, window,
                         sinks)


@functools.lru_cache(maxsize=None)
def _log_paged_fallback(reason: str) -> None:
    log.warning("native attention_paged: K/V gathered for SDPA instead of the paged kernel: %s", reason)


def _native_varlen_window_sinks(q, k, v, cu_seqlens: torch.Tensor, scale: float, window, sinks) -> torch.Tensor:
    """Native varlen attention with a window and/or sinks: the sequences right-padded to the longest for one
    :func:`_sdpa_window_sinks` call (the flash varlen kernel takes neither); padded rows are dropped."""
    cu = cu_seqlens.tolist()
    if q.shape[0] == 0 or len(cu) < 2:
        return q.new_empty(q.shape)
    starts, lens = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    dev, l_max = q.device, max(lens)
    idx = torch.arange(l_max, device=dev).expand(len(lens), l_max)
    valid = idx < torch.tensor(lens, device=dev).unsqueeze(1)
    rows = torch.where(valid, torch.tensor(starts, device=dev).unsqueeze(1) + idx, 0)
    qb, kb, vb = (t[rows].transpose(1, 2) for t in (q, k, v))                      # [S, H, L, D]
    out = _sdpa_window_sinks(qb, kb, vb, idx, valid, valid, scale, window, sinks)
    return out.transpose(1, 2)[valid]


def _sdpa_window_sinks(qb, kb, vb, q_pos, valid_k, valid_q, scale: float, window, sinks) -> torch.Tensor:
    """One SDPA call: qb [S, Hq, n, D] at positions q_pos [S, n] against kb/vb [S, Hkv, L, D] at positions
    0..L-1 (valid_k [S, L]); a key is visible when valid, at or before the query and (``window``) after
    q_pos - window. Sinks: one extra key and value of zeros whose additive mask entry is the head's sink logit,
    so its score is exactly the sink (the gradient reaches the sinks through the mask). Padded query rows
    (``~valid_q``) see every key (no NaN) and are dropped by the caller."""
    k_pos = torch.arange(kb.shape[2], device=qb.device)
    seen = valid_k.unsqueeze(1) & (k_pos <= q_pos.unsqueeze(2))                      # [S, n, L]
    if window is not None:
        seen = seen & (k_pos > q_pos.unsqueeze(2) - window)
    seen = (seen | ~valid_q.unsqueeze(2)).unsqueeze(1)                               # [S, 1, n, L]
    if sinks is None:
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=seen, scale=scale,
                                              enable_gqa=qb.shape[1] != kb.shape[1])
    s, hq, n, _ = qb.shape
    kb = torch.cat([kb, kb.new_zeros(s, kb.shape[1], 1, kb.shape[3])], 2)
    vb = torch.cat([vb, vb.new_zeros(s, vb.shape[1], 1, vb.shape[3])], 2)
    bias = torch.zeros(seen.shape, dtype=qb.dtype, device=qb.device).masked_fill(~seen, float("-inf"))
    sink_col = sinks.to(qb.dtype).view(1, hq, 1, 1).expand(s, hq, n, 1)
    mask = torch.cat([bias.expand(s, hq, n, bias.shape[-1]), sink_col], -1)
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                          enable_gqa=qb.shape[1] != kb.shape[1])


def _native_paged(q, k_cache, v_cache, block_table, lens: list[int], cu: list[int], scale: float,
                  window=None, sinks=None) -> torch.Tensor:
    """One padded SDPA call for every sequence (the vendor baseline, as batched engines do): each
    sequence's context is gathered from its pages into [S, Hq, L_max, D], its queries into
    [S, Hq, n_max, D]; the mask is bottom-right causal and hides padding. Padding and the batch
    shape change the kernel's reduction, so results depend on the batch: no guarantee."""
    n_seq = len(lens)
    if n_seq == 0 or q.shape[0] == 0:
        return q.new_empty(q.shape)
    dev, page_size = q.device, k_cache.shape[1]
    lens_t = torch.tensor(lens, device=dev)
    cu_t = torch.tensor(cu, device=dev)
    n_q = cu_t[1:] - cu_t[:-1]
    l_max, n_max = int(lens_t.max()), int(n_q.max())
    pos = torch.arange(l_max, device=dev).expand(n_seq, l_max)
    valid_k = pos < lens_t.unsqueeze(1)
    pos_c = torch.where(valid_k, pos, 0)
    pages = block_table.to(dev).long().gather(1, pos_c // page_size)
    k, v = k_cache[pages, pos_c % page_size], v_cache[pages, pos_c % page_size]     # [S, L, Hkv, D]
    k, v = k.transpose(1, 2), v.transpose(1, 2)                                      # [S, Hkv, L, D]
    qi = torch.arange(n_max, device=dev).expand(n_seq, n_max)
    valid_q = qi < n_q.unsqueeze(1)
    rows = torch.where(valid_q, cu_t[:-1].unsqueeze(1) + qi, 0)
    qb = q[rows].transpose(1, 2)                                                     # [S, Hq, n, D]
    q_pos = lens_t.unsqueeze(1) - n_q.unsqueeze(1) + qi                              # [S, n]
    if window is not None or sinks is not None:
        return _sdpa_window_sinks(qb, k, v, q_pos, valid_k, valid_q, scale, window, sinks).transpose(1, 2)[valid_q]
    mask = valid_k.unsqueeze(1) & (pos.unsqueeze(1) <= q_pos.unsqueeze(2))           # [S, n, L]
    mask = mask | ~valid_q.unsqueeze(2)  # padded query rows attend to everything (no NaN); dropped below
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask.unsqueeze(1), scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)[valid_q]


def _native_paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale: float) -> torch.Tensor:
    """A decode step (sequence s = query row s, at position seq_lens[s] - 1) with static shapes and no
    host read, so that it can be captured in a CUDA graph: every sequence's keys are gathered for all
    ``block_table.shape[1] * page_size`` positions of its table (the caller sizes the table to the
    step) into [S, Hkv, L, D], positions >= seq_lens[s] are masked out, and one SDPA call (the vendor
    kernel) attends. Masked positions gather position 0 (always inside the context), so a stale page
    never enters the math. The native profile's result depends on the padding width: no guarantee."""
    n_seq, width = block_table.shape
    if n_seq != q.shape[0]:
        raise fail("attention_paged", f"a static decode step needs one query per sequence: {q.shape[0]} queries for "
                                      f"{n_seq} sequences")
    if n_seq == 0:
        return q.new_empty(q.shape)
    page_size, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    dev, group = q.device, q.shape[1] // hkv
    pos = torch.arange(width * page_size, device=dev)
    valid = pos < seq_lens.to(device=dev, dtype=torch.int64).unsqueeze(1)              # [S, L]
    pos_c = torch.where(valid, pos, 0)
    pages = block_table.to(device=dev, dtype=torch.int64).gather(1, pos_c // page_size)[:, None, :]
    heads, offsets = torch.arange(hkv, device=dev)[None, :, None], (pos_c % page_size)[:, None, :]
    # gathered straight into [S, Hkv, L, D]: contiguous, the layout SDPA takes without a further copy
    k = k_cache.permute(0, 2, 1, 3)[pages, heads, offsets]
    v = v_cache.permute(0, 2, 1, 3)[pages, heads, offsets]
    # GQA as plain multi-head attention: kv head h's G query heads are G "queries" of head h (one position,
    # so no causal mask; only the length mask), which every SDPA backend takes with a mask
    out = F.scaled_dot_product_attention(q.view(n_seq, hkv, group, d), k, v, attn_mask=valid[:, None, None, :],
                                         scale=scale)
    return out.reshape(n_seq, hkv * group, v_cache.shape[3])


__all__ = ["attention_varlen", "attention_paged", "write_kv_cache", "rope_write_kv"]
