"""The native sampler (``ops.sample(..., profile="native")``): an exponential race over the filtered logits,
in its eager form (noise from a generator seeded by seeds[0]) and its static form (``ops.static_decode``:
what the decode graphs capture; noise from the default generator, no host read).

Deterministic checks that hold for every draw, over shapes (degenerate sizes included: no rows, a vocab
of one): greedy rows give argmax, a top-k row never emits a token below its k-th largest logit, a top-p
row never emits a token outside its nucleus (the mass of the tokens strictly more likely than it is below
top_p), masked (-inf) tokens are never emitted. One frequency check with fixed seeds (deterministic, not
a statistical test): the draw follows softmax(z / T), which a wrong sign or scale of the noise breaks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract.errors import ContractError
from tests.bitwise import assert_bitwise_equal

FORMS = ("eager", "static")


def _draw(form: str, logits, **kw):
    kw.setdefault("seeds", 5)
    kw.setdefault("seq_ids", 0)
    kw.setdefault("positions", 0)
    if form == "static":
        with ops.static_decode():
            return ops.sample(logits, profile="native", **kw)
    return ops.sample(logits, profile="native", **kw)


@st.composite
def rows_of_logits(draw, min_vocab=1):
    rows = draw(st.integers(0, 6))
    vocab = draw(st.sampled_from([min_vocab, 2, 3, 17, 64, 257]))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([0.1, 1.0, 8.0]))
    logits = torch.randn(rows, max(vocab, min_vocab), generator=torch.Generator().manual_seed(seed)) * scale
    return logits, seed


def _first_violation(ok: torch.Tensor) -> str:
    bad = (~ok).nonzero()
    return "" if not bad.numel() else f"first violating row {bad[0].item()}"


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=25, deadline=None)
@given(case=rows_of_logits(), k=st.integers(0, 300), p=st.sampled_from([1.0, 0.9, 0.5, 1e-6]))
def test_greedy_rows_take_the_argmax_whatever_the_filters(form, case, k, p):
    logits, seed = case
    got = _draw(form, logits, seeds=seed, temperature=0.0, top_k=k, top_p=p)
    assert_bitwise_equal(got, logits.argmax(-1), "native greedy vs argmax")


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=25, deadline=None)
@given(case=rows_of_logits(), k=st.integers(1, 20), t=st.sampled_from([0.3, 1.0, 2.5]))
def test_top_k_never_emits_below_the_kth_logit(form, case, k, t):
    logits, seed = case
    torch.manual_seed(seed)
    got = _draw(form, logits, seeds=seed, temperature=t, top_k=k)
    if not logits.shape[0]:
        assert got.shape == (0,)
        return
    kth = logits.topk(min(k, logits.shape[1]), dim=-1).values[:, -1]
    ok = logits.gather(1, got[:, None])[:, 0] >= kth      # ties at the k-th value may keep either token
    assert bool(ok.all()), f"top_k={k}: emitted below the k-th logit, {_first_violation(ok)}"


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=25, deadline=None)
@given(case=rows_of_logits(), p=st.sampled_from([0.9, 0.5, 0.1, 1e-6]), t=st.sampled_from([0.5, 1.0, 2.0]))
def test_top_p_never_emits_outside_the_nucleus(form, case, p, t):
    logits, seed = case
    torch.manual_seed(seed)
    got = _draw(form, logits, seeds=seed, temperature=t, top_p=p)
    if not logits.shape[0]:
        return
    probs = torch.softmax(logits.double() / t, dim=-1)
    z = logits.gather(1, got[:, None])
    mass_above = torch.where(logits > z, probs, 0.0).sum(-1)
    ok = mass_above < p + 1e-6      # fp32 prefix sums in the op: a margin far below any step of the nucleus
    assert bool(ok.all()), f"top_p={p}: emitted outside the nucleus, {_first_violation(ok)}"


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=20, deadline=None)
@given(case=rows_of_logits(min_vocab=2), k=st.integers(1, 8), p=st.sampled_from([0.9, 0.3]))
def test_per_row_settings_and_masked_tokens(form, case, k, p):
    """Rows with their own temperature / top-k / top-p (one greedy row), and -inf masked tokens: every row
    keeps its own filter and no masked token is ever emitted."""
    logits, seed = case
    rows, vocab = logits.shape
    if not rows:
        return
    g = torch.Generator().manual_seed(seed + 1)
    masked = torch.rand(rows, vocab, generator=g) < 0.3
    masked[:, 0] = False                                   # every row keeps a finite logit
    logits = logits.masked_fill(masked, float("-inf"))
    temperature = torch.linspace(0.0, 2.0, rows)           # row 0 greedy
    top_k = torch.arange(rows) % (k + 1)                   # 0 = off on some rows
    top_p = torch.where(torch.arange(rows) % 2 == 0, 1.0, p).float()
    torch.manual_seed(seed)
    got = _draw(form, logits, seeds=seed, temperature=temperature, top_k=top_k, top_p=top_p)
    assert not bool(masked.gather(1, got[:, None]).any()), "a masked token was emitted"
    assert int(got[0]) == int(logits[0].argmax())
    for r in range(1, rows):
        z = logits[r, got[r]]
        if top_k[r] > 0:
            assert z >= logits[r].topk(min(int(top_k[r]), vocab)).values[-1], f"row {r} outside its top-{int(top_k[r])}"
        if top_p[r] < 1 and top_k[r] == 0:
            probs = torch.softmax(logits[r].double() / temperature[r].double(), dim=-1)
            assert probs[logits[r] > z].sum() < top_p[r] + 1e-6, f"row {r} outside its nucleus"


@pytest.mark.parametrize("form", FORMS)
def test_draws_follow_the_tempered_softmax(form):
    """20,000 rows of the same 4 logits at T = 2 (fixed seeds: a deterministic check): each token's frequency
    within 0.02 of softmax(z / T) (about 6 standard deviations), and with top_k=2 only the top two, in the
    ratio of their probabilities."""
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).expand(20000, 4).contiguous()
    want = torch.softmax(logits[0] / 2.0, dim=-1)
    got = torch.bincount(_draw(form, logits, seeds=123, temperature=2.0), minlength=4).double() / 20000
    assert (got - want).abs().max() < 0.02, (got.tolist(), want.tolist())
    top2 = torch.bincount(_draw(form, logits, seeds=7, temperature=2.0, top_k=2), minlength=4).double() / 20000
    want2 = torch.tensor([0.0, 0.0, *torch.softmax(torch.tensor([1.0, 1.5], dtype=torch.float64), 0).tolist()])
    assert (top2 - want2).abs().max() < 0.02, (top2.tolist(), want2.tolist())


def test_eager_draws_are_keyed_by_the_first_seed_and_static_by_the_default_generator():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    a = _draw("eager", logits, seeds=torch.arange(8) + 3)
    assert_bitwise_equal(_draw("eager", logits, seeds=torch.full((8,), 3)), a, "eager: seeded by seeds[0]")
    torch.manual_seed(1)
    s = _draw("static", logits)
    torch.manual_seed(1)
    assert_bitwise_equal(_draw("static", logits, seeds=99), s, "static: the default generator, not the seeds")


def test_static_form_checks_values_on_the_device():
    """The static form reads nothing on the host: bad settings become device verdicts (raised at once on the
    CPU), with the same fix-naming message family as the eager checks."""
    logits = torch.randn(3, 10)
    with pytest.raises(ContractError, match="temperature"):
        _draw("static", logits, temperature=-1.0)
    with pytest.raises(ContractError, match="top_p"):
        _draw("eager", logits, top_p=0.0)
    with pytest.raises(ContractError, match="top_p"):
        _draw("static", logits, top_p=0.0)
