"""ops.sampled_logprob and min-p: the scorer's kept set is the sampler's, exactly; the kept-set log-prob and its
gradient against float64; sample_and_score(logprobs="sampled") equals the trainer's op bit for bit, whatever the
batch; the sampler's frequencies follow the renormalised probabilities (a chi-square test with fixed seeds: it
always passes or always fails).

Logits are drawn with ties and near-ties (values equal up to the last bit) and degenerate rows (vocab 1 and 2, one
kept token)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract.errors import ContractError
from rlalign.ops.sampled_logprob import kept_boundary, kept_from_boundary
from rlalign.ops.torch_backend import sample as backend
from tests.bitwise import assert_bitwise_equal

SETTINGS = dict(max_examples=25, deadline=None)
TEMPERATURES = st.sampled_from([0.0, 0.35, 0.7, 1.0, 1.9])
TOP_K = st.sampled_from([0, 1, 2, 3, 7, 10 ** 6])
TOP_P = st.sampled_from([1.0, 0.05, 0.5, 0.8, 0.97])
MIN_P = st.sampled_from([0.0, 0.01, 0.2, 0.9, 1.0])


def tied_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """fp32 logits on a coarse grid (exact ties), a quarter of them nudged one ulp up or down (near-ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-6, 7, (rows, vocab), generator=g).float() * 0.5
    nudge = torch.randint(0, 8, (rows, vocab), generator=g)
    up, down = torch.nextafter(x, torch.tensor(math.inf)), torch.nextafter(x, torch.tensor(-math.inf))
    return torch.where(nudge == 0, up, torch.where(nudge == 1, down, x))


def row_settings(data, rows: int):
    pick = lambda s: [data.draw(s) for _ in range(rows)]   # noqa: E731
    return dict(temperature=torch.tensor(pick(TEMPERATURES)), top_k=torch.tensor(pick(TOP_K)),
                top_p=torch.tensor(pick(TOP_P)), min_p=torch.tensor(pick(MIN_P)))


def sampler_kept(logits, s, monkeypatch) -> torch.Tensor:
    """The set the sampler itself draws each row from: the keep masks it computes (filtering rows), the argmax
    (greedy rows), every finite token (the rest)."""
    seen = []
    real = backend.keep_mask

    def recording(z, k, top_p, candidates=None):
        mask = real(z, k, top_p, candidates)
        seen.append(mask)
        return mask
    monkeypatch.setattr(backend, "keep_mask", recording)
    ops.sample(logits, seeds=1, seq_ids=0, positions=0, **s)
    monkeypatch.setattr(backend, "keep_mask", real)
    rows, vocab = logits.shape
    kept = torch.isfinite(logits).clone()
    greedy = s["temperature"] == 0
    kept[greedy] = torch.nn.functional.one_hot(logits[greedy].argmax(-1), vocab).bool()
    if seen:   # the rows it filtered, in order
        z = logits / torch.where(greedy, 1.0, s["temperature"]).unsqueeze(-1)
        k = backend.min_p_top_k(z, s["top_k"], s["min_p"])
        k = torch.where(k >= vocab, 0, k)
        filtered = ~greedy & ((k > 0) | (s["top_p"] < 1))
        assert len(seen) == 1 and seen[0].shape[0] == int(filtered.sum())
        kept[filtered] = seen[0] & torch.isfinite(logits[filtered])
    return kept


@settings(**SETTINGS)
@given(data=st.data(), rows=st.integers(1, 9), vocab=st.sampled_from([1, 2, 3, 17, 300]), seed=st.integers(0, 2 ** 20))
def test_scorer_kept_set_is_the_samplers(data, rows, vocab, seed):
    logits = tied_logits(rows, vocab, seed)
    s = row_settings(data, rows)
    with pytest.MonkeyPatch.context() as mp:
        want = sampler_kept(logits, s, mp)
    z, kept = backend.kept_set(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"])
    assert torch.equal(kept, want), (kept ^ want).nonzero()[:4]
    # the two numbers a row the backward keeps (the last kept token of the order and its z) rebuild the set
    assert torch.equal(kept_from_boundary(z, *kept_boundary(z, kept)), kept)
    with ops.static_decode():   # the static form (CUDA-graph capture) keeps the same set
        _, static = backend.kept_set(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"])
    ops.flush_deferred_checks()
    assert torch.equal(static, kept)
    # and every drawn token lies in it, for many keys
    many = logits.repeat(40, 1)
    tokens = ops.sample(many, seeds=seed, seq_ids=torch.arange(many.shape[0]), positions=3,
                        **{k: v.repeat(40) for k, v in s.items()})
    assert bool(kept.repeat(40, 1).gather(1, tokens[:, None]).all())


@settings(**SETTINGS)
@given(vocab=st.integers(1, 400), min_p=st.floats(0.0, 1.0), seed=st.integers(0, 2 ** 20))
def test_min_p_keeps_a_prefix_with_the_stated_rule(vocab, min_p, seed):
    """min-p alone keeps exactly the tokens with fp32 exp(z - max z) >= fp32(min_p), a prefix of (z desc, id asc)."""
    logits = tied_logits(1, vocab, seed)
    mp = torch.tensor([min_p], dtype=torch.float32)
    one = torch.ones(1)
    _, kept = backend.kept_set(logits, one, torch.zeros(1, dtype=torch.int64), one, mp)
    rule = torch.exp(logits - logits.max()) >= mp if min_p > 0 else torch.ones_like(logits, dtype=torch.bool)
    assert torch.equal(kept, rule)
    order = sorted(range(vocab), key=lambda v: (-float(logits[0, v]), v))
    flags = [bool(kept[0, v]) for v in order]
    assert flags == sorted(flags, reverse=True) and flags[0]


def float64_reference(h, w, targets, temperature, keep):
    """(logprob, entropy) of the kept set's renormalised softmax in float64, differentiable (K held fixed)."""
    z = (h.double() @ w.double().t()) / temperature
    z = z.masked_fill(~keep, -math.inf)
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    ent = -(p * torch.where(keep, logp, torch.zeros((), dtype=z.dtype))).sum(-1)
    return logp.gather(1, targets[:, None])[:, 0], ent


@settings(max_examples=15, deadline=None)
@given(tokens=st.integers(1, 40), vocab=st.sampled_from([1, 2, 5, 64, 700]), temperature=st.sampled_from([0.4, 1.0, 1.6]),
       top_k=TOP_K, top_p=TOP_P, min_p=MIN_P, seed=st.integers(0, 2 ** 20))
def test_logprob_and_gradient_match_float64(tokens, vocab, temperature, top_k, top_p, min_p, seed):
    """Forward within 2e-5 (abs) of float64 and gradients within 1e-4 x max|g64| + 1e-6 (abs), per element, of float64
    autograd through the kept logits (the kept set held fixed); tokens outside K get no gradient."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, 24, generator=g, requires_grad=True)
    w = (torch.randn(vocab, 24, generator=g) * 0.5).requires_grad_()
    settings_ = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = ops.lm_logits(h.detach(), w.detach())
    _, keep = backend.kept_set(logits, *(torch.full((tokens,), v, dtype=torch.int64 if k == "top_k" else torch.float32)
                                         for k, v in settings_.items()))
    # targets: kept tokens (what the sampler draws)
    targets = torch.multinomial(keep.float(), 1, generator=g)[:, 0]
    out = ops.sampled_logprob(h, w, targets, with_entropy=True, **settings_)
    a, b = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    ((a * out.logprob).sum() + (b * out.entropy).sum()).backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp64, ent64 = float64_reference(h64, w64, targets, temperature, keep)
    ((a.double() * lp64).sum() + (b.double() * ent64).sum()).backward()
    assert torch.allclose(out.logprob.double(), lp64.detach(), atol=2e-5, rtol=0)
    assert torch.allclose(out.entropy.double(), ent64.detach(), atol=2e-5, rtol=0)
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        tol = 1e-4 * float(want.abs().max()) + 1e-6
        assert float((got.double() - want).abs().max()) <= tol
    assert torch.equal(out.kept, keep.sum(-1))


def test_one_kept_token_scores_exactly_zero_with_no_gradient():
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    targets = ops.lm_logits(h.detach(), w.detach()).argmax(-1)
    for kw in (dict(top_k=1), dict(min_p=1.0), dict(temperature=0.0), dict(top_p=1e-6)):
        out = ops.sampled_logprob(h, w, targets, with_entropy=True, **kw)
        assert torch.equal(out.kept, torch.ones(6, dtype=torch.int64)), kw
        assert_bitwise_equal(out.logprob, torch.zeros(6), str(kw))
        assert_bitwise_equal(out.entropy, torch.zeros(6), str(kw))
        h.grad = w.grad = None
        (out.logprob.sum() + out.entropy.sum()).backward()
        assert not bool(h.grad.any()) and not bool(w.grad.any()), kw


def test_full_settings_give_the_full_softmax():
    """No filter: K is every token, so the sampled log-prob is the full softmax (within fp32 rounding: another fold)."""
    h, w = torch.randn(9, 16), torch.randn(40, 16)
    t = torch.randint(0, 40, (9,))
    out = ops.sampled_logprob(h, w, t, temperature=0.8)
    assert torch.equal(out.kept, torch.full((9,), 40))
    assert_bitwise_equal(out.logprob, out.full_logprob)
    assert torch.allclose(out.logprob, ops.logprob_entropy(h, w, t, temperature=0.8)[0], atol=1e-5, rtol=0)


@settings(max_examples=12, deadline=None)
@given(data=st.data(), rows=st.integers(1, 12), vocab=st.sampled_from([1, 2, 50, 1500]), seed=st.integers(0, 2 ** 20))
def test_sample_and_score_sampled_equals_the_trainer_op_in_any_batch(data, rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(rows, 32, generator=g), torch.randn(vocab, 32, generator=g) * 0.3
    s = row_settings(data, rows)
    seeds, positions = torch.randint(0, 2 ** 40, (rows,), generator=g), torch.randint(0, 999, (rows,), generator=g)
    tokens, lp = ops.sample_and_score(h, w, seeds=seeds, positions=positions, logprobs="sampled", **s)
    trainer = ops.sampled_logprob(h, w, tokens, **s)
    assert_bitwise_equal(lp, trainer.logprob, "engine vs trainer")
    assert bool(torch.isfinite(lp).all()) and bool((lp <= 0).all())
    full_tokens, _ = ops.sample_and_score(h, w, seeds=seeds, positions=positions, **s)
    assert torch.equal(tokens, full_tokens)   # the logprob mode never changes a token
    i = data.draw(st.integers(0, rows - 1))   # one row alone: the same token and bits
    alone = ops.sample_and_score(h[i:i + 1], w, seeds=seeds[i:i + 1], positions=positions[i:i + 1], logprobs="sampled",
                                 **{k: v[i:i + 1] for k, v in s.items()})
    assert int(alone[0]) == int(tokens[i])
    assert_bitwise_equal(alone[1], lp[i:i + 1], "row alone vs in the batch")


def chi2_limit(df, z=4.75):
    """Upper quantile of chi-square(df) at p ~ 1e-6 (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


@pytest.mark.parametrize("kw", [dict(top_p=0.8), dict(top_k=5, temperature=0.7), dict(min_p=0.15),
                                dict(min_p=0.05, top_k=6, top_p=0.9, temperature=1.3)])
def test_frequencies_match_the_renormalised_probabilities(kw):
    """40,000 draws of one row (distinct keys, fixed seed) against exp(sampled_logprob) of every token: a chi-square
    test at p ~ 1e-6 over the kept tokens, none drawn outside them."""
    g = torch.Generator().manual_seed(11)
    h, w = torch.randn(1, 16, generator=g), torch.randn(14, 16, generator=g) * 0.6
    n = 40_000
    tokens = ops.sample(ops.lm_logits(h, w).expand(n, -1), seeds=2024, seq_ids=torch.arange(n), positions=9, **kw)
    probs = ops.sampled_logprob(h.expand(14, -1), w, torch.arange(14), **kw).logprob.double().exp()
    counts = torch.bincount(tokens, minlength=14).double()
    assert int(counts[probs == 0].sum()) == 0, "a token outside the kept set was drawn"
    support = probs > 0
    assert abs(float(probs.sum()) - 1.0) < 1e-5 and int(support.sum()) >= 2
    expected = probs * n
    stat = float(((counts - expected) ** 2 / expected)[support].sum())
    assert stat < chi2_limit(int(support.sum()) - 1), stat


def test_bad_settings_are_refused_in_one_line():
    h, w, t = torch.randn(2, 8), torch.randn(5, 8), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ContractError, match=r"min_p must be in \[0, 1\]"):
        ops.sampled_logprob(h, w, t, min_p=1.5)
    with pytest.raises(ContractError, match=r"min_p must be in \[0, 1\]"):
        ops.sample(torch.randn(2, 5), seeds=0, seq_ids=0, positions=0, min_p=-0.1)
    with pytest.raises(ContractError, match="need the strict profile"):
        ops.sampled_logprob(h, w, t, profile="native")
    with pytest.raises(ContractError, match="logprobs must be one of"):
        ops.sample_and_score(h, w, seeds=0, positions=0, logprobs="processed")
    with ops.static_decode(), pytest.raises(ContractError, match="scored eagerly"):
        ops.sample_and_score(h, w, seeds=torch.zeros(2, dtype=torch.int64), positions=torch.zeros(2, dtype=torch.int64),
                             logprobs="sampled", score_temperature=1.0)
    ops.flush_deferred_checks()


@pytest.mark.cuda
def test_cuda_sampler_kept_set_and_engine_trainer_bits():
    """On CUDA (the Triton sampler and LM head): every drawn token is in the scorer's kept set and the engine's
    sampled log-probs equal the trainer op's bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(3)
    h = torch.randn(64, 256, generator=g).cuda().bfloat16()
    w = (torch.randn(5000, 256, generator=g) * 0.05).cuda().bfloat16()
    s = dict(temperature=0.8, top_k=40, top_p=0.8, min_p=0.02)
    pos = torch.arange(64, device="cuda")
    tokens, lp = ops.sample_and_score(h, w, seeds=pos + 7, positions=pos, logprobs="sampled", **s)
    out = ops.sampled_logprob(h, w, tokens, **s)
    assert_bitwise_equal(lp, out.logprob)
    assert bool(torch.isfinite(lp).all())
