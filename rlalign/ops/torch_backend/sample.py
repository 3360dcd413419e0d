"""Strict sampling: Gumbel-max with a counter-based hash RNG, top-k / top-p with an exact order.

The sampled token of a row is a pure function of that row's logits, its (seed, seq_id, position)
and its own temperature / top_k / top_p; never of the other rows, their number or their order.

RNG (all 64-bit integer arithmetic modulo 2**64, written with torch int64 ops: add and multiply
wrap in two's complement; right shifts on int64 are arithmetic, so ``_srl`` masks off the
sign-extended bits to get a logical shift):

    G = 0x9E3779B97F4A7C15,  mix64 = the splitmix64 finaliser
        z ^= z >>> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >>> 27; z *= 0x94D049BB133111EB; z ^= z >>> 31
    key(seed, seq_id, pos) = mix64((mix64((mix64(seed + G) ^ seq_id) + G) ^ pos) + G)
    bits(row, v)           = mix64(key + (v + 1) * G)     (splitmix64's (v+1)-th output for state key)
    u(row, v)              = (2 * (bits >>> 41) + 1) / 2**24,  exact in fp32, in [2**-24, 1 - 2**-24]
    g(row, v)              = -log(-log(u))                   (fp32 log, twice)

For a fixed seed each stage is a bijection of its new input, so distinct (seq_id, position)
pairs of one sequence never share a key. u uses the top 23 bits of bits; those bits are not
touched by mix64's last xor-shift, which is therefore skipped. u is fp32 on purpose (the
contract's "fp32 log"): g lies in [-2.81, 16.64], so a token more than 19.45 below the row's max
z is never drawn (its probability is below 3.6e-9); the draw is otherwise Gumbel-max exact up
to 2**-24 quantisation of u.

Sampling of one row (strict), z = logits / temperature in fp32 (the temperature rule, ops/temperature.py):

- greedy (temperature == 0): argmax of the raw logits, ties -> lowest token id. No RNG.
- top-k (0 = off, k >= V = off): keep the first k tokens of the total order (z desc, id asc).
- top-p (1.0 = off): m = max z; e_v = exp(z_v - m) for top-k-kept tokens, else 0;
  Z = tree_sum(e) over the whole row in token-id order (a balanced pairwise tree whose shape
  depends on V only); p_v = e_v / Z in fp32; q_v = trunc(p_v * 2**60) as int64 (exact: scaling
  by a power of two). In the total order, keep a token iff the int64 sum of q over the tokens
  before it is < top_p * 2**60. Integer prefix sums are exact and associative, so the nucleus
  does not depend on the scan order, the device, or on how many candidates were ordered; this
  is what lets the fast path (order only the largest candidates, see :func:`keep_mask`) and a
  full stable sort give the same bits.
- Gumbel-max: token = argmax over kept tokens of z + g (ties -> lowest token id). Logits of
  -inf (masked tokens) score -inf and are never drawn.

A row without top-k/top-p gets the same arithmetic whether or not other rows filter: the
filter only replaces scores of dropped tokens by -inf (torch.where), never recomputes kept ones.
Rows are processed in chunks of about ROW_CHUNK_ELEMS logits (memory and cache only: every step
is per row). Beyond exact integer ops, IEEE division, max and a fixed tree of adds, this relies
on elementwise exp/log giving the same bits for a value wherever it sits in a tensor
(``spec.cpu_backend_assumptions``, checked by ``rlalign doctor``; on CUDA every element runs the
same device function).
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import fail
from rlalign.ops import _checks as chk
from rlalign.ops._registry import register
from rlalign.ops.temperature import divide_by_temperature, temperature_divisor
from rlalign.reductions import tree_sum

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB
NUCLEUS_BITS = 60          # fixed point of the top-p prefix sums (sum of p <= 1.01 stays < 2**63)
ROW_CHUNK_ELEMS = {"cpu": 1 << 20, "cuda": 1 << 24}  # logits per row chunk (cache / memory only)
MIN_CANDIDATES = 1024      # top-k/top-p fast path: order only the largest candidates first ...
CANDIDATE_GROWTH = 8       # ... and 8x more for rows they do not decide, finally the whole row


def _signed(c: int) -> int:
    """A 64-bit pattern as the int64 value torch stores."""
    return c - (1 << 64) if c >= 1 << 63 else c


_G, _M1, _M2 = _signed(GAMMA), _signed(MIX_1), _signed(MIX_2)


# ---- the hash, on Python ints (reference, derive_seed) and on int64 tensors ------------------

def mix64_int(z: int) -> int:
    """splitmix64 finaliser on a Python int, modulo 2**64 (the definition the tensors follow)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX_1) & MASK64
    z = ((z ^ (z >> 27)) * MIX_2) & MASK64
    return z ^ (z >> 31)


def row_key_int(seed: int, seq_id: int, position: int) -> int:
    """key(seed, seq_id, pos) on Python ints, as an unsigned 64-bit value."""
    h = mix64_int(seed + GAMMA)
    h = mix64_int((h ^ (seq_id & MASK64)) + GAMMA)
    return mix64_int((h ^ (position & MASK64)) + GAMMA)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 by s (torch's >> is arithmetic)."""
    return torch.bitwise_right_shift(x, s).bitwise_and_((1 << (64 - s)) - 1)


def _mix64_head_(x: torch.Tensor) -> torch.Tensor:
    """mix64 without its final ``z ^= z >>> 31``, in place (bits 63..33 equal mix64's)."""
    x.bitwise_xor_(_srl(x, 30)).mul_(_M1)
    return x.bitwise_xor_(_srl(x, 27)).mul_(_M2)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (two's complement, wrapping)."""
    x = _mix64_head_(x.clone())
    return x.bitwise_xor_(_srl(x, 31))


def row_keys(seeds: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """key(seed, seq_id, position) per row, int64 [S] (the bit pattern of the unsigned key)."""
    h = mix64(seeds + _G)
    h = mix64((h ^ seq_ids) + _G)
    return mix64((h ^ positions) + _G)


def token_offsets(vocab: int, device: torch.device) -> torch.Tensor:
    """(v + 1) * G mod 2**64 for v in [0, vocab), int64 [V]."""
    return (torch.arange(1, vocab + 1, dtype=torch.int64, device=device)).mul_(_G)


def uniforms(keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """u(row, v) = (2 * (bits >>> 41) + 1) / 2**24 in fp32, [R, V]; strictly inside (0, 1)."""
    x = _mix64_head_(keys[:, None] + offsets[None, :])
    x = x.bitwise_right_shift_(40).bitwise_and_(0xFFFFFF).bitwise_or_(1)
    return x.to(torch.float32).mul_(2.0 ** -24)


def perturbed(z: torch.Tensor, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """z + g with g = -log(-log(u)), computed as z - log(-log(u)) in fp32."""
    return z - uniforms(keys, offsets).log_().neg_().log_()


# ---- top-k / top-p keep masks ---------------------------------------------------------------

def _ordered_prefix(z: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``count`` largest z per row, ordered by (z desc, id asc), and how many of them are exact.

    Returns (vals, ids, n_exact): positions < n_exact hold exactly the first n_exact tokens of the
    row's total order. With count == V that is the whole row (a full stable sort). Otherwise
    tokens tied with the smallest candidate may be missing, so only the candidates strictly
    above it are exact.
    """
    rows, vocab = z.shape
    if count >= vocab:
        vals, ids = torch.sort(z, dim=-1, descending=True, stable=True)
        return vals, ids, torch.full((rows,), vocab, dtype=torch.int64, device=z.device)
    vals, ids = torch.topk(z, count, dim=-1, sorted=True)
    ids, by_id = torch.sort(ids, dim=-1)
    vals, order = torch.sort(vals.gather(1, by_id), dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    return vals, ids, (vals > vals[:, -1:]).sum(-1)


def _nucleus(z, vals, ids, in_k, k_on, top_p, exp=torch.exp):
    """Top-p in sorted order: (keep flags, inclusive int64 prefix sums, limit); see module doc. ``exp``: the
    elementwise exp (the portable profile passes its own)."""
    m = vals[:, :1]
    in_k_by_id = torch.zeros_like(z, dtype=torch.bool).scatter_(1, ids, in_k) | ~k_on[:, None]
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    norm = tree_sum(torch.where(in_k_by_id, exp(z - m), zero)).unsqueeze(-1)
    p = torch.where(in_k, exp(vals - m), zero) / norm
    q = (p * 2.0 ** NUCLEUS_BITS).to(torch.int64)
    cum = torch.cumsum(q, dim=-1)
    limit = torch.ceil(top_p.double() * 2.0 ** NUCLEUS_BITS).to(torch.int64).unsqueeze(-1)
    return (cum - q) < limit, cum, limit


def _keep_sorted(z, vals, ids, n_exact, k, top_p, exp=torch.exp):
    """Keep flags in sorted order [R, C], and per row whether they are exact (see _ordered_prefix).

    A top-k row is exact when its k tokens lie in the exact part; a top-p-only row when the
    nucleus cut falls inside it (top-p can only shrink a top-k set, so top-k + top-p rows need
    no more than the top-k condition).
    """
    rank = torch.arange(vals.shape[1], device=z.device)
    k_on, p_on = k > 0, top_p < 1
    in_k = ~k_on[:, None] | (rank < k[:, None])
    if not bool(p_on.any()):
        return in_k, k <= n_exact
    in_p, cum, limit = _nucleus(z, vals, ids, in_k, k_on, top_p, exp)
    reached = ((cum >= limit) & (rank < n_exact[:, None])).any(-1)
    keep = in_k & (~p_on[:, None] | in_p)
    exact = torch.where(k_on, k <= n_exact, reached | (n_exact == z.shape[1]))
    return keep, exact


def _candidate_counts(k: torch.Tensor, vocab: int, first: int | None) -> list[int]:
    """Growing candidate counts for the fast path, ending with the whole vocab (a full sort).

    Starts at max(max k + 1, MIN_CANDIDATES) (or ``first``) and grows by CANDIDATE_GROWTH; a
    count within a factor CANDIDATE_GROWTH of the vocab is replaced by the full sort.
    """
    count = max(int(k.max()) + 1, MIN_CANDIDATES) if first is None else max(1, int(first))
    counts = []
    while count * CANDIDATE_GROWTH < vocab:
        counts.append(count)
        count *= CANDIDATE_GROWTH
    return counts + [vocab]


def keep_mask(z: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, candidates: int | None = None,
              exp=torch.exp) -> torch.Tensor:
    """[R, V] bool: tokens kept by top-k then top-p (k: int64 [R], 0 = off; top_p: fp32 [R]).

    Fast path: order only the largest candidates of each row; rows whose cut is not decided
    inside the exact part of the candidates are retried with more candidates, finally with a
    full stable sort. Every candidate count gives the same bits (integer prefix sums are exact),
    so a row's mask does not depend on which rows share the call. ``candidates`` sets the first
    count (tests use it to force each path).
    """
    unfiltered = (k == 0) & (top_p >= 1)
    keep = unfiltered.unsqueeze(-1).expand_as(z).clone()
    todo = (~unfiltered).nonzero().squeeze(1)
    if todo.numel() == 0:
        return keep
    for count in _candidate_counts(k, z.shape[1], candidates):
        zt = z[todo]
        vals, ids, n_exact = _ordered_prefix(zt, count)
        keep_sorted, exact = _keep_sorted(zt, vals, ids, n_exact, k[todo], top_p[todo], exp)
        keep[todo] = torch.zeros_like(zt, dtype=torch.bool).scatter_(1, ids, keep_sorted)
        todo = todo[~exact]
        if todo.numel() == 0:
            break
    return keep


def static_keep_mask(z: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, exp=torch.exp) -> torch.Tensor:
    """:func:`keep_mask` with static shapes and no host read (for CUDA-graph capture): every row is
    ordered by a full stable sort (the candidate count keep_mask ends with, exact for every row) and
    every row's nucleus is evaluated; a row with top_p = 1 keeps its top-k set and a row without
    top-k/top-p keeps every token, as in keep_mask. Same bits as keep_mask (integer prefix sums are
    exact: the order's length does not matter). Costs a full sort of every row: only for batches where
    some row filters."""
    vals, ids, _ = _ordered_prefix(z, z.shape[1])
    rank = torch.arange(vals.shape[1], device=z.device)
    k_on, p_on = k > 0, top_p < 1
    in_k = ~k_on[:, None] | (rank < k[:, None])
    in_p, _, _ = _nucleus(z, vals, ids, in_k, k_on, top_p, exp)
    keep_sorted = in_k & (~p_on[:, None] | in_p)
    return torch.zeros_like(z, dtype=torch.bool).scatter_(1, ids, keep_sorted)


def min_p_top_k(z: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor, exp=torch.exp) -> torch.Tensor:
    """top_k tightened by min-p (vLLM's rule: keep the tokens whose probability is >= min_p x the row's largest;
    0 = off), as int64 [R], so that min-p is a prefix of the order like top-k and every sampler (both backends,
    the static form) and the scorer keep the same set.

    With m = max z and c = the number of tokens with fp32 ``exp(z_v - m) >= fp32(min_p)`` (the torch exp of
    :mod:`.primitives`' assumptions; -inf tokens give 0 and never count), a row with min_p > 0 keeps the first
    c tokens of the order (z desc, id asc): k' = min(k or V, c), written 0 when it reaches V. The row's max has
    exp(0) = 1 >= min_p, so c >= 1; a count, not the set {exp >= min_p} itself, so the kept set is a prefix of
    the order by definition. Rows with min_p == 0 keep ``top_k`` unchanged."""
    vocab = z.shape[1]
    count = (exp(z - z.amax(-1, keepdim=True)) >= min_p.unsqueeze(-1)).sum(-1)
    k = torch.minimum(torch.where((top_k == 0) | (top_k >= vocab), vocab, top_k), count)
    return torch.where(min_p > 0, torch.where(k >= vocab, 0, k), top_k)


def kept_set(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, keep): each row's scaled logits (the temperature rule; greedy rows / 1) and the bool [R, V] set of tokens
    :func:`sample` draws from -- the one definition the sampled-logprob scorer (``ops.sampled_logprob``) reads.

    min-p tightens top-k (:func:`min_p_top_k`), top-k / top-p then keep what :func:`keep_mask` keeps (full stable
    sort in the static form: :func:`static_keep_mask`, the same bits); a greedy row (T = 0) keeps its argmax alone
    (top-1 of the order: the lowest id among the maxima, the greedy token); an unfiltered row keeps every token.
    -inf (masked) tokens are never kept. Every step is per row: a row's set depends only on its logits' bits and
    its own settings."""
    vocab = logits.shape[1]
    greedy = temperature == 0
    z = divide_by_temperature(logits, temperature_divisor(temperature, logits.device))
    k = min_p_top_k(z, top_k, min_p) if chk.static_shapes() or bool((min_p > 0).any()) else top_k
    k = torch.where(greedy, 1, k)
    k = torch.where(k >= vocab, 0, k)
    p = torch.where(greedy, torch.ones_like(top_p), top_p)
    if chk.static_shapes():
        keep = static_keep_mask(z, k, p)
    else:
        keep = keep_mask(z, k, p)
    return z, keep & (z > float("-inf"))


FILTER_VERDICT = ("a row asks for top-k/top-p but this CUDA graph was captured without filtering (internal: the "
                  "engine must pick a filtering graph)")


def filtering_rows(filtered: torch.Tensor) -> bool:
    """Whether any row filters (top-k / top-p). Eager: read from the device. While a CUDA graph is
    captured: the capture's host hint ``sample_filtered`` (the graph is specialised on it); captured
    without filtering, a row that does filter at replay fails a device verdict (fail closed)."""
    if not chk.is_capturing():
        return bool(filtered.any())
    hint = bool(chk.capture_hint("sample_filtered"))
    if not hint:
        chk.deferred("sample", FILTER_VERDICT, ~filtered.any())
    return hint


# ---- the strict sampler's value rules (one owner; the Triton kernel checks the same rules, same messages) --

LOGITS_VERDICT = ("logits contain NaN or +inf, or a row of logits is all -inf (static form: checked on the "
                  "device)")
OVERFLOW_MESSAGE = "logits / temperature overflows fp32 (temperature too small for these logits)"


PARAMS_VERDICT = ("a row's temperature (finite, >= 0), top_p (in (0, 1]) or top_k (>= 0) is out of range "
                  "(static form: checked on the device)")


def params_verdict(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """The sampling parameters' rule as one device verdict (the static form of ``ops.sample``'s host check):
    temperature finite and >= 0, top_p in (0, 1], top_k >= 0, in every row."""
    ok = (torch.isfinite(temperature) & (temperature >= 0) & (top_p > 0) & (top_p <= 1) & (top_k >= 0)).all()
    chk.deferred("sample", PARAMS_VERDICT, ok)


def check_logit_values(logits: torch.Tensor, static: bool) -> None:
    """Strict logits hold no NaN or +inf (-inf marks a masked token) and every row a finite value: at once,
    naming the first bad index, or as one device verdict in the static form."""
    if static:
        ok = ~(torch.isnan(logits) | torch.isposinf(logits)).any() & torch.isfinite(logits).any(-1).all()
        chk.deferred("sample", LOGITS_VERDICT, ok)
        return
    raise_bad_logits(logits)


def raise_bad_logits(logits: torch.Tensor) -> None:
    """Raise for the first violation of :func:`check_logit_values`'s rule (host reads), else return."""
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        bad = (torch.isnan(logits) | torch.isposinf(logits)).nonzero()[0].tolist()
        raise fail("sample", f"logits contains NaN or +inf (first at index {bad}, value {logits[tuple(bad)].item()}); "
                             "only -inf is allowed, for masked tokens")
    if logits.shape[0] and not bool(torch.isfinite(logits).any(-1).all()):
        row = int((~torch.isfinite(logits).any(-1)).nonzero()[0])
        raise fail("sample", f"row {row} of logits is all -inf: no token can be sampled")


def overflow_verdict(z: torch.Tensor, static: bool) -> None:
    """Refuse logits / temperature that overflow fp32 (a row's max is not finite): at once, or as a device
    verdict in the static form."""
    ok = torch.isfinite(z.amax(-1)).all()
    if static:
        chk.deferred("sample", OVERFLOW_MESSAGE, ok)
    elif not bool(ok):
        raise fail("sample", OVERFLOW_MESSAGE)


# ---- the op ----------------------------------------------------------------------------------

def _sample_chunk(logits, keys, offsets, greedy, temperature, k, top_p, filtered, static):
    z = divide_by_temperature(logits, temperature_divisor(temperature, logits.device))  # greedy rows: / 1
    overflow_verdict(z, static)
    score = perturbed(z, keys, offsets)
    if static:
        if filtering_rows(filtered):   # unfiltered rows keep every token: their scores pass unchanged
            score = torch.where(static_keep_mask(z, k, top_p), score, float("-inf"))
    elif bool(filtered.any()):
        rows = filtered.nonzero().squeeze(1)
        keep = keep_mask(z[rows], k[rows], top_p[rows])
        score[rows] = torch.where(keep, score[rows], float("-inf"))
    score = torch.where(greedy.unsqueeze(-1), logits, score)
    return torch.argmax(score, dim=-1)  # documented: first (lowest) index among equal maxima


@register("sample", "torch")
def sample(logits: torch.Tensor, seeds: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor,
           temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Strict sample. logits fp32 [S, V] (values checked here: :func:`check_logit_values`);
    seeds/seq_ids/positions/top_k int64 [S]; temperature/top_p fp32 [S]. Returns int64 [S]."""
    rows, vocab = logits.shape
    static = chk.static_shapes()
    check_logit_values(logits, static)
    if static:   # eager: ops.sample checked the parameters on the host
        params_verdict(temperature, top_k, top_p)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    greedy = temperature == 0
    k = torch.where(top_k >= vocab, 0, top_k)
    filtered = ~greedy & ((k > 0) | (top_p < 1))
    keys = row_keys(seeds, seq_ids, positions)
    offsets = token_offsets(vocab, logits.device)
    step = max(1, ROW_CHUNK_ELEMS.get(logits.device.type, 1 << 20) // vocab)
    for r in range(0, rows, step):
        sl = slice(r, r + step)
        out[sl] = _sample_chunk(logits[sl], keys[sl], offsets, greedy[sl], temperature[sl], k[sl],
                                top_p[sl], filtered[sl], static)
    return out
