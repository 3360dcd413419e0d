"""Capture (taps, filters, row identity across rollout and training) and bitwise comparison."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.models import ForwardBatch, load_model, next_token_targets
from rlalign.models import taps
from rlalign.parity.capture import capture, note_batch, note_rows, packed_layout, prefix_keys, tap
from rlalign.contract.bits import differing
from rlalign.parity.compare import compare_captures, compare_logprobs, forward_order, ordered_ints, split_name
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams


def test_tap_is_identity_and_free_without_capture():
    x = torch.randn(3, 4)
    assert taps.installed() is None
    assert tap("embed", x) is x


def test_capture_records_detached_copies_with_filters():
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3).requires_grad_()
    with capture(["layers.1.*", "embed"], positions=[1, 2]) as cap:
        note_rows([[7, 8, 9], [5]])
        assert tap("embed", x) is x
        tap("layers.0.mlp", x)
        tap("layers.1.mlp", x * 2)
        with capture() as inner:        # nested: the inner one is active, the outer one comes back
            tap("embed", x)
        tap("final_norm", x)
    assert taps.installed() is None and inner.names == ["embed"]
    assert cap.names == ["embed", "layers.1.mlp"]
    rows = cap.rows("embed")
    assert [rows.info[k].position for k in rows.keys] == [1, 2]        # position 0 rows filtered out
    assert [rows.info[k].token for k in rows.keys] == [8, 9]
    assert not rows.tensor(rows.keys).requires_grad
    with torch.no_grad():
        x.add_(100)
    assert torch.equal(rows.tensor(rows.keys), torch.tensor([[3.0, 4, 5], [6, 7, 8]]))


def test_prefix_keys_identify_token_prefixes():
    a, b = prefix_keys([1, 2, 3]), prefix_keys([1, 2, 4])
    assert a[:2] == b[:2] and a[2] != b[2]
    layout = packed_layout([[1, 2, 3], [1, 2]])
    assert layout.keys[3:] == a[:2] and layout.last_rows == [2, 4]


def test_signed_zero_and_ulp_distance():
    a = torch.tensor([0.0, 1.0, -2.5, 3.0])
    b = torch.tensor([-0.0, 1.0, -2.5, 3.0])
    assert differing(a, b).tolist() == [True, False, False, False]
    assert (ordered_ints(a) - ordered_ints(b)).abs().tolist() == [1, 0, 0, 0]
    bf = torch.tensor([1.0, -1.0], dtype=torch.bfloat16)
    nxt = (bf.view(torch.int16) + 1).view(torch.bfloat16)      # the next bf16 away from zero
    assert (ordered_ints(nxt) - ordered_ints(bf)).abs().tolist() == [1, 1]


@settings(max_examples=50, deadline=None)
@given(x=st.floats(min_value=2.0 ** -100, max_value=2.0 ** 100, width=32), negative=st.booleans(), steps=st.integers(0, 6))
def test_ordered_ints_count_ulps(x, negative, steps):
    """Moving ``steps`` representable floats away from zero is ``steps`` ULPs."""
    t = torch.tensor([-x if negative else x], dtype=torch.float32)
    y = t.clone()
    for _ in range(steps):
        y = torch.nextafter(y, torch.tensor([-math.inf if negative else math.inf]))
    assert int((ordered_ints(y) - ordered_ints(t)).abs()) == steps


def test_forward_order_and_names():
    names = ["final_norm", "layers.10.mlp", "layers.2.q", "embed", "layers.2.input_norm", "logprob", "layers.2.residual"]
    assert forward_order(names) == ["embed", "layers.2.input_norm", "layers.2.q", "layers.2.residual",
                                    "layers.10.mlp", "final_norm", "logprob"]
    assert forward_order(["layers.0.mlp", "layers.0.post_norm", "layers.0.residual", "layers.0.o_proj"]) == \
        ["layers.0.o_proj", "layers.0.residual", "layers.0.post_norm", "layers.0.mlp"]
    assert split_name("layers.3.o_proj") == (3, "o_proj") and split_name("embed") == (None, "embed")


def _engine_capture(model, prompts, sampling, **engine_kwargs):
    engine = RolloutEngine(model, RolloutConfig(**engine_kwargs))
    with capture(model=model) as cap:
        completions = engine.generate(prompts, sampling)
    return cap, completions


@pytest.mark.parametrize("explicit_note", [False, True])
def test_rollout_rows_match_training_rows(checkpoints, explicit_note):
    """Rows of a rollout (prefix sharing, copy-on-write, chunked prefill, small pages) are matched to the
    training forward's rows by token prefix, and agree bit for bit in the strict profile; also when the
    model announces its batch itself (note_batch) on top of the capture's hooks."""
    model, _ = load_model(checkpoints["qwen3"])
    if explicit_note:
        forward_hidden = model.forward_hidden

        def noted(batch):
            note_batch(batch)
            return forward_hidden(batch)
        model.forward_hidden = noted
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [5, 6, 7, 8, 9, 10, 11, 40, 41]]
    sampling = SamplingParams(n=3, max_new_tokens=5, seed=4)
    rollout, completions = _engine_capture(model, prompts, sampling, page_size=4, max_prefill_chunk=3)
    seqs = [c.prompt_tokens + c.tokens for c in completions]
    with capture(model=model) as train, torch.no_grad():
        model.logprobs(ForwardBatch.packed(seqs), next_token_targets(seqs))
    result = compare_captures(train, rollout, labels=("train", "rollout"))
    assert result.verdict == "identical", result.reason
    compared = [b for b in result.boundaries if b.compared]
    assert {"embed", "layers.0.q", "layers.0.mlp", "layers.2.residual", "final_norm"} <= {b.name for b in compared}
    distinct_rows = len({k for s in seqs for k in prefix_keys(s[:-1])})   # the last token is never fed
    assert all(b.rows == distinct_rows for b in compared if b.name != "logprob"), \
        [(b.name, b.rows, distinct_rows) for b in compared]


def test_not_comparable_verdicts():
    with capture() as a:
        note_rows([[1, 2, 3]])
        tap("embed", torch.ones(3, 2))
    with capture() as b:
        note_rows([[4, 5, 6]])
        tap("embed", torch.ones(3, 2))
    assert compare_captures(a, b).verdict == "not comparable"                       # different tokens
    assert compare_captures(a, a, weights_hash_a="ab", weights_hash_b="cd").verdict == "not comparable"
    assert compare_captures(a, a).verdict == "identical"


def test_localized_reports_earliest_position_and_feature():
    x = torch.zeros(5, 2, 3)
    y = x.clone()
    y[4, 1, 2] = 1e-30      # position 1 of sequence 1
    y[2, 0, 1] = -0.0       # position 2 of sequence 0
    with capture() as a:
        note_rows([[1, 2, 3], [7, 8]])
        tap("layers.0.q", x)
        tap("layers.0.k", x)
    with capture() as b:
        note_rows([[1, 2, 3], [7, 8]])
        tap("layers.0.q", x)
        tap("layers.0.k", y)
    r = compare_captures(a, b)
    assert r.verdict == "localized"
    d = r.first_divergence
    assert (d.name, d.layer, d.boundary, d.sequence, d.position, d.token, d.feature) == \
        ("layers.0.k", 0, "k", 1, 1, 8, [1, 2])
    k = next(bd for bd in r.boundaries if bd.name == "layers.0.k")
    assert k.mismatches == 2 and k.max_ulp == int(ordered_ints(torch.tensor(1e-30)))


def test_compare_logprobs_bits():
    rollout = [[-1.0, -0.5, 0.0], [-2.0]]
    train = [[-1.0, -0.5000001, -0.0], [-2.0]]
    r = compare_logprobs(rollout, train, [[3, 4, 5], [6]], [2, 7])
    assert (r.tokens_compared, r.mismatches) == (4, 2)
    assert (r.first.sequence, r.first.position, r.first.token) == (0, 3, 4)
    assert r.max_abs_diff == pytest.approx(abs(float(torch.tensor(-0.5000001)) + 0.5))
    assert compare_logprobs([[1.0]], [[1.0, 2.0]], [[1]], [1]).not_comparable
