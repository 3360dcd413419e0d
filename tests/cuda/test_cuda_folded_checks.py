"""CUDA: the folded checks of the strict decode step on the device (tests/ops/test_folded_checks.py runs the
same under the interpreter). The Triton sampler's kernel flags catch NaN / +inf / an all -inf row / an fp32
overflow of logits / temperature at any place, eager (the torch backend's message, naming the first bad index)
and static (a deferred verdict raised at the next flush); ``finite_verdict`` (max |x| < inf) is exactly
isfinite(t).all() on the GPU for bf16 and fp32, NaN included (the max reduction must propagate it)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract import ContractError
from rlalign.ops import _checks as chk
from rlalign.ops.torch_backend import sample as reference
from tests.bitwise import assert_bitwise_equal

pytestmark = pytest.mark.cuda

DEFECTS = ("nan", "posinf", "neginf_row", "overflow")


def _defective(rows, vocab, defect, row, col, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, device="cuda") * 3
    temperature = torch.full((rows,), 0.8, device="cuda")
    if defect == "nan":
        logits[row, col] = float("nan")
    elif defect == "posinf":
        logits[row, col] = float("inf")
    elif defect == "neginf_row":
        logits[row] = float("-inf")
    else:
        logits[row, col] = 3.0e38
        temperature[row] = 0.25
    ints = torch.arange(rows, device="cuda")
    return logits, dict(seeds=ints, seq_ids=ints, positions=ints, temperature=temperature)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), vocab=st.sampled_from([1, 2047, 2048, 2049, 32000, 151936]),
       defect=st.sampled_from(DEFECTS), data=st.data(), static=st.booleans())
def test_sampler_kernel_flags_catch_every_defect(triton_backend, rows, vocab, defect, data, static):
    row, col = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, vocab - 1))
    logits, kw = _defective(rows, vocab, defect, row, col, seed=rows * 7 + col)
    cpu = {k: v.cpu() for k, v in kw.items()}
    with pytest.raises(ContractError) as want:   # the torch backend's message on the same values
        reference.sample(logits.cpu(), cpu["seeds"], cpu["seq_ids"], cpu["positions"], cpu["temperature"],
                         torch.zeros(rows, dtype=torch.int64), torch.ones(rows))
    if static:
        with ops.static_decode():
            ops.sample(logits, **kw)
        with pytest.raises(ContractError) as got:
            chk.flush()
        expected = (reference.OVERFLOW_MESSAGE if defect == "overflow" else reference.LOGITS_VERDICT)
        assert expected in str(got.value), str(got.value)
    else:
        with pytest.raises(ContractError) as got:
            ops.sample(logits, **kw)
        assert str(got.value) == str(want.value)


def test_sampler_kernel_flags_pass_clean_logits_with_masked_tokens(triton_backend):
    g = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(64, 151936, generator=g, device="cuda") * 3
    logits[torch.rand(64, 151936, generator=g, device="cuda") < 0.5] = float("-inf")
    logits[:, 7] = 0.0
    ints = torch.arange(64, device="cuda")
    kw = dict(seeds=ints, seq_ids=ints, positions=ints, temperature=torch.full((64,), 0.7, device="cuda"))
    eager = ops.sample(logits, **kw)
    with ops.static_decode():
        static = ops.sample(logits, **kw)
    chk.flush()
    assert_bitwise_equal(static, eager, "static vs eager tokens")


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([1, 2, 1023, 1024, 1025, 462 * 1024, 3 * 2 ** 20 + 1]), bf16=st.booleans(), data=st.data())
def test_finite_verdict_is_isfinite_all_on_the_device(n, bf16, data):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = torch.randn(n, device="cuda").to(torch.bfloat16 if bf16 else torch.float32)
    for _ in range(data.draw(st.integers(0, 2))):
        t[data.draw(st.integers(0, n - 1))] = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf"),
                                                                          3.0e38, -0.0]))
    assert_bitwise_equal(chk.finite_verdict(t), torch.isfinite(t).all(), "finite_verdict vs isfinite().all()")
