"""The strict decode step's folded checks.

* The Triton sampler checks the logits (no NaN/+inf, a finite logit per row) and the overflow of
  logits / temperature inside its kernel (per-row flags, one reduction): under the interpreter, for
  hypothesis-chosen sizes and defect positions, it gives the torch backend's tokens on clean input and its
  error, message for message, on a defective one (tests/ops/sample_checks_worker.py, in a subprocess:
  the interpreter must be on before triton is imported).
* ``_checks.finite_verdict`` (the deferred finiteness verdict of every GPU / captured check) is exactly
  ``isfinite(t).all()`` for every placement of NaN / ±inf / extreme finite values, bf16 and fp32, and costs
  two torch ops.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign.contract import ContractError
from rlalign.ops import _checks as chk
from tests.bitwise import assert_bitwise_equal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECIAL = (float("nan"), float("inf"), float("-inf"), 3.0e38, -3.0e38, 1e-45, -0.0, 0.0)


def test_triton_sampler_folded_checks_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.ops.sample_checks_worker", "10"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-4000:] + proc.stderr[-4000:]


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), bf16=st.booleans(), data=st.data())
def test_finite_verdict_is_isfinite_all(shape, bf16, data):
    t = torch.randn(*shape).to(torch.bfloat16 if bf16 else torch.float32)
    for _ in range(data.draw(st.integers(0, 3))):
        index = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
        t[index] = data.draw(st.sampled_from(SPECIAL))
    got = chk.finite_verdict(t)
    assert got.dtype == torch.bool and got.dim() == 0
    assert_bitwise_equal(got, torch.isfinite(t).all(), f"finite_verdict of {t.flatten().tolist()}")


def test_captured_finite_checks_record_the_verdict_in_two_ops():
    from benchmarks.count_decode_ops import CountKernels
    clean = torch.randn(5, 3, 8, dtype=torch.bfloat16)
    bad = clean.clone()
    bad[4, 2, 7] = float("-inf")
    mode = CountKernels()
    with chk.use_check_policy(chk.BOUNDARY), chk.capturing_graph() as verdicts, mode:
        chk.finite("write_kv_cache", "k", clean)
        chk.finite("write_kv_cache", "k", bad)
    assert [bool(ok) for _, _, ok in verdicts] == [True, False]
    assert sum(mode.ops.values()) == 4, f"two ops per verdict expected, got {dict(mode.ops)}"
    with chk.use_check_policy(chk.PER_OP), pytest.raises(ContractError, match=r"k contains NaN or inf \(first at "
                                                                                r"index \[4, 2, 7\], value -inf"):
        chk.finite("write_kv_cache", "k", bad)   # the CPU's eager check still names the first bad index
