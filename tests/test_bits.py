"""rlalign.contract.bits, the one bit-equality definition: raw bits, -0.0 != +0.0, NaN payloads compared.

Checked against an independent reference (each element's bytes through numpy), over shapes (0-dim, empty,
1-element included) and every float dtype the project uses.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.contract.bits import (bit_view, bits_equal, count_differences, describe_difference, differing,
                                   first_difference)
from rlalign.contract.errors import ContractError

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SPECIALS = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 1e-30)

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


def _reference_bytes(t: torch.Tensor) -> list[bytes]:
    """Each element's raw bytes, row-major, without torch's view machinery."""
    flat = t.detach().contiguous().reshape(-1)
    size = flat.element_size()
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return [raw[i * size:(i + 1) * size] for i in range(flat.numel())]


@st.composite
def tensor_pairs(draw):
    shape, dtype = draw(shapes), draw(st.sampled_from(DTYPES))
    n = 1
    for s in shape:
        n *= s
    values = draw(st.lists(st.sampled_from(SPECIALS) | st.floats(-1e3, 1e3), min_size=n, max_size=n))
    a = torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape)
    b = a.clone()
    flips = draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=3)) if n else []
    bits = b.reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[b.element_size()])
    for i in flips:
        bits[i] ^= draw(st.sampled_from([1, 1 << 3]))   # low mantissa bits: payload changes, still NaN if NaN
    return a, b


@settings(max_examples=200, deadline=None)
@given(tensor_pairs())
def test_bits_agree_with_an_independent_byte_reference(pair):
    a, b = pair
    ref = [x != y for x, y in zip(_reference_bytes(a), _reference_bytes(b))]
    assert bits_equal(a, b) == (not any(ref))
    assert count_differences(a, b) == sum(ref)
    assert differing(a, b).reshape(-1).tolist() == ref
    first = first_difference(a, b)
    if not any(ref):
        assert first is None and describe_difference(a, b) == "identical"
        return
    flat_index = ref.index(True)
    assert first.count == sum(ref) and first.numel == a.numel()
    expected = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), a.shape)) if a.dim() else ()
    assert first.index == expected
    assert _reference_bytes(a[first.index].reshape(1)) == [_reference_bytes(a)[flat_index]]
    assert str(first) in describe_difference(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_signed_zero_and_nan_payloads_differ_but_equal_nans_do_not(dtype):
    zero = torch.zeros(3, dtype=dtype)
    assert torch.equal(zero, -zero) and not bits_equal(zero, -zero)
    nan = torch.full((2,), float("nan"), dtype=dtype)
    assert bits_equal(nan, nan.clone()) and not torch.equal(nan, nan)
    other = nan.clone()
    other.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[other.element_size()])[1] ^= 1
    assert torch.isnan(other).all() and first_difference(nan, other).index == (1,)


def test_shape_dtype_and_non_float_inputs():
    a = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    assert bits_equal(a, a.clone()) and bit_view(a) is not None
    assert not bits_equal(a, a.reshape(3, 2)) and not bits_equal(a.float(), a.double())
    assert describe_difference(a, a.reshape(3, 2)).startswith("shapes differ")
    assert describe_difference(a.float(), a.double()).startswith("dtypes differ")
    with pytest.raises(ContractError, match="same shape and dtype"):
        differing(a, a.reshape(3, 2))
    b = a.clone()
    b[1, 2] = 7
    d = first_difference(a, b)
    assert (d.index, d.value_a, d.value_b, d.count) == ((1, 2), 5, 7, 1)
    strided = torch.randn(4, 6)[:, ::2]
    assert bits_equal(strided, strided.contiguous())
