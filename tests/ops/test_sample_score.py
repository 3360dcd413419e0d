"""ops.sample_and_score (the one owner of sample-and-score) and the temperature rule (ops/temperature.py).

The owner must give, for every row, exactly the composition its docstring states, computed for that row
alone: lm_logits -> sample -> logprob_entropy at the logprob temperature (T, or 1 for greedy), whatever
else shares the call (other temperatures, top-k/top-p, row counts 0 and 1), in whatever form the
per-row settings come (number, list, tensor). The reference below writes the rule out independently.
"""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract.errors import ContractError
from rlalign.ops.temperature import divide_by_temperature, logprob_temperature, temperature_divisor
from tests.bitwise import assert_bitwise_equal

SETTINGS = dict(max_examples=25, deadline=None)
TEMPS = [0.0, 0.3, 0.7, 1.0, 1.7]


def head(rows: int, vocab: int, hdim: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, hdim, generator=g) * 2).to(dtype)
    weight = torch.randn(vocab, hdim, generator=g).to(dtype)
    return hidden, weight


def reference(hidden, weight, seeds, positions, temps, ks, ps):
    """Each row alone through the three ops; the logprob temperature written out: T, or 1.0 when greedy."""
    tokens, logprobs = [], []
    for i in range(hidden.shape[0]):
        h = hidden[i:i + 1]
        tok = ops.sample(ops.lm_logits(h, weight), seeds=seeds[i], seq_ids=seeds[i], positions=positions[i],
                         temperature=temps[i], top_k=ks[i], top_p=ps[i])
        lp, _ = ops.logprob_entropy(h, weight, tok, temperature=temps[i] if temps[i] > 0 else 1.0, with_entropy=False)
        tokens.append(tok)
        logprobs.append(lp)
    if not tokens:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32)
    return torch.cat(tokens), torch.cat(logprobs)


def as_form(values: list, form: str, dtype: torch.dtype):
    if form == "list":
        return values
    if form == "tensor":
        return torch.tensor(values, dtype=dtype)
    return values[0]  # "scalar": only used when every row shares the value


@settings(**SETTINGS)
@given(data=st.data(), rows=st.integers(0, 9), vocab=st.sampled_from([1, 2, 37, 300, 1025, 2100]),
       hdim=st.sampled_from([8, 24]), bf16=st.booleans(), seed=st.integers(0, 2 ** 20))
def test_each_row_is_the_documented_composition_computed_alone(data, rows, vocab, hdim, bf16, seed):
    hidden, weight = head(rows, vocab, hdim, torch.bfloat16 if bf16 else torch.float32, seed)
    uniform = data.draw(st.booleans(), "uniform settings")
    n = 1 if uniform else rows
    temps = data.draw(st.lists(st.sampled_from(TEMPS), min_size=n, max_size=n), "temps")
    ks = data.draw(st.lists(st.sampled_from([0, 1, 5, vocab + 3]), min_size=n, max_size=n), "top_k")
    ps = data.draw(st.lists(st.sampled_from([1.0, 0.9, 0.3]), min_size=n, max_size=n), "top_p")
    if uniform:
        temps, ks, ps = temps * rows, ks * rows, ps * rows
    seeds = [seed * 7 + i for i in range(rows)]
    positions = [3 * i + 1 for i in range(rows)]
    form = data.draw(st.sampled_from(["list", "tensor", "scalar"] if uniform and rows else ["list", "tensor"]), "form")
    if rows == 0 and form == "tensor":
        form = "list"
    tokens, logprobs = ops.sample_and_score(
        hidden, weight, seeds=torch.tensor(seeds, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64), temperature=as_form(temps, form, torch.float32),
        top_k=as_form(ks, form, torch.int64), top_p=as_form(ps, form, torch.float32))
    want_tokens, want_lp = reference(hidden, weight, seeds, positions, temps, ks, ps)
    assert_bitwise_equal(tokens, want_tokens, "tokens")
    assert_bitwise_equal(logprobs, want_lp, "logprobs")


def test_without_logprobs_samples_the_same_tokens():
    hidden, weight = head(6, 300, 16, torch.float32, 1)
    args = dict(seeds=torch.arange(6), positions=torch.arange(6) + 4, temperature=[0.0, 0.7, 0.7, 1.0, 1.7, 0.3],
                top_k=5, top_p=0.9)
    tokens, logprobs = ops.sample_and_score(hidden, weight, **args)
    only, none = ops.sample_and_score(hidden, weight, with_logprobs=False, **args)
    assert none is None
    assert_bitwise_equal(only, tokens, "tokens with and without logprobs")
    assert logprobs.shape == (6,) and bool(torch.isfinite(logprobs).all())


def test_given_masked_logits_are_sampled_as_masked_and_scored_unmasked():
    """vLLM hands its (possibly masked) logits: the token obeys the mask, the logprob is the policy's."""
    hidden, weight = head(5, 200, 16, torch.float32, 2)
    logits = ops.lm_logits(hidden, weight)
    free = logits.argmax(-1)
    masked = logits.clone()
    masked[torch.arange(5), free] = float("-inf")
    temps = [0.0, 0.5, 1.0, 1.0, 2.0]
    tokens, logprobs = ops.sample_and_score(hidden, weight, seeds=torch.arange(5) + 11, positions=torch.arange(5),
                                            temperature=temps, logits=masked)
    assert not bool((tokens == free).any())
    for i, t in enumerate(temps):
        want, _ = ops.logprob_entropy(hidden[i:i + 1], weight, tokens[i:i + 1], temperature=t or 1.0,
                                      with_entropy=False)
        assert_bitwise_equal(logprobs[i:i + 1], want, f"row {i} (T={t})")


def test_native_profile_is_the_composition_on_the_whole_batch():
    hidden, weight = head(4, 120, 16, torch.float32, 3)
    seeds, positions = torch.arange(4) + 5, torch.arange(4)
    tokens, logprobs = ops.sample_and_score(hidden, weight, seeds=seeds, positions=positions, temperature=0.8,
                                            profile="native")
    want = ops.sample(ops.lm_logits(hidden, weight, profile="native"), seeds=seeds, seq_ids=seeds,
                      positions=positions, temperature=0.8, profile="native")
    want_lp, _ = ops.logprob_entropy(hidden, weight, want, temperature=0.8, with_entropy=False, profile="native")
    assert_bitwise_equal(tokens, want, "native tokens")
    assert_bitwise_equal(logprobs, want_lp, "native logprobs")


def test_bad_settings_fail_closed_with_one_line():
    hidden, weight = head(2, 50, 8, torch.float32, 4)
    with pytest.raises(ContractError, match="temperature must be finite and >= 0"):
        ops.sample_and_score(hidden, weight, seeds=1, positions=0, temperature=[0.5, -1.0])
    with pytest.raises(ContractError, match="top_p must be in"):
        ops.sample_and_score(hidden, weight, seeds=1, positions=0, top_p=[0.5, 0.0])


# ---- the temperature rule ------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(t=st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False))
def test_logprob_temperature_is_the_sampling_one_when_sampling(t):
    assert logprob_temperature(t) == t


@pytest.mark.parametrize("greedy", [0, 0.0, -0.0])
def test_greedy_tokens_are_scored_at_temperature_one(greedy):
    assert logprob_temperature(greedy) == 1.0


@pytest.mark.parametrize("bad", [-0.5, -1e-30, math.inf, -math.inf, math.nan, True, "0.7", None])
def test_logprob_temperature_refuses_what_is_no_temperature(bad):
    with pytest.raises(ContractError, match="rlalign.ops.logprob_temperature: temperature must be"):
        logprob_temperature(bad)


@settings(**SETTINGS)
@given(rows=st.integers(1, 6), vocab=st.sampled_from([1, 40, 1500]), seed=st.integers(0, 2 ** 20),
       t=st.sampled_from([0.05, 0.3, 0.7, 1.0, 1.3, 3.0]))
def test_sampler_and_scorer_divide_alike(rows, vocab, seed, t):
    """The z the sampler draws from (per-row divisor of the T=1 logits) is, bit for bit, the z the logprob
    op reduces (lm_logits at T: the op's own scalar divisor); T == 1 skips the division, greedy rows
    (T = 0) keep the raw logits."""
    hidden, weight = head(rows, vocab, 16, torch.float32, seed)
    raw = ops.lm_logits(hidden, weight)
    scorer_z = ops.lm_logits(hidden, weight, temperature=t)
    per_row = divide_by_temperature(raw, temperature_divisor(torch.full((rows,), t), raw.device))
    assert_bitwise_equal(per_row, scorer_z, f"per-row divisor vs the logprob op's z at T={t}")
    assert_bitwise_equal(divide_by_temperature(raw, temperature_divisor(t, raw.device)), scorer_z, "scalar divisor")
    greedy = divide_by_temperature(raw, temperature_divisor(torch.zeros(rows), raw.device))
    assert_bitwise_equal(greedy, raw, "greedy rows")
    assert temperature_divisor(1.0, raw.device) is None


def test_divide_in_place_overwrites_only_when_asked():
    x = torch.tensor([[1.0, 3.0]])
    d = temperature_divisor(0.5, x.device)
    y = divide_by_temperature(x, d)
    assert x.tolist() == [[1.0, 3.0]] and y.tolist() == [[2.0, 6.0]]
    assert divide_by_temperature(x, d, in_place=True) is x and x.tolist() == [[2.0, 6.0]]


def test_mis_sized_inputs_fail_closed():
    hidden, weight = head(3, 50, 8, torch.float32, 5)
    with pytest.raises(ContractError, match="temperature has 2 values for 3 rows"):
        ops.sample_and_score(hidden, weight, seeds=1, positions=0, temperature=[0.5, 0.5])
    with pytest.raises(ContractError, match="top_k has 4 values for 3 rows"):
        ops.sample_and_score(hidden, weight, seeds=1, positions=0, top_k=[1, 1, 1, 1])
    with pytest.raises(ContractError, match=r"logits must be \[S, V\] with one row per hidden row \(S = 3\)"):
        ops.sample_and_score(hidden, weight, seeds=1, positions=0, logits=ops.lm_logits(hidden[:2], weight))
    with pytest.raises(ContractError, match="hidden"):
        ops.sample_and_score(hidden[0], weight, seeds=1, positions=0)
