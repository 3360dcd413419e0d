"""Strict sampling on the Triton backend: the torch backend's Gumbel-max, fused in two kernels.

Same formulas as :mod:`rlalign.ops.torch_backend.sample` (splitmix64 counter hash keyed by
(seed, seq_id, position), u = (2 (bits >>> 41) + 1) / 2**24, score = z - log(-log(u)),
z = logits / temperature with IEEE division (the temperature rule of rlalign/ops/temperature.py,
in-kernel), argmax with ties to the lowest id; greedy rows take
the argmax of the raw logits), so the [S, V] noise is never materialised. ``log`` is libdevice's logf,
the function torch's CUDA ``log`` uses, so both backends perturb a logit identically. Rows with top-k /
top-p get their keep mask from the torch backend's exact integer nucleus (:func:`keep_mask`), then the
same fused argmax.

Each row is split into fixed vocabulary chunks of CHUNK_BLOCKS blocks of BLOCK_V columns (16,384), one
program per (row, chunk): :func:`sample_chunk_kernel` writes each chunk's best score, its column and its
value bits, :func:`sample_fold_kernel` folds a row's chunks in order into its token and flags. The
reason is occupancy: the per-logit work is ALU-bound (the hash, two logf, an IEEE division), and one
program per row walking the whole vocab ran a 244-row decode step as 244 programs on an H200's 132 SMs
(0.24 ms at 151,936 vocab); the chunks give it 2,440. The chunk width is a constant, so a row's
blocks, and with them its token and flags, never depend on the batch (the fold is exact: see the fold
kernel).

The kernels also compute each row's RNG key (the torch backend's ``row_keys``: exact uint64 arithmetic)
and check the torch backend's value rules while they read every logit: no NaN/+inf and a finite logit
per row (``check_logit_values``), the parameters in range (``params_verdict``), z = logits / T without
NaN/+inf and with a finite value (``overflow_verdict``), and, in a graph captured without filtering, no
row that filters (``filtering_rows``). Each row writes four int8 flags; one reduction turns them into
the verdicts, in the torch backend's order and with its messages. Before the checks were folded into
the kernel a captured decode step spent ~7 full passes over the [S, V] fp32 logits on them (isnan,
isposinf, isfinite's |x| and compares, the z division, the max of z) and ~80 small kernels on the keys
and the parameters: the captured sampler was 90 torch kernels and the sample kernel, now 3 and the two
kernels (benchmarks/count_decode_ops.py). z is materialised only when a row filters (its keep mask).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlalign.ops.temperature import divide_by_temperature, temperature_divisor
from rlalign.ops import _checks as chk
from rlalign.contract.errors import fail
from rlalign.ops.torch_backend.sample import (FILTER_VERDICT, LOGITS_VERDICT, OVERFLOW_MESSAGE, PARAMS_VERDICT,
                                             keep_mask, raise_bad_logits, static_keep_mask)
from rlalign.ops.triton_backend._common import is_interpreter, libm_log

BLOCK_V = 2048
# BLOCK_V blocks per program of the chunk kernel: 16,384 columns, fixed (never from the row count). A decode step of
# 244 rows x 151,936 vocab is 244 x 10 programs, ~18 per SM of an H200 (132 SMs); one program per row gave 244.
CHUNK_BLOCKS = 8


@triton.jit
def _noise_bits(key, cols):
    """mix64 without its final xor-shift of key + (v + 1) * G, as uint64 (wrapping)."""
    x = key + (cols + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x


@triton.jit
def _mix64(x):
    """The splitmix64 finaliser on uint64 (wrapping): rlalign.ops.torch_backend.sample.mix64."""
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _row_key(SEEDS, SEQ_IDS, POSITIONS, row):
    """key(seed, seq_id, position) of the torch backend's ``row_keys``, as uint64 (exact integer ops)."""
    seed = tl.load(SEEDS + row).to(tl.uint64, bitcast=True)
    seq_id = tl.load(SEQ_IDS + row).to(tl.uint64, bitcast=True)
    position = tl.load(POSITIONS + row).to(tl.uint64, bitcast=True)
    h = _mix64(seed + 0x9E3779B97F4A7C15)
    h = _mix64((h ^ seq_id) + 0x9E3779B97F4A7C15)
    return _mix64((h ^ position) + 0x9E3779B97F4A7C15)


# bits of the kernel's per-lane flag word
X_BAD, X_FINITE, Z_BAD, Z_FINITE = tl.constexpr(1), tl.constexpr(2), tl.constexpr(4), tl.constexpr(8)


@triton.jit
def _value_bits(x, z):
    """Per lane: X_BAD (x is NaN or +inf) | X_FINITE | Z_BAD | Z_FINITE, int32 (masked lanes hold -inf: 0)."""
    bits = ((x != x) | (x == float("inf"))).to(tl.int32) * X_BAD
    bits |= (tl.abs(x) < float("inf")).to(tl.int32) * X_FINITE
    bits |= ((z != z) | (z == float("inf"))).to(tl.int32) * Z_BAD
    return bits | (tl.abs(z) < float("inf")).to(tl.int32) * Z_FINITE


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _row_params(TEMP, TOPK, TOPP, KEEP, row, V, stride_keep, HAS_KEEP: tl.constexpr):
    """A row's (temperature, greedy, params_ok, unfiltered): greedy = temperature 0; params_ok = the torch backend's
    ``params_verdict`` rule; unfiltered = the row keeps every token (greedy, or neither top-k below V nor top-p
    below 1; with a keep mask, its column V says whether the row filters)."""
    temp = tl.load(TEMP + row)
    top_k = tl.load(TOPK + row)
    top_p = tl.load(TOPP + row)
    greedy = temp == 0.0
    params_ok = (tl.abs(temp) < float("inf")) & (temp >= 0.0) & (top_p > 0.0) & (top_p <= 1.0) & (top_k >= 0)
    filters = ((top_k > 0) & (top_k < V)) | (top_p < 1.0)    # the torch backend's rule (top_k >= V is off)
    unfiltered = greedy | (filters == 0)
    if HAS_KEEP:
        unfiltered = tl.load(KEEP + row.to(tl.int64) * stride_keep + V) == 0
    return temp, greedy, params_ok, unfiltered


@triton.jit
def _block_best(LOGITS, KEEP, row, v0, V, stride_l, stride_keep, key, temp, greedy, unfiltered,
                HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Columns [v0, v0 + BLOCK) of a row: (max score, the lowest column holding it, per-lane value bits). The score
    of column v (module docstring): the raw logit on greedy rows, else z - log(-log(u)); -inf for a column the keep
    mask drops or past V (those lanes read x = -inf)."""
    cols = v0 + tl.arange(0, BLOCK)
    ok = cols < V
    x = tl.load(LOGITS + row.to(tl.int64) * stride_l + cols, mask=ok, other=float("-inf"))
    z = tl.math.div_rn(x, tl.where(greedy, 1.0, temp))
    bits = _noise_bits(key, cols)
    u = (((bits >> 40) & 0xFFFFFF) | 1).to(tl.float32) * (2.0 ** -24)
    score = z - libm_log(-libm_log(u, LIBDEVICE), LIBDEVICE)
    if HAS_KEEP:
        keep = tl.load(KEEP + row.to(tl.int64) * stride_keep + cols, mask=ok, other=0) != 0
        score = tl.where(keep | unfiltered, score, float("-inf"))
    score = tl.where(greedy, x, score)
    score = tl.where(ok, score, float("-inf"))
    b_max = tl.max(score, 0)
    return b_max, v0 + tl.argmax(score, 0, tie_break_left=True), _value_bits(x, z)


@triton.jit
def _take(best, best_idx, cand, cand_idx):
    """One step of the running argmax: the candidate replaces (best, best_idx) iff cand > best, strictly (an equal
    value keeps the index met first; a NaN never replaces)."""
    take = cand > best
    return tl.where(take, cand, best), tl.where(take, cand_idx, best_idx)


@triton.jit
def sample_chunk_kernel(LOGITS, SEEDS, SEQ_IDS, POSITIONS, TEMP, TOPK, TOPP, KEEP, BEST, BEST_IDX, SEEN, V, stride_l,
                        stride_keep, HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BLOCKS: tl.constexpr,
                        LIBDEVICE: tl.constexpr):
    """Program (row, c): columns [c * W, min((c + 1) * W, V)) of the row, W = CHUNK_BLOCKS * BLOCK, in BLOCK-wide
    blocks aligned at 0 (those of one program per row). Folds its blocks in order from (-inf, 0) with :func:`_take`
    and writes, at [row, c], the chunk's best score (fp32), its column (int32, in the row) and the OR of its lanes'
    value bits (:func:`_value_bits`). A chunk's best is never NaN (only a strictly greater score replaces -inf)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    key = _row_key(SEEDS, SEQ_IDS, POSITIONS, row)
    temp, greedy, _, unfiltered = _row_params(TEMP, TOPK, TOPP, KEEP, row, V, stride_keep, HAS_KEEP)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    seen = tl.zeros((BLOCK,), tl.int32)   # per lane, OR over the blocks: elementwise in the loop, one reduction after
    v_start = chunk * (CHUNK_BLOCKS * BLOCK)
    for v0 in range(v_start, tl.minimum(v_start + CHUNK_BLOCKS * BLOCK, V), BLOCK):
        b_max, b_idx, bits = _block_best(LOGITS, KEEP, row, v0, V, stride_l, stride_keep, key, temp, greedy,
                                         unfiltered, HAS_KEEP, BLOCK, LIBDEVICE)
        seen |= bits
        best, best_idx = _take(best, best_idx, b_max, b_idx)
    at = row * tl.num_programs(1) + chunk
    tl.store(BEST + at, best)
    tl.store(BEST_IDX + at, best_idx)
    tl.store(SEEN + at, tl.reduce(seen, 0, _bit_or))


@triton.jit
def sample_fold_kernel(BEST, BEST_IDX, SEEN, TEMP, TOPK, TOPP, KEEP, OUT, FLAGS, S, V, stride_keep,
                       N_CHUNKS: tl.constexpr, HAS_KEEP: tl.constexpr):
    """One row: its token and its validity flags from its chunks' results (sample_chunk_kernel). The token folds the
    chunks in chunk order from (-inf, 0) with :func:`_take`, the rule a serial walk applies to the row's blocks; both
    give the same token because a fold taking only strictly greater values is an argmax with ties to the first index
    met, and such an argmax over a sequence equals the same fold over the in-order results of its consecutive pieces
    (the max of their maxima, met first in the first piece reaching it; a NaN never replaces, a piece whose best is
    -inf is never taken, exactly like its blocks). The value bits are the OR of the chunks' (OR is associative).
    Flags, int8 0/1 (1 = valid), FLAGS[i, row]: 0 the raw logits hold no NaN/+inf and a finite value
    (``check_logit_values``); 1 the parameters are in range (``params_verdict``); 2 the row does not filter
    (top-k / top-p: ``filtering_rows``); 3 z = logits / T holds no NaN/+inf and a finite value
    (``overflow_verdict``: isfinite(max z))."""
    row = tl.program_id(0)
    _, _, params_ok, unfiltered = _row_params(TEMP, TOPK, TOPP, KEEP, row, V, stride_keep, HAS_KEEP)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    seen = tl.full((), 0, tl.int32)
    for c in tl.static_range(N_CHUNKS):   # unrolled: the chunks' loads need not wait for the previous compare
        at = row * N_CHUNKS + c
        best, best_idx = _take(best, best_idx, tl.load(BEST + at), tl.load(BEST_IDX + at))
        seen |= tl.load(SEEN + at)
    tl.store(OUT + row, best_idx.to(tl.int64))
    tl.store(FLAGS + row, ((seen & (X_BAD | X_FINITE)) == X_FINITE).to(tl.int8))
    tl.store(FLAGS + S + row, params_ok.to(tl.int8))
    tl.store(FLAGS + 2 * S + row, unfiltered.to(tl.int8))
    tl.store(FLAGS + 3 * S + row, ((seen & (Z_BAD | Z_FINITE)) == Z_FINITE).to(tl.int8))


def sample(logits, seeds, seq_ids, positions, temperature, top_k, top_p, *, chunk_blocks: int = CHUNK_BLOCKS):
    """Validated inputs (rlalign.ops.sample; in the static form not their values): logits fp32 [S, V]; per-row
    int64 / fp32 params. The value rules of the torch backend (``check_logit_values``, ``params_verdict``,
    the capture's ``filtering_rows`` verdict, ``overflow_verdict``) are checked by the kernels, which read
    every logit anyway: each row writes its flags, one reduction turns them into the verdicts (static form:
    deferred, the torch backend's messages; eager: raised here, the logits' error naming the first bad index).
    ``chunk_blocks``: BLOCK_V blocks per chunk program (tests only: small chunks on small vocabs; the tokens and
    flags do not depend on it)."""
    rows, vocab = logits.shape
    logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    static = chk.static_shapes()   # CUDA-graph capture: no host read, no data-dependent shape (same bits)
    capturing = chk.is_capturing()
    filtered = None if capturing else _filtered(temperature, top_k, top_p, vocab)
    has_keep = bool(chk.capture_hint("sample_filtered")) if capturing else bool(filtered.any())
    keep = None
    if has_keep:
        keep = _keep(logits, temperature, top_k, top_p, static,
                     _filtered(temperature, top_k, top_p, vocab) if filtered is None else filtered)
    flags = torch.empty((4, rows), dtype=torch.int8, device=logits.device)
    params = tuple(p.contiguous() for p in (seeds, seq_ids, positions, temperature, top_k, top_p))
    _launch(logits, params, keep, out, flags, chunk_blocks)
    _verdicts(flags, logits, static, check_unfiltered=capturing and not has_keep)
    return out


def _launch(logits, params, keep, out, flags, chunk_blocks: int) -> None:
    """The chunk kernel on a (rows, chunks) grid, then the fold kernel on (rows,); ``keep`` None: no row filters."""
    rows, vocab = logits.shape
    seeds, seq_ids, positions, temperature, top_k, top_p = params
    chunks = triton.cdiv(vocab, chunk_blocks * BLOCK_V)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    seen = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    has_keep = keep is not None
    keep, stride_keep = (keep, keep.stride(0)) if has_keep else (out, 0)
    sample_chunk_kernel[(rows, chunks)](logits, seeds, seq_ids, positions, temperature, top_k, top_p, keep, best,
                                        best_idx, seen, vocab, logits.stride(0), stride_keep, HAS_KEEP=has_keep,
                                        BLOCK=BLOCK_V, CHUNK_BLOCKS=chunk_blocks, LIBDEVICE=not is_interpreter(),
                                        num_warps=8)
    sample_fold_kernel[(rows,)](best, best_idx, seen, temperature, top_k, top_p, keep, out, flags, rows, vocab,
                                stride_keep, N_CHUNKS=chunks, HAS_KEEP=has_keep, num_warps=1)


def _filtered(temperature, top_k, top_p, vocab) -> torch.Tensor:
    """bool [S]: the rows that filter (top-k below the vocab or top-p below 1, not greedy)."""
    k = torch.where(top_k >= vocab, 0, top_k)
    return (temperature != 0) & ((k > 0) | (top_p < 1))


def _keep(logits, temperature, top_k, top_p, static, filtered) -> torch.Tensor:
    """[S, V + 1] int8: the keep mask of the filtering rows, and in column V whether the row filters at all."""
    rows, vocab = logits.shape
    k = torch.where(top_k >= vocab, 0, top_k)
    z = divide_by_temperature(logits, temperature_divisor(temperature, logits.device))  # greedy rows: / 1
    keep = torch.zeros((rows, vocab + 1), dtype=torch.int8, device=logits.device)
    if static:   # every row's mask (unfiltered rows ignore theirs: column V)
        keep[:, :vocab] = static_keep_mask(z, k, top_p).to(torch.int8)
    else:
        idx = filtered.nonzero().squeeze(1)
        keep[idx, :vocab] = keep_mask(z[idx], k[idx], top_p[idx]).to(torch.int8)
    keep[:, vocab] = filtered.to(torch.int8)
    return keep


def _verdicts(flags: torch.Tensor, logits: torch.Tensor, static: bool, check_unfiltered: bool) -> None:
    """The kernel's per-row flags -> the verdicts, in the torch backend's order (one reduction)."""
    verdicts = flags.view(torch.bool).all(dim=1)
    if static:
        logits_ok, params_ok, unfiltered_ok, z_ok = verdicts.unbind(0)
        chk.deferred("sample", LOGITS_VERDICT, logits_ok)
        chk.deferred("sample", PARAMS_VERDICT, params_ok)
        chk.deferred("sample", OVERFLOW_MESSAGE, z_ok)
        if check_unfiltered:   # a graph captured without filtering: no row may filter at replay
            chk.deferred("sample", FILTER_VERDICT, unfiltered_ok)
        return
    logits_ok, _, _, z_ok = verdicts.tolist()   # one host read; ops.sample checked the parameters on the host
    if not logits_ok:
        raise_bad_logits(logits)   # names the first bad index
        raise fail("sample", f"internal: the sample kernel flagged the logits but the torch check found no "
                             f"NaN/+inf or all -inf row ({LOGITS_VERDICT})")
    if not z_ok:
        raise fail("sample", OVERFLOW_MESSAGE)


__all__ = ["sample"]
