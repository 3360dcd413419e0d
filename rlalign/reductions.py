"""Fixed-order reductions for the values that feed the weights or a logged metric outside the strict ops.

Objective: a sum, mean, standard deviation or L2 norm whose bits depend only on the input values and their
order -- not on the CPU's vector width (AVX2 / AVX-512), the thread count or a library's blocking. Library
reductions (``torch.sum``, ``Tensor.mean``, ``torch.linalg.vector_norm``) leave the order to the kernel torch
picks for the machine: today's CPU build happens to run the same AVX2 kernel on AVX-512 machines, a build that
registers a wider one would change the last bits, and a gradient norm that changes its last bit changes the
clip scale and so every weight after the step.

Every reduction here is a balanced pairwise tree of elementwise IEEE adds (pair (2i, 2i+1) at each level, an
odd last element carried up unchanged): the order is fixed by the length alone, and an elementwise add is one
correctly rounded operation whatever vector width runs it. Scalars are then finished in Python floats (IEEE
double: ``/`` and ``math.sqrt`` correctly rounded, no vendor math library) and rounded once to the input's
dtype. :func:`tree_sum` is the one tree of the package (the strict ops' backends and the loss aggregation import
it from here), so a sum taken here has their bits. docs/design/fixed-order-reductions.md records the decision.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (length >= 1) as a balanced pairwise tree of elementwise adds, in ``x``'s dtype: the
    one fixed order every strict sum uses (the strict ops' backends, the loss aggregation, the reductions below).

    Level by level: pair (2i, 2i+1) is added; an odd last element is carried to the next level unchanged. The
    order depends only on the length of the last dim, and every add is an IEEE elementwise add, so a row's sum is
    independent of how many rows there are or where it sits, and zero padding at the end leaves its bits unchanged
    (up to the sign of a zero sum).

    Always a new tensor, never a view of ``x`` (also when the last dim has one entry and no add runs): callers
    reuse their input in place after summing it (the logprob block statistics multiply ``e`` in place after
    ``tree_sum(e)``), which must not rewrite a sum already taken."""
    if x.shape[-1] == 1:
        return x[..., 0].clone()
    while x.shape[-1] > 1:
        n = x.shape[-1]
        even = n - n % 2
        pairs = x[..., 0:even:2] + x[..., 1:even:2]
        x = torch.cat([pairs, x[..., even:]], dim=-1) if n % 2 else pairs
    return x[..., 0]


def fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """0-dim sum of every element of ``x`` (row-major order) by :func:`tree_sum`, in ``x``'s dtype; 0 when empty."""
    flat = x.detach().reshape(-1)
    return flat.new_zeros(()) if flat.numel() == 0 else tree_sum(flat)


def _round(value: float, like: torch.Tensor) -> float:
    """``value`` rounded once (to nearest even) to ``like``'s floating dtype, as a Python float."""
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def fixed_mean(x: torch.Tensor) -> float:
    """Mean of every element: the tree sum (in ``x``'s dtype; integers and bools summed in float32, exact below
    2^24) divided by the count in double, rounded once to the dtype; 0.0 when empty."""
    if x.numel() == 0:
        return 0.0
    values = x.detach() if x.is_floating_point() else x.detach().float()
    return _round(float(fixed_sum(values)) / values.numel(), values)


def fixed_mean_std(x: torch.Tensor) -> tuple[float, float]:
    """(mean, unbiased standard deviation) of every element, ``torch.std``'s convention:
    ``sqrt(sum (x - mean)^2 / (n - 1))``; the std is 0.0 for fewer than two elements. The mean is
    :func:`fixed_mean` (rounded to the dtype), the squares and their tree sum in the dtype, the division and
    the square root in double, then one rounding to the dtype."""
    n = x.numel()
    mean = fixed_mean(x)
    if n < 2:
        return mean, 0.0
    values = x.detach() if x.is_floating_point() else x.detach().float()
    centred = values.reshape(-1) - mean
    return mean, _round(math.sqrt(float(fixed_sum(centred * centred)) / (n - 1)), values)


def square_sum(t: torch.Tensor) -> torch.Tensor:
    """One tensor's part of :func:`global_norm`: the tree sum of its squares in fp32 (0-dim)."""
    v = t.detach().reshape(-1).float()
    return fixed_sum(v * v)


def norm_of_square_sums(parts: list[torch.Tensor], device) -> torch.Tensor:
    """:func:`global_norm` from its per-tensor parts (:func:`square_sum`, in the tensors' order): their tree sum in
    fp32, the square root in double, one rounding to fp32, on ``device``."""
    total = float(tree_sum(torch.stack([p.to(parts[0].device) for p in parts])))
    root = math.sqrt(total) if total == total and total >= 0 else total   # nan stays nan; inf stays inf
    return torch.tensor(root, dtype=torch.float64).to(torch.float32).to(device)


def global_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``tensors`` taken as one vector, as a 0-dim fp32 tensor on the first tensor's device:
    per tensor (in the given order) the tree sum of its squares in fp32, then the tree sum of those partial
    sums in fp32, the square root in double, one rounding to fp32. ``nan``/``inf`` propagate as in
    ``torch.nn.utils.get_total_norm``; 0 for no tensors. Split in two (:func:`square_sum` per tensor,
    :func:`norm_of_square_sums`) so that ranks holding different tensors compute the same bits."""
    tensors = list(tensors)
    if not tensors:
        return torch.zeros(())
    return norm_of_square_sums([square_sum(t) for t in tensors], tensors[0].device)


__all__ = ["tree_sum", "fixed_sum", "fixed_mean", "fixed_mean_std", "global_norm", "square_sum", "norm_of_square_sums"]
