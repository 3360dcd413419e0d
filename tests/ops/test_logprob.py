"""logprob_entropy / lm_logits: bitwise invariance (strict), accuracy vs float64, bad inputs.

Bitwise: a token's logprob, entropy and hidden-state gradient are identical (torch.equal on raw bits)
whatever the number of tokens in the call, the token's position, the other tokens' content and
the token_chunk / vocab_chunk choices; V is deliberately not a multiple of VOCAB_BLOCK.

Accuracy tolerances against a float64 autograd reference of the naive formula evaluated on the
same (already rounded) inputs, logits std ~2.5, T=150, H=64, V=3000:
    logprob, entropy:           atol 1e-4 (observed <= 1e-5)
    grads, fp32 inputs:         atol 2e-5 * max|ref|, rtol 1e-4 (observed <= 3e-6 * max|ref|)
    grads, bf16 inputs:         atol 1e-4 * max|ref|, rtol 2**-8 (the grads are rounded to bf16: half
                                an ulp is 2**-9 relative, the rest is fp32 error)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

from rlalign.contract.errors import ContractError
from rlalign.contract.spec import VOCAB_BLOCK
from rlalign.ops import lm_logits, logprob_entropy
from rlalign.ops.torch_backend.logprob import logprob_from_logits
from tests.bitwise import assert_bitwise_equal, assert_close_report

H = 32
V = 4 * VOCAB_BLOCK + 404  # not a multiple of VOCAB_BLOCK: the last block is short
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOKEN_CHUNKS = [None, 1, 64, 100, 128, 256, 2048]
VOCAB_CHUNKS = [None, 1, 1024, 2000, 3072, 8192]
HYP = settings(max_examples=30, deadline=None)


def _weight(dtype: torch.dtype, vocab: int = V, hidden: int = H, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, hidden, generator=g) * (2.5 / hidden ** 0.5)).to(dtype)


def _tokens(count: int, seed: int, dtype: torch.dtype, vocab: int = V, hidden: int = H):
    g = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(count, hidden, generator=g).to(dtype)
    targets = torch.randint(0, vocab, (count,), generator=g)
    return hidden_states, targets


def _with_probe(total: int, pos: int, seed: int, probe_h, probe_t):
    hidden_states, targets = _tokens(total, seed, probe_h.dtype)
    hidden_states[pos], targets[pos] = probe_h, probe_t
    return hidden_states, targets


# ---- bitwise ------------------------------------------------------------------------------------

@HYP
@given(total=st.integers(1, 300), data=st.data(), seed=st.integers(0, 2**31 - 1),
       token_chunk=st.sampled_from(TOKEN_CHUNKS), vocab_chunk=st.sampled_from(VOCAB_CHUNKS),
       dtype=st.sampled_from(sorted(DTYPES)), temperature=st.sampled_from([1.0, 0.7]))
def test_token_outputs_independent_of_batch_and_chunks(total, data, seed, token_chunk, vocab_chunk, dtype,
                                                       temperature):
    dt = DTYPES[dtype]
    weight = _weight(dt)
    probe_h, probe_t = _tokens(1, seed + 1, dt)
    alone_lp, alone_ent = logprob_entropy(probe_h, weight, probe_t, temperature=temperature)
    pos = data.draw(st.integers(0, total - 1), label="pos")
    hidden_states, targets = _with_probe(total, pos, seed, probe_h[0], probe_t[0])
    lp, ent = logprob_entropy(hidden_states, weight, targets, temperature=temperature,
                              token_chunk=token_chunk, vocab_chunk=vocab_chunk)
    assert_bitwise_equal(lp[pos:pos + 1], alone_lp, f"logprob at position {pos} of {total}")
    assert_bitwise_equal(ent[pos:pos + 1], alone_ent, f"entropy at position {pos} of {total}")


@settings(max_examples=15, deadline=None)
@given(total=st.integers(1, 200), data=st.data(), seed=st.integers(0, 2**31 - 1),
       token_chunk=st.sampled_from(TOKEN_CHUNKS), vocab_chunk=st.sampled_from(VOCAB_CHUNKS),
       temperature=st.sampled_from([1.0, 1.3]))
def test_token_hidden_grad_independent_of_batch_and_chunks(total, data, seed, token_chunk, vocab_chunk,
                                                           temperature):
    weight = _weight(torch.float32)
    probe_h, probe_t = _tokens(1, seed + 1, torch.float32)
    probe_g = torch.randn(2, generator=torch.Generator().manual_seed(seed))
    pos = data.draw(st.integers(0, total - 1), label="pos")
    hidden_states, targets = _with_probe(total, pos, seed, probe_h[0], probe_t[0])
    g_lp, g_ent = torch.randn(2, total)
    g_lp[pos], g_ent[pos] = probe_g

    def grad_hidden(h, t, g1, g2, **chunks):
        h = h.clone().requires_grad_()
        lp, ent = logprob_entropy(h, weight, t, temperature=temperature, **chunks)
        (lp * g1 + ent * g2).sum().backward()
        return h.grad

    alone = grad_hidden(probe_h, probe_t, probe_g[:1], probe_g[1:])
    batched = grad_hidden(hidden_states, targets, g_lp, g_ent, token_chunk=token_chunk, vocab_chunk=vocab_chunk)
    assert_bitwise_equal(batched[pos:pos + 1], alone, f"d hidden at position {pos} of {total}")


@HYP
@given(total=st.integers(1, 200), data=st.data(), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(sorted(DTYPES)), temperature=st.sampled_from([1.0, 0.7]))
def test_lm_logits_row_independent_of_batch(total, data, seed, dtype, temperature):
    dt = DTYPES[dtype]
    weight = _weight(dt)
    hidden_states, _ = _tokens(total, seed, dt)
    row = data.draw(st.integers(0, total - 1), label="row")
    big = lm_logits(hidden_states, weight, temperature=temperature)
    alone = lm_logits(hidden_states[row:row + 1], weight, temperature=temperature)
    assert big.dtype == torch.float32 and big.shape == (total, V)
    assert_bitwise_equal(big[row:row + 1], alone, f"lm_logits row {row} of {total}")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_lm_logits_are_the_logits_logprob_entropy_reduces(dtype, temperature):
    weight = _weight(DTYPES[dtype])
    hidden_states, targets = _tokens(77, 5, DTYPES[dtype])
    lp, ent = logprob_entropy(hidden_states, weight, targets, temperature=temperature, vocab_chunk=1024)
    from_logits = logprob_from_logits(lm_logits(hidden_states, weight, temperature=temperature), targets)
    assert_bitwise_equal(from_logits[0], lp, "logprob from lm_logits")
    assert_bitwise_equal(from_logits[1], ent, "entropy from lm_logits")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_forward_and_backward_repeat_bitwise(dtype):
    dt = DTYPES[dtype]
    weight = _weight(dt)
    hidden_states, targets = _tokens(300, 11, dt)
    g_lp, g_ent = torch.randn(2, 300, generator=torch.Generator().manual_seed(3))

    def run():
        h, w = hidden_states.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = logprob_entropy(h, w, targets, temperature=0.7, token_chunk=128, vocab_chunk=2048)
        (lp * g_lp + ent * g_ent).sum().backward()
        return lp, ent, h.grad, w.grad

    for name, first, second in zip(("logprob", "entropy", "d hidden", "d weight"), run(), run()):
        assert_bitwise_equal(first, second, f"{name} run to run")


def test_without_entropy_gives_same_logprob_and_grads():
    weight = _weight(torch.float32)
    hidden_states, targets = _tokens(130, 2, torch.float32)

    def run(with_entropy):
        h, w = hidden_states.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = logprob_entropy(h, w, targets, with_entropy=with_entropy, token_chunk=64)
        lp.sum().backward()
        return lp, ent, h.grad, w.grad

    lp_a, ent_a, dh_a, dw_a = run(True)
    lp_b, ent_b, dh_b, dw_b = run(False)
    assert ent_a is not None and ent_b is None
    assert_bitwise_equal(lp_a, lp_b, "logprob with/without entropy")
    assert_bitwise_equal(dh_a, dh_b, "d hidden with/without entropy")
    assert_bitwise_equal(dw_a, dw_b, "d weight with/without entropy")


def test_vocab_smaller_than_one_block_and_int32_targets():
    weight = _weight(torch.float32, vocab=300)
    hidden_states, targets = _tokens(70, 6, torch.float32, vocab=300)
    lp, ent = logprob_entropy(hidden_states, weight, targets, token_chunk=64)
    lp32, ent32 = logprob_entropy(hidden_states, weight, targets.int())
    alone = logprob_entropy(hidden_states[69:], weight, targets[69:])
    assert_bitwise_equal(lp32, lp, "int32 vs int64 targets")
    assert_bitwise_equal(ent32, ent, "int32 vs int64 targets")
    assert_bitwise_equal(lp[69:], alone[0], "last token alone")
    assert_bitwise_equal(ent[69:], alone[1], "last token alone")
    ref_lp, ref_ent, _, _ = _reference(hidden_states, weight, targets, 1.0, torch.ones(70), torch.ones(70))
    assert_close_report(lp, ref_lp, atol=1e-4, rtol=0, what="logprob, V=300")
    assert_close_report(ent, ref_ent, atol=1e-4, rtol=0, what="entropy, V=300")


@pytest.mark.parametrize("profile", ["strict", "native"])
def test_empty_batch(profile):
    lp, ent = logprob_entropy(torch.zeros(0, H), _weight(torch.float32), torch.zeros(0, dtype=torch.long),
                              profile=profile)
    assert lp.shape == (0,) and ent.shape == (0,) and lp.dtype == torch.float32


# ---- vocab sizes at the block edges ----------------------------------------------------------------

def _edge_vocab():
    """V = 1, or V % chunk in {0, 1, 2, chunk - 1} for the vocab block and a vocab chunk of 2048:
    a last block (chunk) of one entry, two entries, or a whole one."""
    chunks = st.sampled_from([VOCAB_BLOCK, 2048])
    return st.one_of(st.just(1), st.builds(lambda c, q, r: q * c + r, chunks, st.integers(1, 3),
                                           st.sampled_from([0, 1, 2, -1])))


@settings(max_examples=40, deadline=None)
@given(vocab=_edge_vocab(), total=st.integers(1, 70), split=st.data(), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(sorted(DTYPES)), temperature=st.sampled_from([1.0, 0.7]),
       vocab_chunk=st.sampled_from([None, 1024, 2048]))
def test_vocab_block_edges_accurate_and_batch_invariant(vocab, total, split, seed, dtype, temperature, vocab_chunk):
    """Every V at a block edge (incl. a one-entry last block and V = 1), with and without entropy:
    close to float64, the same bits for every split of the batch, and the logprob the same bits with and
    without entropy (a one-entry block once returned its sum as a view that the entropy pass overwrote)."""
    dt = DTYPES[dtype]
    weight = _weight(dt, vocab=vocab, seed=seed % 7)
    hidden_states, targets = _tokens(total, seed, dt, vocab=vocab)
    lp, ent = logprob_entropy(hidden_states, weight, targets, temperature=temperature, vocab_chunk=vocab_chunk)
    lp_only, none = logprob_entropy(hidden_states, weight, targets, temperature=temperature,
                                    vocab_chunk=vocab_chunk, with_entropy=False)
    assert none is None
    ref_lp, ref_ent, _, _ = _reference(hidden_states, weight, targets, temperature, torch.zeros(total),
                                       torch.zeros(total))
    assert_close_report(lp, ref_lp, atol=1e-4, rtol=0, what=f"logprob, V={vocab}")
    assert_close_report(ent, ref_ent, atol=1e-4, rtol=0, what=f"entropy, V={vocab}")
    assert_bitwise_equal(lp_only, lp, f"logprob without vs with entropy, V={vocab}")
    cut = split.draw(st.integers(0, total), label="cut")
    for rows in (slice(0, cut), slice(cut, total)):
        if rows.start == rows.stop:
            continue
        part_lp, part_ent = logprob_entropy(hidden_states[rows], weight, targets[rows], temperature=temperature)
        assert_bitwise_equal(part_lp, lp[rows], f"logprob of rows {rows.start}:{rows.stop} alone, V={vocab}")
        assert_bitwise_equal(part_ent, ent[rows], f"entropy of rows {rows.start}:{rows.stop} alone, V={vocab}")


@pytest.mark.parametrize("vocab", [VOCAB_BLOCK + 1, 2 * VOCAB_BLOCK + 1])
def test_vocab_shards_with_a_one_entry_last_block_merge_to_the_full_op(vocab):
    """The vocab-parallel pieces (rlalign.ops.shard) share the block statistics: a shard whose last
    block has one entry merges to the full op's bits."""
    from rlalign.ops.shard import logprob_merge_stats, logprob_shard_stats
    weight = _weight(torch.float32, vocab=vocab)
    hidden_states, targets = _tokens(9, 3, torch.float32, vocab=vocab)
    lp, ent = logprob_entropy(hidden_states, weight, targets)
    pieces = [logprob_shard_stats(hidden_states, weight[v0:v0 + VOCAB_BLOCK], targets, v0, 1.0, True)
              for v0 in range(0, vocab, VOCAB_BLOCK)]
    stats = torch.cat([p[0] for p in pieces], dim=1)
    z_target = torch.stack([p[1] for p in pieces])[targets // VOCAB_BLOCK, torch.arange(9)]   # the target's shard
    merged_lp, merged_ent, _, _ = logprob_merge_stats(stats, z_target)
    ref_lp, ref_ent, _, _ = _reference(hidden_states, weight, targets, 1.0, torch.zeros(9), torch.zeros(9))
    assert_close_report(merged_lp, ref_lp, atol=1e-4, rtol=0, what="merged shards: logprob")
    assert_close_report(merged_ent, ref_ent, atol=1e-4, rtol=0, what="merged shards: entropy")
    assert_bitwise_equal(merged_lp, lp, "merged shards: logprob")
    assert_bitwise_equal(merged_ent, ent, "merged shards: entropy")


# ---- accuracy vs float64 ------------------------------------------------------------------------

def _reference(hidden_states, weight, targets, temperature, g_lp, g_ent):
    h = hidden_states.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logp = F.log_softmax(h @ w.T / temperature, dim=-1)
    lp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("profile", ["strict", "native"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_accuracy_against_float64(dtype, temperature, profile):
    dt = DTYPES[dtype]
    weight = _weight(dt, vocab=3000, hidden=64, seed=4)
    hidden_states, targets = _tokens(150, 9, dt, vocab=3000, hidden=64)
    g_lp, g_ent = torch.randn(2, 150, generator=torch.Generator().manual_seed(8))
    h, w = hidden_states.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = logprob_entropy(h, w, targets, temperature=temperature, token_chunk=64, vocab_chunk=2048,
                              profile=profile)
    (lp * g_lp + ent * g_ent).sum().backward()
    ref_lp, ref_ent, ref_dh, ref_dw = _reference(hidden_states, weight, targets, temperature, g_lp, g_ent)
    assert lp.dtype == ent.dtype == torch.float32
    assert h.grad.dtype == w.grad.dtype == dt
    assert_close_report(lp, ref_lp, atol=1e-4, rtol=0, what="logprob")
    assert_close_report(ent, ref_ent, atol=1e-4, rtol=0, what="entropy")
    grad_atol, grad_rtol = (2e-5, 1e-4) if dt == torch.float32 else (1e-4, 2**-8)
    for name, got, ref in (("d hidden", h.grad, ref_dh), ("d weight", w.grad, ref_dw)):
        assert_close_report(got, ref, atol=grad_atol * float(ref.abs().max()), rtol=grad_rtol, what=name)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_lm_logits_accuracy(temperature):
    weight = _weight(torch.bfloat16)
    hidden_states, _ = _tokens(9, 1, torch.bfloat16)
    ref = hidden_states.double() @ weight.double().T / temperature
    for profile in ("strict", "native"):
        got = lm_logits(hidden_states, weight, temperature=temperature, profile=profile)
        assert_close_report(got, ref, atol=1e-5, rtol=1e-5, what=f"lm_logits {profile}")


# ---- bad inputs ---------------------------------------------------------------------------------

def _good():
    hidden_states, targets = _tokens(5, 0, torch.float32)
    return {"hidden": hidden_states, "weight": _weight(torch.float32), "targets": targets}


def _nan_at_2_3(t):
    t = t.clone()
    t[2, 3] = float("nan")
    return t


def _with_target(position, value):
    def edit(t):
        t = t.clone()
        t[position] = value
        return t
    return edit


BAD_INPUTS = [
    ("hidden", lambda t: t[0], {}, "hidden must have 2 dims"),
    ("weight", lambda t: t[:, :-1], {}, "features but weight"),
    ("hidden", lambda t: t.half(), {}, "dtype torch.float16 is not supported"),
    ("hidden", lambda t: t.bfloat16(), {}, "mixed dtypes"),
    ("targets", lambda t: t.float(), {}, "targets must be an int32/int64"),
    ("targets", lambda t: t[:-1], {}, r"targets must be \[T\]"),
    ("targets", _with_target(3, V), {}, f"target id {V} at position 3 is outside the vocabulary"),
    ("targets", _with_target(1, -2), {}, "target id -2 at position 1 is outside"),
    ("hidden", _nan_at_2_3, {}, r"hidden contains NaN or inf \(first at index \[2, 3\]"),
    ("hidden", lambda t: t.index_fill(0, torch.tensor([4]), float("inf")), {}, "hidden contains NaN or inf"),
    (None, None, {"temperature": 0.0}, "temperature must be finite and > 0"),
    (None, None, {"temperature": -1.0}, "temperature must be finite and > 0"),
    (None, None, {"temperature": float("nan")}, "temperature must be finite and > 0"),
    (None, None, {"temperature": float("inf")}, "temperature must be finite and > 0"),
    (None, None, {"temperature": "hot"}, "temperature must be a Python number"),
    (None, None, {"token_chunk": 0}, "token_chunk must be a positive int"),
    (None, None, {"vocab_chunk": -1024}, "vocab_chunk must be a positive int"),
]


@pytest.mark.parametrize("name,edit,kwargs,message", BAD_INPUTS)
def test_bad_inputs_raise_naming_the_op(name, edit, kwargs, message):
    args = _good()
    if name is not None:
        args[name] = edit(args[name])
    with pytest.raises(ContractError, match=r"rlalign\.ops\.logprob_entropy: .*" + message):
        logprob_entropy(args["hidden"], args["weight"], args["targets"], **kwargs)


def test_first_bad_target_is_named():
    args = _good()
    args["targets"][[1, 3]] = torch.tensor([V + 7, -1])
    with pytest.raises(ContractError, match=f"target id {V + 7} at position 1 "):
        logprob_entropy(args["hidden"], args["weight"], args["targets"])


@pytest.mark.parametrize("kwargs,message", [
    ({"hidden": torch.zeros(2, H, dtype=torch.float16)}, "dtype torch.float16 is not supported"),
    ({"hidden": torch.full((2, H), float("nan"))}, "hidden contains NaN or inf"),
    ({"hidden": torch.zeros(2, H + 1)}, "features but weight"),
    ({"temperature": 0}, "temperature must be finite and > 0"),
])
def test_lm_logits_bad_inputs(kwargs, message):
    args = {"hidden": torch.zeros(2, H), "weight": _weight(torch.float32), "temperature": 1.0} | kwargs
    with pytest.raises(ContractError, match=r"rlalign\.ops\.lm_logits: .*" + message):
        lm_logits(args["hidden"], args["weight"], temperature=args["temperature"])


# ---- vocab_chunk sets memory, never bits (odd K, short last vocab block) ------------------------------

@settings(max_examples=12, deadline=None)
@given(hidden=st.sampled_from([17, 127, 1000]), tail=st.sampled_from([1, 9, 404]), blocks=st.integers(1, 2),
       rows=st.integers(1, 70), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(sorted(DTYPES)))
@example(hidden=17, tail=1, blocks=1, rows=70, seed=0, dtype="fp32")   # an AVX-512 Xeon's MKL, 2026-12-03
def test_vocab_chunk_never_changes_bits(hidden, tail, blocks, rows, seed, dtype):
    """The class of the K=1000, V=1025 finding: the library's column bits depend on a GEMM's width N for
    narrow N, so the logits were computed per vocab block (width VB or the short tail) whatever the chunk.
    And on the operands' strides: dW's one-column tail block, sliced from a chunk of 1,024 or of 2,048 columns,
    took two MKL paths on an AVX-512 Xeon until the block is copied to its own contiguous operand."""
    dt, vocab = DTYPES[dtype], blocks * VOCAB_BLOCK + tail
    weight = _weight(dt, vocab, hidden, seed % 1000).requires_grad_()
    h, targets = _tokens(rows, seed, dt, vocab, hidden)
    h.requires_grad_()
    g = torch.Generator().manual_seed(seed + 7)
    g_lp, g_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    results = {}
    for chunk in (VOCAB_BLOCK, 2 * VOCAB_BLOCK, 16 * VOCAB_BLOCK):
        lp, ent = logprob_entropy(h, weight, targets, temperature=0.7, vocab_chunk=chunk)
        dh, dw = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), [h, weight])
        results[chunk] = (lp, ent, dh, dw)
    ref = results[VOCAB_BLOCK]
    for chunk, got in results.items():
        for name, a, b in zip(("logprob", "entropy", "dh", "dW"), got, ref):
            assert_bitwise_equal(a, b, f"{name}, vocab_chunk={chunk} vs {VOCAB_BLOCK} (K={hidden}, V={vocab})")
    # the sampler's logits (default chunk) score to the same bits
    lp_sampler, ent_sampler = logprob_from_logits(lm_logits(h.detach(), weight.detach(), temperature=0.7), targets)
    assert_bitwise_equal(lp_sampler, ref[0].detach(), f"logprob from lm_logits (K={hidden}, V={vocab})")
    assert_bitwise_equal(ent_sampler, ref[1].detach(), f"entropy from lm_logits (K={hidden}, V={vocab})")
