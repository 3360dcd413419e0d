"""Public sampling op and the shared seed derivation.

``sample`` picks one token per row of fp32 logits. In the strict profile the token is a pure
function of the row's logits, its (seed, seq_id, position) and its own temperature / top_k /
top_p (Gumbel-max with a counter-based splitmix64 RNG; exact formulas in
:mod:`rlalign.ops.torch_backend.sample`), so it never depends on the batch. In the native
profile it is what vLLM-style engines do: an exponential race (Gumbel-max) over the temperature-scaled,
top-k/top-p-filtered logits, its noise from one torch.Generator per call seeded from ``seeds[0]`` (eager)
or from the device's default generator (static form: inside decode graphs); the draw of a row depends on
the whole batch.
"""

from __future__ import annotations

import torch

from rlalign.contract.errors import fail
from rlalign.contract.profiles import Profile, as_profile
from rlalign.ops import _checks as chk
from rlalign.ops._dispatch import strict_impl
from rlalign.ops.portable import sample as portable_sample
from rlalign.ops.temperature import divide_by_temperature, temperature_divisor
from rlalign.ops.torch_backend.sample import (GAMMA, MASK64, filtering_rows, min_p_top_k, mix64_int, params_verdict,
                                              row_key_int)

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def derive_seed(run_seed: int, prompt_index: int, sample_index: int) -> int:
    """Per-sequence seed in [0, 2**63): a pure hash of (run seed, prompt index, sample index).

    With mix64 the splitmix64 finaliser, G = 0x9E3779B97F4A7C15, all arithmetic mod 2**64
    (negative inputs are taken mod 2**64):

        h = mix64(run_seed + G); h = mix64((h ^ prompt_index) + G); h = mix64((h ^ sample_index) + G)
        return h >> 1

    For a fixed run seed and prompt, distinct sample indices give distinct seeds up to the
    dropped low bit; the result fits int64, so it can be passed as ``seeds`` to :func:`sample`.
    """
    for name, value in (("run_seed", run_seed), ("prompt_index", prompt_index), ("sample_index", sample_index)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"derive_seed: {name} must be an int, got {type(value).__name__}")
    h = mix64_int(run_seed + GAMMA)
    h = mix64_int((h ^ (prompt_index & MASK64)) + GAMMA)
    h = mix64_int((h ^ (sample_index & MASK64)) + GAMMA)
    return h >> 1


def sample(logits: torch.Tensor, *, seeds, seq_ids, positions, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
           profile=None) -> torch.Tensor:
    """Sample one token id per row of ``logits`` (fp32 [S, V], raw, not temperature-scaled).

    seeds, seq_ids, positions: int64 [S] tensors (int32 accepted) or Python ints for every row.
    temperature: float or fp32 [S]; 0 = greedy (argmax of the logits, ties -> lowest id).
    top_k: int or int [S]; 0 (or >= V) = off. top_p: float or fp32 [S] in (0, 1]; 1 = off.
    min_p: float or fp32 [S] in [0, 1]; 0 = off: keep the tokens whose probability is >= min_p x the row's
    largest, applied as a tighter top-k (:func:`rlalign.ops.torch_backend.sample.min_p_top_k`: a prefix of
    the order, the same on every backend) before top-k / top-p, as vLLM orders them.
    Python floats are rounded to fp32 once. Returns int64 [S] on the logits' device.

    strict: z = logits / temperature (fp32); keep the top-k of the order (z desc, id asc), then the
    smallest prefix of that order whose probability reaches top_p (exact integer prefix sums of
    fp32 probabilities); token = argmax over kept tokens of z + Gumbel(u(seed, seq_id, position,
    token)), ties -> lowest id. Logits may hold -inf (masked tokens) but no NaN or +inf, and
    every row needs a finite logit; anything else raises ContractError.

    native: the fast engine's path, no invariance promise (the draw depends on the batch): z = logits /
    temperature; when a row filters, a sort of every row keeps its top-k tokens and then the smallest
    prefix whose softmax mass reaches top_p (tokens before the first whose preceding mass is >= top_p);
    token = argmax over kept tokens of z - log(E), E ~ Exp(1) i.i.d. per token (an exponential race:
    P(token) = its filtered softmax probability); greedy rows (T = 0) take argmax(logits). E comes from
    a torch.Generator seeded from seeds[0] (eager: one host read), or, in the static form, from the
    device's default generator (no host read: a CUDA graph replays it with a fresh philox offset each
    time; ``torch.manual_seed`` reproduces a run) -- the per-row seeds are then not used.

    Static form (strict, inside a CUDA-graph capture or ``ops.static_decode()``: ``_checks.static_shapes``):
    no host read and no data-dependent shape, the same bits. The validations above become device
    verdicts (``_checks.deferred``: raised after the replay), top-k/top-p rows get their keep mask from
    a full stable sort of every row (:func:`rlalign.ops.torch_backend.sample.static_keep_mask`), and
    whether any row filters is the capture's host hint ``sample_filtered`` (a row that filters in a
    graph captured without filtering fails its verdict).
    """
    native = as_profile(profile) is Profile.NATIVE
    static = chk.static_shapes()
    _check_logits(logits, strict=not native)
    rows = logits.shape[0]
    params = row_params(logits, rows, seeds, seq_ids, positions, temperature, top_k, top_p)
    if not static:
        check_values(*params)
    if not _is_off(min_p):   # the default (a Python 0) changes nothing: not even one more pass over the logits
        params = (*params[:4], _min_p_top_k(logits, params[3], params[4], min_p, static, as_profile(profile)), params[5])
    elif native:   # (strict: the implementation checks them on the device, e.g. in the Triton sample kernel)
        params_verdict(*params[3:])
    if native:
        return _native_sample(logits, *params, static=static)
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    return strict_impl("sample", logits.device, profile)(logits, *params)


# ---- validation -------------------------------------------------------------------------------

def _check_logits(logits: torch.Tensor, strict: bool) -> None:
    if not isinstance(logits, torch.Tensor):
        raise fail("sample", f"logits must be a torch.Tensor, got {type(logits).__name__}")
    chk.ndim("sample", "logits", logits, 2)
    if logits.shape[1] == 0:
        raise fail("sample", "logits has an empty vocab dimension")
    if not strict:
        return
    if logits.dtype != torch.float32:
        raise fail("sample", f"logits must be float32 in strict, got {logits.dtype} (cast with .float())")
    # the values (no NaN/+inf, a finite logit per row) are checked by the strict implementation: the torch
    # backend's check_logit_values, the Triton kernel's flags (it reads every logit anyway); same messages


def row_params(logits, rows, seeds, seq_ids, positions, temperature, top_k, top_p):
    """(seeds, seq_ids, positions, temperature, top_k, top_p) as [rows] tensors on the logits' device (int64 /
    fp32), scalars broadcast; shapes, devices and dtypes checked (the values: ``check_values``)."""
    dev = logits.device
    return (per_row("seeds", seeds, rows, dev, integer=True),
            per_row("seq_ids", seq_ids, rows, dev, integer=True),
            per_row("positions", positions, rows, dev, integer=True),
            per_row("temperature", temperature, rows, dev, integer=False),
            per_row("top_k", top_k, rows, dev, integer=True),
            per_row("top_p", top_p, rows, dev, integer=False))


def per_row(name: str, value, rows: int, device: torch.device, *, integer: bool) -> torch.Tensor:
    """A scalar broadcast to [rows] or a [rows] tensor, as int64 (integer) or fp32 (not integer)."""
    dtype = torch.int64 if integer else torch.float32
    if isinstance(value, torch.Tensor):
        return _per_row_tensor(name, value, rows, device, integer)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an int" if integer else "a float"
        raise fail("sample", f"{name} must be {kind} or a [S] tensor, got {type(value).__name__}")
    if integer and not _INT64_MIN <= value <= _INT64_MAX:
        raise fail("sample", f"{name}={value} does not fit in int64")
    return torch.full((rows,), value, dtype=dtype, device=device)


def _per_row_tensor(name, value, rows, device, integer) -> torch.Tensor:
    if value.dim() > 1 or (value.dim() == 1 and value.shape[0] != rows):
        raise fail("sample", f"{name} must be a scalar or have shape [{rows}] (one per row), got {tuple(value.shape)}")
    if value.device != device:
        raise fail("sample", f"{name} is on {value.device} but logits are on {device}")
    if integer and value.dtype not in (torch.int32, torch.int64):
        raise fail("sample", f"{name} must be an int32/int64 tensor, got {value.dtype}")
    if not integer and value.dtype != torch.float32:
        raise fail("sample", f"{name} must be a float32 tensor, got {value.dtype}")
    return value.to(torch.int64 if integer else torch.float32).expand(rows).contiguous()


def check_values(seeds, seq_ids, positions, temperature, top_k, top_p) -> None:
    bad_t = ~torch.isfinite(temperature) | (temperature < 0)
    if bool(bad_t.any()):
        raise fail("sample", f"temperature must be finite and >= 0 (0 = greedy), got {_first_bad(temperature, bad_t)}")
    bad_p = ~((top_p > 0) & (top_p <= 1))  # also catches NaN
    if bool(bad_p.any()):
        raise fail("sample", f"top_p must be in (0, 1] (1 = off), got {_first_bad(top_p, bad_p)}")
    if bool((top_k < 0).any()):
        raise fail("sample", f"top_k must be >= 0 (0 = off), got {_first_bad(top_k, top_k < 0)}")


def _is_off(min_p) -> bool:
    return not isinstance(min_p, torch.Tensor) and not isinstance(min_p, bool) and min_p == 0


def check_min_p(min_p: torch.Tensor) -> None:
    """min_p in [0, 1] in every row (0 = off)."""
    bad = ~((min_p >= 0) & (min_p <= 1))   # also catches NaN
    if bool(bad.any()):
        raise fail("sample", f"min_p must be in [0, 1] (0 = off), got {_first_bad(min_p, bad)}")


def _min_p_top_k(logits, temperature, top_k, min_p, static: bool, profile: Profile) -> torch.Tensor:
    """The rows' top_k tightened by ``min_p`` (checked here; a device verdict in the static form), from the very z
    the sampler draws from (the temperature rule, greedy rows / 1)."""
    min_p = per_row("min_p", min_p, logits.shape[0], logits.device, integer=False)
    if static:
        chk.deferred("sample", "a row's min_p is outside [0, 1] (static form: checked on the device)",
                     ((min_p >= 0) & (min_p <= 1)).all())
    else:
        check_min_p(min_p)
    if profile is Profile.PORTABLE:
        return portable_sample.min_p_top_k(logits, temperature, top_k, min_p)
    z = divide_by_temperature(logits, temperature_divisor(temperature, logits.device))
    return torch.where(temperature == 0, top_k, min_p_top_k(z, top_k, min_p))


def _first_bad(values: torch.Tensor, bad: torch.Tensor) -> str:
    row = int(bad.nonzero()[0])
    return f"{values[row].item()} at row {row}"


# ---- native profile -----------------------------------------------------------------------------

def _native_sample(logits, seeds, seq_ids, positions, temperature, top_k, top_p, *, static: bool) -> torch.Tensor:
    """The native draw (see :func:`sample`): an exponential race over the filtered, tempered logits. Static
    shapes throughout; in the static form no host read (filtering is the capture's ``sample_filtered`` hint)."""
    rows, vocab = logits.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    greedy = temperature == 0
    z = logits.float() / torch.where(greedy, 1.0, temperature).unsqueeze(-1)
    filters = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
    if filtering_rows(filters) if static else bool(filters.any()):
        z = _native_filtered(z, top_k, top_p)
    race = torch.empty_like(z).exponential_(generator=None if static else _seeded_generator(seeds, seq_ids, positions))
    # z - log(E) in E's buffer; E = 0 (possible in fp32) would give +inf, and NaN on a masked (-inf) token
    race = race.clamp_min_(torch.finfo(torch.float32).tiny).log_().neg_().add_(z)
    drawn = torch.argmax(race, dim=-1)
    return torch.where(greedy, torch.argmax(logits, dim=-1), drawn)


def _seeded_generator(seeds: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Generator:
    """The eager native draw's generator, seeded by the first row's (seed, sequence, position) key: each decode
    step of a sequence gets fresh noise (seeded by the request's seed alone, every step replayed the same noise
    and a sequence repeated one token), and the same batch the same draw."""
    gen = torch.Generator(device=seeds.device)
    seed, seq_id, position = torch.stack([seeds[0], seq_ids[0], positions[0]]).to(torch.int64).tolist()   # one read
    gen.manual_seed(row_key_int(seed, seq_id, position))
    return gen


def _native_filtered(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """z with -inf outside each row's top-k and then outside its nucleus (the smallest prefix, in descending
    z, whose softmax mass reaches top_p; a token is dropped when the mass before it already does). One sort of
    every row (a fast engine's torch path; rows that do not filter pass unchanged). Ties at the k-th value
    may keep either token."""
    vocab = z.shape[1]
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    rank = torch.arange(vocab, device=z.device)
    drop = (top_k > 0).unsqueeze(-1) & (rank >= top_k.unsqueeze(-1))
    sorted_z = sorted_z.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_z, dim=-1)
    drop |= ((torch.cumsum(probs, dim=-1) - probs) >= top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)
    return torch.empty_like(z).scatter_(1, order, sorted_z.masked_fill(drop, float("-inf")))
