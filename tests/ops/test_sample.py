"""ops.sample: batch invariance (bitwise), statistics with fixed seeds, RNG quality, bad inputs.

Statistical tests use fixed seeds, so they are deterministic: they either always pass or always
fail. Their thresholds are chi-square quantiles at p = 1e-6 (Wilson-Hilferty approximation).
"""

import math
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign.contract.errors import ContractError
from rlalign.ops.sample import derive_seed, sample
from rlalign.ops.torch_backend import sample as backend
from tests.bitwise import assert_bitwise_equal

SETTINGS = dict(max_examples=20, deadline=None)
MASK64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15
BIG_V = 151936


# ---- an independent reference of the documented RNG, on Python ints ---------------------------

def ref_mix64(z):
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def ref_key(seed, seq_id, pos):
    h = ref_mix64(seed + G)
    h = ref_mix64((h ^ (seq_id & MASK64)) + G)
    return ref_mix64((h ^ (pos & MASK64)) + G)


def ref_u(key, v):
    bits = ref_mix64(key + (v + 1) * G)
    return (2 * (bits >> 41) + 1) / 2 ** 24


def as_signed(u64):
    return u64 - (1 << 64) if u64 >= 1 << 63 else u64


def chi2_limit(df, z=4.75):
    """Upper quantile of chi-square(df) at p ~ 1e-6 (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_stat(counts, probs):
    n = counts.sum()
    expected = probs * n
    support = expected > 0
    assert int(counts[~support].sum()) == 0, "a token with probability 0 was sampled"
    return float((((counts - expected) ** 2)[support] / expected[support]).sum()), int(support.sum()) - 1


def rand_logits(rows, vocab, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def draw(logits, *, seed=7, seq_ids=None, positions=0, **kw):
    rows = logits.shape[0]
    seq_ids = torch.arange(rows) if seq_ids is None else seq_ids
    return sample(logits, seeds=seed, seq_ids=seq_ids, positions=positions, **kw)


# ---- (1) bitwise: a row's token does not depend on the batch ----------------------------------

ROW_CONFIGS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    "top_k": st.sampled_from([0, 1, 3, 40, 10 ** 6]),
    "top_p": st.sampled_from([1.0, 0.2, 0.9, 0.999]),
})


def _batch(configs, rows, key_seed):
    g = torch.Generator().manual_seed(key_seed)
    return dict(
        seeds=torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=g),
        seq_ids=torch.randint(0, 10 ** 6, (rows,), generator=g),
        positions=torch.randint(0, 10 ** 5, (rows,), generator=g),
        temperature=torch.tensor([c["temperature"] for c in configs], dtype=torch.float32),
        top_k=torch.tensor([c["top_k"] for c in configs], dtype=torch.int64),
        top_p=torch.tensor([c["top_p"] for c in configs], dtype=torch.float32),
    )


def _row(params, i):
    return {name: value[i:i + 1] for name, value in params.items()}


@settings(max_examples=12, deadline=None)
@given(data=st.data(), rows=st.integers(1, 512), vocab=st.integers(1, 2000), seed=st.integers(0, 2 ** 20))
def test_row_token_is_batch_invariant(data, rows, vocab, seed):
    configs = data.draw(st.lists(ROW_CONFIGS, min_size=rows, max_size=rows))
    logits = rand_logits(rows, vocab, seed, scale=data.draw(st.sampled_from([0.5, 3.0, 20.0])))
    if vocab > 4:  # ties and masked tokens
        logits[:, :4] = logits[:, 4:5]
        logits[:, -1] = float("-inf")
    params = _batch(configs, rows, seed + 1)
    in_batch = sample(logits, **params)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    shuffled = sample(logits[order], **{n: v[order] for n, v in params.items()})
    assert_bitwise_equal(shuffled, in_batch[order], "rows permuted")
    for i in data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=3)):
        alone = sample(logits[i:i + 1], **_row(params, i))
        assert_bitwise_equal(in_batch[i:i + 1], alone, f"row {i} of {rows} ({configs[i]})")


def test_big_vocab_rows_are_batch_invariant():
    """V = 151936; rows whose top-p nucleus is wider than the first candidate set (retry paths)."""
    configs = [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=1.0, top_k=40, top_p=1.0),
               dict(temperature=1.0, top_k=0, top_p=0.9), dict(temperature=0.7, top_k=3000, top_p=0.95),
               dict(temperature=0.0, top_k=0, top_p=1.0), dict(temperature=2.0, top_k=0, top_p=0.3)]
    logits = rand_logits(len(configs), BIG_V, seed=11)
    params = _batch(configs, len(configs), key_seed=12)
    in_batch = sample(logits, **params)
    for i in range(len(configs)):
        alone = sample(logits[i:i + 1], **_row(params, i))
        assert_bitwise_equal(in_batch[i:i + 1], alone, f"row {i} ({configs[i]})")


def test_row_chunking_does_not_change_tokens(monkeypatch):
    configs = [dict(temperature=t, top_k=k, top_p=p) for t in (0.0, 0.9) for k in (0, 7) for p in (1.0, 0.6)] * 5
    logits = rand_logits(len(configs), 700, seed=13)
    params = _batch(configs, len(configs), key_seed=14)
    whole = sample(logits, **params)
    monkeypatch.setattr(backend, "ROW_CHUNK_ELEMS", {"cpu": 3 * 700})
    assert_bitwise_equal(sample(logits, **params), whole, "chunks of 3 rows")


def test_same_key_same_token_and_other_key_other_draw():
    logits = rand_logits(64, 500, seed=3, scale=0.1)  # nearly uniform: draws differ when keys do
    a = draw(logits, seed=5, positions=9, top_p=0.95)
    assert_bitwise_equal(draw(logits, seed=5, positions=9, top_p=0.95), a, "same keys, second call")
    assert not torch.equal(draw(logits, seed=6, positions=9, top_p=0.95), a)
    assert not torch.equal(draw(logits, seed=5, positions=10, top_p=0.95), a)


def test_filters_off_equal_no_filters():
    """top_k >= V and top_p = 1 are 'off': same tokens as the unfiltered call, bit for bit."""
    logits = rand_logits(32, 300, seed=4)
    plain = draw(logits)
    assert_bitwise_equal(draw(logits, top_k=300), plain)
    assert_bitwise_equal(draw(logits, top_k=10 ** 9, top_p=1.0), plain)
    assert_bitwise_equal(draw(logits, temperature=torch.ones(32), top_k=torch.zeros(32, dtype=torch.int32)), plain)


@settings(**SETTINGS)
@given(rows=st.integers(1, 12), vocab=st.integers(1, 300), first=st.integers(1, 300), seed=st.integers(0, 2 ** 20),
       data=st.data())
def test_keep_mask_same_for_every_candidate_count(rows, vocab, first, seed, data):
    """The fast path (ordering only top candidates, retrying when undecided) == a full stable sort."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-4, 4, (rows, vocab), generator=g).float() * data.draw(st.sampled_from([1.0, 0.37]))
    z[torch.rand(rows, vocab, generator=g) < 0.1] = float("-inf")
    z[:, 0] = 5.0
    k = torch.randint(0, vocab + 1, (rows,), generator=g) * (torch.rand(rows, generator=g) < 0.6)
    p = torch.where(torch.rand(rows, generator=g) < 0.3, 1.0, torch.rand(rows, generator=g).clamp_min(1e-3))
    full = backend.keep_mask(z, k, p, candidates=vocab)
    assert_bitwise_equal(backend.keep_mask(z, k, p, candidates=first), full, f"first candidate count {first}")


# ---- (2) the filters against a float64 reference, and statistics ------------------------------

def ref_keep(z_row, k, top_p):
    """Reference keep set and each token's float64 'probability before it' in the total order."""
    values = z_row.tolist()
    order = sorted(range(len(values)), key=lambda v: (-values[v], v))
    kept_k = order[:k] if k > 0 else order
    zk = torch.tensor([values[v] for v in kept_k], dtype=torch.float64)
    probs = torch.softmax(zk, 0)
    before = torch.cumsum(probs, 0) - probs
    keep = {v for v, b in zip(kept_k, before.tolist()) if top_p >= 1 or b < top_p}
    return keep, dict(zip(kept_k, before.tolist()))


@settings(**SETTINGS)
@given(vocab=st.integers(2, 400), seed=st.integers(0, 2 ** 20), k=st.integers(0, 50),
       top_p=st.sampled_from([1.0, 0.05, 0.5, 0.9, 0.99]))
def test_keep_mask_matches_float64_reference(vocab, seed, k, top_p):
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-20, 20, (1, vocab), generator=g).float() / 4  # plenty of ties
    keep = backend.keep_mask(z, torch.tensor([k]), torch.tensor([top_p]))[0]
    ref, before = ref_keep(z[0], k, top_p)
    for v in set(keep.nonzero().flatten().tolist()) ^ ref:
        assert abs(before[v] - top_p) < 1e-5, f"token {v}: kept={bool(keep[v])}, mass before it {before[v]}"


def test_frequencies_match_softmax():
    """40,000 draws of one row over distinct seq_ids, and over positions, vs softmax(z / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 3.0, float("-inf"), 1.5]])
    temperature, n = 0.8, 40_000
    probs = torch.softmax((logits[0] / temperature).double(), 0)
    many = logits.expand(n, -1)
    for seq_ids, positions in ((torch.arange(n), 17), (torch.full((n,), 3), torch.arange(n))):
        tokens = sample(many, seeds=2024, seq_ids=seq_ids, positions=positions, temperature=temperature)
        stat, df = chi2_stat(torch.bincount(tokens, minlength=10).double(), probs)
        assert stat < chi2_limit(df), f"chi-square {stat:.1f} over {df} dof"


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (0, 0.7), (6, 0.8)])
def test_filtered_frequencies_match_renormalised_softmax(top_k, top_p):
    logits = torch.tensor([[0.3, 2.0, 1.1, -0.4, 1.7, 0.9, 0.0, 2.4, -1.0, 1.4, 0.6, -2.0]])
    n = 40_000
    keep, _ = ref_keep(logits[0], top_k, top_p)
    mask = torch.zeros(12, dtype=torch.bool)
    mask[list(keep)] = True
    probs = torch.softmax(logits[0].double().masked_fill(~mask, float("-inf")), 0)
    tokens = sample(logits.expand(n, -1), seeds=99, seq_ids=torch.arange(n), positions=5, top_k=top_k, top_p=top_p)
    stat, df = chi2_stat(torch.bincount(tokens, minlength=12).double(), probs)
    assert stat < chi2_limit(df), f"chi-square {stat:.1f} over {df} dof"


def test_big_vocab_total_variation():
    """V = 151936 with a peaked distribution: TV(empirical, softmax) within its sampling bound."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, BIG_V, generator=g)
    logits[0, :20] += torch.linspace(9.0, 6.0, 20)
    n = 300
    tokens = sample(logits.expand(n, -1), seeds=1, seq_ids=0, positions=torch.arange(n))
    probs = torch.softmax(logits[0].double(), 0)
    head = probs[:20]
    counts = torch.bincount(tokens, minlength=BIG_V).double()
    empirical = torch.cat([counts[:20], counts[20:].sum().view(1)]) / n
    expected = torch.cat([head, (1 - head.sum()).view(1)])
    tv = 0.5 * float((empirical - expected).abs().sum())
    bound = 0.5 * float((expected * (1 - expected)).sqrt().sum()) / math.sqrt(n) * 5  # 5 x E|dev| bound
    assert tv < bound, f"TV {tv:.4f} >= {bound:.4f}"


@settings(**SETTINGS)
@given(vocab=st.integers(2, 2000), k=st.integers(1, 30), seed=st.integers(0, 2 ** 20))
def test_top_k_never_outside_top_k(vocab, k, seed):
    logits = (rand_logits(1, vocab, seed) * 2).round() / 2  # ties
    rows = 256
    tokens = draw(logits.expand(rows, -1), seed=seed, top_k=k, temperature=2.0)
    allowed, _ = ref_keep(logits[0], k, 1.0)
    assert set(tokens.tolist()) <= allowed


@settings(**SETTINGS)
@given(vocab=st.integers(2, 1000), top_p=st.floats(0.01, 0.99), seed=st.integers(0, 2 ** 20))
def test_top_p_never_outside_nucleus(vocab, top_p, seed):
    logits = rand_logits(1, vocab, seed)
    tokens = draw(logits.expand(128, -1), seed=seed, top_p=top_p, temperature=1.5)
    _, before = ref_keep(logits[0] / 1.5, 0, 1.0)
    worst = max(before[t] for t in tokens.tolist())
    assert worst < top_p + 1e-5, f"sampled a token with {worst} of the mass before it (top_p={top_p})"


def test_greedy_is_argmax_lowest_id_and_ignores_rng():
    logits = rand_logits(40, 100, seed=8)
    logits[:, 10] = logits[:, 50] = logits.max(-1).values + 1  # tie: id 10 wins
    logits[:20, 10] = float("-inf")                            # rows 0..19: id 50 is the unique max
    expected = torch.where(torch.arange(40) < 20, 50, 10)
    assert_bitwise_equal(draw(logits, temperature=0.0), expected)
    assert_bitwise_equal(draw(logits, temperature=0.0, seed=123, positions=77, top_k=5, top_p=0.1), expected)
    mixed_t = torch.where(torch.arange(40) % 2 == 0, 0.0, 1.0)
    assert_bitwise_equal(draw(logits, temperature=mixed_t)[::2], expected[::2])


def test_masked_tokens_never_sampled():
    logits = torch.zeros(2000, 16)
    logits[:, ::2] = float("-inf")
    for kw in ({}, dict(top_p=0.5), dict(top_k=12), dict(temperature=5.0)):
        assert bool((draw(logits, **kw) % 2 == 1).all()), kw


# ---- (3) the RNG ------------------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 2 ** 63 - 1, -2 ** 63, 12345, -987654321]


def test_hash_matches_python_reference():
    g = torch.Generator().manual_seed(1)
    triples = [(a, b, c) for a in EDGE_INTS[:4] for b in EDGE_INTS[3:] for c in EDGE_INTS[::3]]
    triples += [tuple(torch.randint(-2 ** 63, 2 ** 63 - 1, (3,), generator=g).tolist()) for _ in range(40)]
    s, q, p = (torch.tensor(col, dtype=torch.int64) for col in zip(*triples))
    keys = backend.row_keys(s, q, p)
    expected = [as_signed(ref_key(*t)) for t in triples]
    assert keys.tolist() == expected
    vocab_ids = [0, 1, 2, 1000, BIG_V - 1]
    u = backend.uniforms(keys, backend.token_offsets(BIG_V, keys.device))[:, vocab_ids]
    ref = torch.tensor([[ref_u(k & MASK64, v) for v in vocab_ids] for k in expected], dtype=torch.float32)
    assert_bitwise_equal(u, ref, "u")


def test_pinned_values_do_not_drift():
    """Changing the hash changes every rollout's tokens: these numbers pin the definition."""
    assert ref_key(0, 0, 0) == backend.row_key_int(0, 0, 0) == 0x238275BC38FCBE91
    assert derive_seed(0, 0, 0) == ref_mix64(ref_mix64(ref_mix64(G) + G) + G) >> 1
    assert [derive_seed(42, i, j) for i in range(2) for j in range(2)] == [
        3569207718454509475, 6575667854007470159, 5323045922633604262, 3133383276388481169]
    key = torch.tensor([as_signed(ref_key(7, 11, 13))])
    assert float(backend.uniforms(key, backend.token_offsets(6, key.device))[0, 5]) == 0.4080600142478943


def test_derive_seed_range_and_distinct():
    seeds = {derive_seed(7, i, j) for i in range(64) for j in range(16)}
    assert len(seeds) == 64 * 16
    assert all(0 <= s < 2 ** 63 for s in seeds)
    assert derive_seed(-1, 0, 0) == derive_seed(2 ** 64 - 1, 0, 0)
    with pytest.raises(TypeError):
        derive_seed(1.0, 0, 0)


def test_uniforms_are_uniform_and_independent():
    keys = backend.row_keys(torch.full((256,), 3), torch.arange(256) // 16, torch.arange(256) % 16)
    u = backend.uniforms(keys, backend.token_offsets(4096, keys.device)).double()
    assert float(u.min()) > 0 and float(u.max()) < 1
    n = u.numel()
    counts = torch.histc(u, bins=1024, min=0, max=1)
    stat, df = chi2_stat(counts, torch.full((1024,), 1 / 1024, dtype=torch.float64))
    assert stat < chi2_limit(df), f"histogram chi-square {stat:.1f}"
    assert abs(float(u.mean()) - 0.5) < 6 * math.sqrt(1 / 12 / n)
    c = u - 0.5
    for name, a, b in (("adjacent tokens", c[:, 1:], c[:, :-1]), ("adjacent positions", c[1:], c[:-1]),
                       ("adjacent seq_ids", c[16:], c[:-16])):
        corr = float((a * b).mean() / (c * c).mean())
        assert abs(corr) < 6 / math.sqrt(a.numel()), f"{name}: correlation {corr}"
    bits = (u * 2 ** 23).floor().long()  # the 23 random bits of u, each balanced
    for bit in range(23):
        frac = float(((bits >> bit) & 1).double().mean())
        assert abs(frac - 0.5) < 6 * 0.5 / math.sqrt(n), f"bit {bit}: {frac}"


# ---- (4) bad inputs ---------------------------------------------------------------------------

def _ok(**over):
    args = dict(logits=torch.zeros(3, 5), seeds=1, seq_ids=torch.arange(3), positions=0)
    args.update(over)
    return args


@pytest.mark.parametrize("over,problem", [
    (dict(logits=torch.zeros(5)), "must have 2 dims"),
    (dict(logits=torch.zeros(3, 5, dtype=torch.bfloat16)), "float32"),
    (dict(logits=torch.zeros(3, 0)), "empty vocab"),
    (dict(logits=torch.tensor([[0.0, float("nan")]] * 3)), "NaN or +inf"),
    (dict(logits=torch.tensor([[0.0, float("inf")]] * 3)), "NaN or +inf"),
    (dict(logits=torch.tensor([[0.0, 1.0], [float("-inf")] * 2, [0.0, 1.0]])), "row 1 of logits is all -inf"),
    (dict(temperature=-0.5), "temperature must be finite and >= 0"),
    (dict(temperature=float("nan")), "temperature must be finite and >= 0"),
    (dict(temperature=torch.tensor([1.0, float("inf"), 1.0])), "temperature must be finite"),
    (dict(temperature=torch.ones(3, dtype=torch.float64)), "temperature must be a float32 tensor"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_p=float("nan")), "top_p must be in (0, 1]"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_k=2.0), "top_k must be an int"),
    (dict(seeds=1.5), "seeds must be an int"),
    (dict(seeds=2 ** 64), "does not fit in int64"),
    (dict(seeds=torch.ones(3)), "seeds must be an int32/int64 tensor"),
    (dict(seq_ids=torch.arange(4)), "seq_ids must be a scalar or have shape [3]"),
    (dict(positions=torch.zeros(3, 1, dtype=torch.int64)), "positions must be a scalar or have shape [3]"),
    (dict(logits=torch.full((3, 5), 1e30), temperature=1e-10), "overflows fp32"),
])
def test_bad_inputs_raise_contract_error(over, problem):
    with pytest.raises(ContractError, match=r"rlalign\.ops\.sample: .*" + re.escape(problem)):
        sample(**_ok(**over))


def test_empty_batch():
    assert draw(torch.zeros(0, 7)).shape == (0,)


@pytest.fixture
def torch_backend_env(monkeypatch):
    """RLALIGN_BACKEND=torch for one test (the environment is read once: refreshed on the way in and out)."""
    from rlalign.ops._dispatch import refresh_env
    monkeypatch.setenv("RLALIGN_BACKEND", "torch")
    refresh_env()
    yield
    monkeypatch.undo()
    refresh_env()


# ---- native profile ---------------------------------------------------------------------------

def test_native_profile_is_the_vendor_path():
    logits = rand_logits(64, 50, seed=2)
    a = draw(logits, seed=3, top_k=5, profile="native")
    assert a.dtype == torch.int64 and a.shape == (64,)
    assert_bitwise_equal(draw(logits, seed=3, top_k=5, profile="native"), a, "same generator seed")
    top5 = logits.topk(5, dim=-1).indices
    assert bool((top5 == a[:, None]).any(-1).all())
    assert_bitwise_equal(draw(logits, temperature=0.0, profile="native"), logits.argmax(-1))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), start=st.integers(0, 10**6), rows=st.integers(1, 4),
       vocab=st.sampled_from([2, 7, 50, 1000]))
def test_native_eager_draws_are_fresh_at_every_position(seed, start, rows, vocab):
    """One sequence decoded step by step (uniform logits, so every draw is the noise's): the native eager draw
    differs from position to position, as it does from sequence to sequence, and repeats for the same inputs. Seeded
    by the request's seed alone, every step replayed the same noise and a sequence repeated one token."""
    logits = torch.zeros(rows, vocab)
    steps = [draw(logits, seed=seed, positions=start + i, profile="native") for i in range(24)]
    first_rows = torch.stack([t[0] for t in steps])
    assert len(set(first_rows.tolist())) > 1, f"24 positions drew one token: {first_rows.tolist()}"
    assert_bitwise_equal(draw(logits, seed=seed, positions=start + 5, profile="native"), steps[5], "same inputs")
    others = torch.stack([draw(logits, seed=seed, seq_ids=torch.arange(rows) + 100 + i, positions=start,
                               profile="native")[0] for i in range(24)])
    assert len(set(others.tolist())) > 1, f"24 sequences drew one token at one position: {others.tolist()}"


@pytest.mark.cuda
def test_cuda_row_token_is_batch_invariant(torch_backend_env):
    configs = [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.7, top_k=50, top_p=0.9),
               dict(temperature=1.3, top_k=0, top_p=0.95), dict(temperature=0.0, top_k=0, top_p=1.0)] * 40
    logits = rand_logits(len(configs), BIG_V, seed=21).cuda()
    params = {n: v.cuda() for n, v in _batch(configs, len(configs), key_seed=22).items()}
    in_batch = sample(logits, **params)
    for i in (0, 1, 2, 3, 77, 159):
        assert_bitwise_equal(in_batch[i:i + 1], sample(logits[i:i + 1], **_row(params, i)), f"row {i}")
