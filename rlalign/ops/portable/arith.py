"""The portable profile's arithmetic primitives: bits fixed by IEEE 754 alone, the same on every device.

Allowed building blocks (see the package docstring, checked by tests/test_portable_ops.py's aten census):
elementwise ``+ - * /`` with one rounding each, casts, comparisons, max, integer and bit ops, copies. torch
runs each of them as its own kernel, so nothing is contracted into an FMA.

* :func:`div` -- IEEE division; the divisor is made a tensor of ndim >= 1 on the operand's device (for a CPU
  scalar divisor torch's CUDA kernel multiplies by a rounded reciprocal instead: other bits).
* :func:`sqrt` -- the correctly rounded fp32 square root, whatever the library's: torch's CPU ``sqrt`` runs
  MKL's vector math, which is NOT correctly rounded (measured: 17% of random positive fp32 inputs one ulp off,
  1.3% of float64 results). So a guess (torch's float64 sqrt rounded to fp32, within one fp32 ulp) is corrected
  exactly: for a candidate y the midpoints to its neighbours, (y + next(y)) / 2, have 25 significant
  bits, their squares 50, so in float64 the midpoints and their squares are exact and comparing them with x
  (exact in float64) decides the correctly rounded root without any rounding. Two correction steps; the result
  is the unique correctly rounded value, so it does not depend on the guess.
* :func:`exp` -- Cody-Waite range reduction x = n ln2 + r (ln2 split in a 9-bit head, so n * head is exact),
  a degree-7 polynomial (Cephes ``expf``) evaluated by Horner with separate mul and add, scaled by 2^n as two
  exact power-of-two factors built from integer bits (one rounding where the result is subnormal).
* :func:`log` -- x = m 2^e with m in [sqrt(1/2), sqrt(2)) from the float's bits (subnormals scaled by 2^23
  first), f = m - 1 (exact), log(1 + f) by the Cephes ``logf`` polynomial, e ln2 added as a head and a tail.
* :func:`sin_cos64` -- float64 sin / cos (fdlibm kernels, Cody-Waite reduction by pi/2 in three parts) for the
  rope tables, rounded once to fp32 by the caller.
* :func:`dot` / :func:`matmul_nt` -- products by one elementwise multiply, summed over K by the balanced pairwise
  tree of :func:`rlalign.reductions.tree_sum` (order fixed by K alone; zero padding at the end leaves a sum's bits
  unchanged), in chunks of rows / columns that bound memory and change no bit. matmul_nt lays K first
  (:func:`tree_sum_leading`: the same tree over the leading dim, so every level adds contiguous blocks).

Measured accuracy against float64 (tests/ops/test_portable_ops.py asserts the bounds, docs/portable.md): exp 0.97
ulp (<= 1) for normal results, log 0.76 ulp (<= 1) over all positive floats, sqrt correctly rounded, sin / cos
2.2e-16 absolute.
"""

from __future__ import annotations

import torch

from rlalign.reductions import tree_sum

# exp: 1/ln2, ln2 = LN2_HI + LN2_LO with LN2_HI = 355/512 (9 significant bits: n * LN2_HI is exact for |n| < 2^15)
INV_LN2 = 1.44269504088896341
LN2_HI = 0.693359375
LN2_LO = -2.12194440e-4
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
EXP_MIN, EXP_MAX = -104.0, 89.0     # clamps: below, the result is 0; above, +inf (from the 2^n scaling)
# log(1 + f) - f + f^2/2 = f^3 P(f) on [sqrt(1/2) - 1, sqrt(2) - 1]
LOG_POLY = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
            -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)
SQRT2 = 1.41421356237309504880
# sin / cos (float64, fdlibm): pi/2 = PIO2_1 + PIO2_2 + PIO2_2T with PIO2_1, PIO2_2 of 33 bits (n * part exact
# for |n| < 2^20, i.e. angles below about 1.6e6 rad)
PIO2_1 = 1.57079632673412561417e+00
PIO2_2 = 6.07710050630396597660e-11
PIO2_2T = 2.02226624879595063154e-21
TWO_OVER_PI = 6.36619772367581382433e-01
SIN_POLY = (1.58969099521155010221e-10, -2.50507602534068634195e-08, 2.75573137070700676789e-06,
            -1.98412698298579493134e-04, 8.33333333332248946124e-03, -1.66666666666666324348e-01)
COS_POLY = (-1.13596475577881948265e-11, 2.08757232129817482790e-09, -2.75573143513906633035e-07,
            2.48015872894767294178e-05, -1.38888888888741095749e-03, 4.16666666666666019037e-02)

# elements of one [K, rows, cols] product tensor in matmul_nt (memory and cache only: no bit depends on it)
CHUNK_ELEMS = {"cuda": 1 << 27}
DEFAULT_CHUNK_ELEMS = 1 << 20


def tensor_like(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` rounded once to ``like``'s dtype, as a [1] tensor on its device (a divisor never a scalar)."""
    return torch.full((1, ), value, dtype=like.dtype, device=like.device)


def div(a: torch.Tensor, b: "torch.Tensor | float") -> torch.Tensor:
    """a / b, IEEE division: ``b`` as a tensor of ndim >= 1 on a's device (see the module doc)."""
    if not isinstance(b, torch.Tensor):
        b = tensor_like(float(b), a)
    elif b.ndim == 0:
        b = b.reshape(1)
    return a / b


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root of fp32 ``x`` (see the module doc): a library guess, corrected by exact
    float64 comparisons with the squares of the midpoints to the neighbours. 0 -> 0, inf -> inf, x < 0 -> NaN."""
    xd = x.double()
    y = torch.sqrt(xd).float()
    inf = torch.full((1, ), float("inf"), dtype=torch.float32, device=x.device)
    for _ in range(2):
        up, down = torch.nextafter(y, inf), torch.nextafter(y, -inf)
        yd = y.double()
        hi = (yd + up.double()) * 0.5          # exact: 25 significant bits
        lo = (yd + down.double()) * 0.5
        fix = (y > 0) & torch.isfinite(y)
        y = torch.where(fix & (xd > hi * hi), up, torch.where(fix & (xd < lo * lo), down, y))
    # the library's NaN has device-specific bits (x86's default NaN is negative): one NaN constant instead
    return torch.where((x < 0) | torch.isnan(x), float("nan"), y)


def _horner(coeffs: tuple[float, ...], x: torch.Tensor) -> torch.Tensor:
    """c0 x^(n-1) + ... + c(n-1) by Horner, each step one multiply then one add (no FMA)."""
    p = torch.full_like(x, coeffs[0])
    for c in coeffs[1:]:
        p = p * x
        p = p + c
    return p


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2^n in fp32 for int32 n in [-126, 127], from its bits."""
    return ((n + 127) << 23).view(torch.float32)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x in fp32 (x fp32): see the module doc. -inf -> 0, +inf -> inf, NaN -> NaN."""
    xc = torch.clamp(x, EXP_MIN, EXP_MAX)
    n = torch.round(xc * INV_LN2)
    r = xc - n * LN2_HI
    r = r - n * LN2_LO
    z = r * r
    y = _horner(EXP_POLY, r) * z
    y = y + r
    y = y + 1.0
    ni = n.to(torch.int32)
    n1 = ni >> 1                      # n = n1 + n2, both in [-75, 64]: each factor exact, the product rounds once
    y = y * _pow2(n1)
    y = y * _pow2(ni - n1)
    return torch.where(torch.isnan(x), x, y)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log in fp32 (x fp32): see the module doc. 0 -> -inf, x < 0 -> NaN, +inf -> +inf, NaN -> NaN."""
    tiny = x < 2.0 ** -126
    xs = torch.where(tiny, x * 2.0 ** 23, x)
    bits = xs.view(torch.int32)
    e = (bits >> 23) - 127 - torch.where(tiny, 23, 0).to(torch.int32)
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)     # [1, 2)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)
    e = e + big.to(torch.int32)
    f = m - 1.0
    z = f * f
    y = _horner(LOG_POLY, f) * f
    y = y * z
    ef = e.to(torch.float32)
    y = y + ef * LN2_LO
    y = y - z * 0.5
    out = f + y
    out = out + ef * LN2_HI
    out = torch.where(x == 0, float("-inf"), out)
    out = torch.where(x == float("inf"), x, out)
    return torch.where((x < 0) | torch.isnan(x), float("nan"), out)


def silu(g: torch.Tensor) -> torch.Tensor:
    """g / (1 + exp(-g)) in fp32."""
    return div(g, exp(-g) + 1.0)


def sin_cos64(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin a, cos a) of float64 angles |a| < 1.6e6, in float64 (fdlibm kernels; see the module doc)."""
    n = torch.round(a * TWO_OVER_PI)
    r = a - n * PIO2_1
    r = r - n * PIO2_2
    r = r - n * PIO2_2T
    z = r * r
    s = _horner(SIN_POLY, z) * z
    s = s * r
    s = r + s
    c = _horner(COS_POLY, z) * z
    c = c * z
    c = c - z * 0.5
    c = c + 1.0
    q = n.to(torch.int64) & 3
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_k a[..., k] * b[..., k] (broadcast): elementwise products, the tree sum over the last dim."""
    return tree_sum(a * b)


def tree_sum_leading(x: torch.Tensor) -> torch.Tensor:
    """:func:`rlalign.reductions.tree_sum` over the leading dim instead of the last: the same pairs (2i, 2i+1) and
    carries level by level, so the same bits as ``tree_sum(x.movedim(0, -1))`` (tested); each level adds
    contiguous blocks."""
    if x.shape[0] == 1:
        return x[0].clone()
    while x.shape[0] > 1:
        n = x.shape[0]
        even = n - n % 2
        pairs = x[0:even:2] + x[1:even:2]
        x = torch.cat([pairs, x[even:]], dim=0) if n % 2 else pairs
    return x[0]


def matmul_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype: each entry is :func:`dot` of a row of x and a row of w (the
    same products, the same tree, so the same bits). Chunked over rows and columns (a [K, m, n] product tensor of
    at most CHUNK_ELEMS entries): no bit depends on the chunks, every entry's operations are its own."""
    m, k = x.shape
    n = w.shape[0]
    out = x.new_empty((m, n))
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    budget = CHUNK_ELEMS.get(x.device.type, DEFAULT_CHUNK_ELEMS)
    cols = max(1, min(n, budget // k))
    rows = max(1, min(m, budget // (k * cols)))
    xt, wt = x.t().contiguous(), w.t().contiguous()
    for r in range(0, m, rows):
        xr = xt[:, r:r + rows, None]
        for c in range(0, n, cols):
            out[r:r + rows, c:c + cols] = tree_sum_leading(xr * wt[:, None, c:c + cols])
    return out


__all__ = ["div", "sqrt", "exp", "log", "silu", "sin_cos64", "dot", "matmul_nt", "tree_sum_leading", "tensor_like"]
