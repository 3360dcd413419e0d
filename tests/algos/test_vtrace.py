"""vtrace_gae: GAE on an older policy's samples with V-trace value targets, against a float64 reference written as a
plain Python loop of the formulas in its docstring; equal to gae_advantages bit for bit where every ratio is 1."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings, strategies as st

from rlalign.algos import gae_advantages, vtrace_gae
from tests.bitwise import assert_bitwise_equal


def reference(rewards, values, log_ratio, lengths, gamma, lam, rho_cap, c_cap):
    """float64 lists: (advantages, value targets) of consecutive sequences of ``lengths``, loop by loop."""
    adv, targets, start = [], [], 0
    for n in lengths:
        r, v = rewards[start:start + n], values[start:start + n]
        ratio = [math.exp(x) for x in log_ratio[start:start + n]]
        rho, c = [min(rho_cap, x) for x in ratio], [min(c_cap, x) for x in ratio]
        delta = [r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
        a, gap = [0.0] * n, [0.0] * n
        for t in range(n - 1, -1, -1):
            later_a = gamma * lam * c[t + 1] * a[t + 1] if t + 1 < n else 0.0
            a[t] = delta[t] + later_a
            later_gap = gamma * lam * c[t] * gap[t + 1] if t + 1 < n else 0.0
            gap[t] = rho[t] * delta[t] + later_gap
        adv += a
        targets += [g + x for g, x in zip(gap, v)]
        start += n
    return adv, targets


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), seed=st.integers(0, 2**31 - 1),
       gamma=st.sampled_from([1.0, 0.99, 0.5]), lam=st.sampled_from([1.0, 0.95, 0.0]),
       rho_cap=st.sampled_from([1.0, 2.0, 0.5]), c_cap=st.sampled_from([1.0, 0.8, 3.0]),
       spread=st.sampled_from([0.0, 0.3, 3.0]))
def test_vtrace_gae_matches_a_float64_loop(lengths, seed, gamma, lam, rho_cap, c_cap, spread):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    r, v = torch.randn(total, generator=g, dtype=torch.float64), torch.randn(total, generator=g, dtype=torch.float64)
    lr = spread * torch.randn(total, generator=g, dtype=torch.float64)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = torch.ones(total, dtype=torch.bool)
    adv, targets = vtrace_gae(r, v, lr, seq, mask, gamma=gamma, lam=lam, rho_cap=rho_cap, c_cap=c_cap)
    want_adv, want_targets = reference(r.tolist(), v.tolist(), lr.tolist(), lengths, gamma, lam, rho_cap, c_cap)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(targets, torch.tensor(want_targets, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # the sequences interleaved among masked-out tokens (each keeps its own order) give the same values
    dest = torch.randperm(total + 3, generator=g)
    for i in range(len(lengths)):
        at = (seq == i).nonzero()[:, 0]
        dest[at] = dest[at].sort().values
    place = lambda x, fill: torch.full((total + 3,), fill, dtype=x.dtype).index_copy(0, dest[:total], x)   # noqa: E731
    adv2, targets2 = vtrace_gae(place(r, 7.0), place(v, 7.0), place(lr, 7.0), place(seq, 0), place(mask, False),
                                gamma=gamma, lam=lam, rho_cap=rho_cap, c_cap=c_cap)
    assert_bitwise_equal(adv2[dest[:total]], adv, "advantages, interleaved")
    assert_bitwise_equal(targets2[dest[:total]], targets, "targets, interleaved")
    assert bool((adv2[dest[total:]] == 0).all() and (targets2[dest[total:]] == 0).all())


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1),
       gamma=st.sampled_from([1.0, 0.99]), lam=st.sampled_from([1.0, 0.95, 0.9]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_on_policy_vtrace_is_gae_bit_for_bit(lengths, seed, gamma, lam, dtype):
    """log_ratio exactly 0 (the proximal policy sampled every token): GAE's advantages and returns, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    r, v = torch.randn(total, generator=g).to(dtype), torch.randn(total, generator=g).to(dtype)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = torch.rand(total, generator=g) < 0.8
    adv, ret = gae_advantages(r, v, seq, mask, gamma=gamma, lam=lam, num_seqs=len(lengths))
    vadv, vret = vtrace_gae(r, v, torch.zeros(total, dtype=dtype), seq, mask, gamma=gamma, lam=lam,
                            num_seqs=len(lengths))
    assert_bitwise_equal(vadv, adv, "advantages")
    assert_bitwise_equal(vret, ret, "value targets")
