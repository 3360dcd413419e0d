"""TIS/MIS corrections and the logprob comparison statistics on hand-computed cases."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.algos import logprob_mismatch_stats, sequence_mis, sequence_tis, token_mis, token_tis
from tests.bitwise import assert_close_report

D = torch.float64


def close(actual, expected, tol=1e-12):
    assert_close_report(actual.detach(), torch.as_tensor(expected, dtype=D), atol=tol, rtol=0)


# trainer/rollout ratios rho = 2, 1.5 (seq 0) and 0.5 (seq 1); a masked-out prompt token first
RHO = [2.0, 1.5, 0.5]
OLD = torch.tensor([-7.0] + [math.log(r) for r in RHO], dtype=D)
ROLLOUT = torch.tensor([-1.0, 0.0, 0.0, 0.0], dtype=D)
MASK = torch.tensor([False, True, True, True])
SEQ = torch.tensor([0, 0, 0, 1])
K3 = sum(r - math.log(r) - 1 for r in RHO) / 3


def test_token_tis():
    out = token_tis(OLD, ROLLOUT, MASK, cap=1.8)
    close(out.weights, [0.0, 1.8, 1.5, 0.5])
    assert out.mask.tolist() == MASK.tolist()
    close(out.stats["truncated_frac"], 1 / 3)
    close(out.stats["ratio_mean"], 4 / 3)
    close(out.stats["ratio_max"], 2.0)
    close(out.stats["ratio_min"], 0.5)
    close(out.stats["kl_k3"], K3)


def test_sequence_tis_product_and_geometric():
    out = sequence_tis(OLD, ROLLOUT, MASK, SEQ, cap=2.0)
    # seq 0: 2 * 1.5 = 3 -> capped at 2; seq 1: 0.5
    close(out.weights, [0.0, 2.0, 2.0, 0.5])
    close(out.stats["truncated_frac"], 0.5)
    close(out.stats["seq_ratio_max"], 3.0)
    geo = sequence_tis(OLD, ROLLOUT, MASK, SEQ, cap=2.0, ratio="geometric")
    close(geo.weights, [0.0, math.sqrt(3), math.sqrt(3), 0.5])
    close(geo.stats["truncated_frac"], 0.0)


def test_token_mis():
    out = token_mis(OLD, ROLLOUT, MASK, low=0.6, high=1.8)
    assert out.mask.tolist() == [False, False, True, False]
    close(out.weights, [0, 0, 1, 0])
    close(out.stats["masked_frac"], 2 / 3)


def test_sequence_mis_bounds_inclusive():
    out = sequence_mis(OLD, ROLLOUT, MASK, SEQ, low=0.5, high=1.5, ratio="geometric")
    # seq 0: sqrt(3) = 1.73 > 1.5 dropped; seq 1: 0.5 kept (bounds inclusive)
    assert out.mask.tolist() == [False, False, False, True]
    close(out.stats["masked_frac"], 0.5)
    prod = sequence_mis(OLD, ROLLOUT, MASK, SEQ, low=0.5, high=3.0, ratio="product")
    assert prod.mask.tolist() == [False, True, True, True]


def test_weights_keep_input_dtype():
    out = token_tis(OLD.float(), ROLLOUT.float(), MASK)
    assert out.weights.dtype == torch.float32


def test_huge_ratio_stays_finite():
    out = sequence_tis(torch.tensor([0.0, 0.0]), torch.tensor([-60.0, -60.0]), torch.ones(2, dtype=torch.bool),
                       torch.tensor([0, 0]), cap=2.0)
    assert out.weights.tolist() == [2.0, 2.0]
    assert math.isfinite(float(out.stats["seq_ratio_max"]))


def test_logprob_mismatch_stats():
    a = torch.tensor([-1.0, -2.0, -3.0, -4.0, 0.0])
    b = torch.tensor([-1.0, -2.5, -3.0, -9.0, -0.0])
    m = torch.tensor([True, True, True, False, True])
    s = logprob_mismatch_stats(a, b, m)
    assert int(s["tokens"]) == 4
    assert int(s["count"]) == 2  # -2 vs -2.5 and 0.0 vs -0.0 (raw bits); the masked-out token ignored
    close(s["max_abs"], 0.5)
    close(s["mean_abs"], 0.5 / 4)
    close(s["kl_k3"], (math.exp(0.5) - 0.5 - 1) / 4)
    same = logprob_mismatch_stats(a, a.clone(), m)
    assert int(same["count"]) == 0 and float(same["max_abs"]) == 0.0 and float(same["kl_k3"]) == 0.0


def test_errors():
    with pytest.raises(ValueError, match="cap must be > 0"):
        token_tis(OLD, ROLLOUT, MASK, cap=0.0)
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        token_mis(OLD, ROLLOUT, MASK, low=1.2, high=2.0)
    with pytest.raises(ValueError, match="unknown ratio"):
        sequence_tis(OLD, ROLLOUT, MASK, SEQ, ratio="mean")
    with pytest.raises(ValueError, match="dtypes differ"):
        logprob_mismatch_stats(OLD, ROLLOUT.float(), MASK)


def test_diff_distribution_hand_case():
    from rlalign.algos import logprob_diff_distribution
    out = logprob_diff_distribution(OLD, ROLLOUT, MASK)   # d = log 2, log 1.5, log 0.5 on the masked-in tokens
    close(out["abs_p50"], math.log(2.0))                  # |d| sorted: log 1.5, log 2, log 2
    close(out["abs_p99"], math.log(2.0))
    close(out["ratio_min"], 0.5)
    close(out["ratio_max"], 2.0)
    empty = logprob_diff_distribution(OLD, ROLLOUT, torch.zeros(4, dtype=torch.bool))
    assert {k: float(v) for k, v in empty.items()} == {"abs_p50": 0.0, "abs_p90": 0.0, "abs_p99": 0.0,
                                                       "ratio_min": 1.0, "ratio_max": 1.0}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0), st.booleans()), min_size=1, max_size=40),
       st.sampled_from([torch.float32, torch.float64]))
def test_diff_distribution_against_a_sorted_reference(rows, dtype):
    """Quantiles of |trainer - rollout| and the ratio's extremes over the masked-in tokens, any length (none
    masked in included), against a direct computation on the kept values; bits of masked-out tokens never matter."""
    from rlalign.algos import logprob_diff_distribution
    a = torch.tensor([r[0] for r in rows], dtype=dtype)
    b = torch.tensor([r[1] for r in rows], dtype=dtype)
    mask = torch.tensor([r[2] for r in rows])
    out = logprob_diff_distribution(a, b, mask)
    noisy = logprob_diff_distribution(torch.where(mask, a, torch.full_like(a, float("nan"))), b, mask)
    assert all(torch.equal(out[k], noisy[k]) for k in out)
    d = [float(x) - float(y) for x, y, m in zip(a.double(), b.double(), mask) if m]
    if not d:
        assert float(out["ratio_min"]) == float(out["ratio_max"]) == 1.0 and float(out["abs_p99"]) == 0.0
        return
    s = sorted(abs(x) for x in d)
    for q in (0.5, 0.9, 0.99):   # linear interpolation between the order statistics
        pos = q * (len(s) - 1)
        lo = int(math.floor(pos))
        want = s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)
        assert float(out[f"abs_p{round(q * 100)}"]) == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert float(out["ratio_min"]) == pytest.approx(math.exp(min(d)), rel=1e-12)
    assert float(out["ratio_max"]) == pytest.approx(math.exp(max(d)), rel=1e-12)
