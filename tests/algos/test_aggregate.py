"""Loss aggregation: hand-computed modes, micro-batch accumulation equals the full batch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.algos import AGGREGATION_MODES, aggregate_loss, batch_counts, loss_weights, seq_ids_from_lengths
from tests.bitwise import assert_bitwise_equal, assert_close_report

D = torch.float64

# seq 0: a prompt token (masked out) + 2 response tokens; seq 1: 2 tokens; seq 2: 1 token;
# seq 3: fully masked out (e.g. overlong-filtered) and so not counted as a sequence
LOSS = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0], dtype=D)
SEQ = torch.tensor([0, 0, 0, 1, 1, 2, 3])
MASK = torch.tensor([False, True, True, True, True, True, False])


def close(actual, expected, tol=1e-12):
    assert_close_report(actual.detach(), torch.as_tensor(expected, dtype=D), atol=tol, rtol=0)


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 20 / 5),                                  # (2+3+4+5+6) / 5 tokens
    ("seq-mean-token-sum", (5 + 9 + 6) / 3),                 # token sums 5, 9, 6 over 3 sequences
    ("seq-mean-token-mean", (2.5 + 4.5 + 6) / 3),            # token means 2.5, 4.5, 6
    ("seq-mean-token-sum-norm", (5 / 4 + 9 / 4 + 6 / 4) / 3),  # token sum / C (C = 4)
])
def test_modes_hand_values(mode, expected):
    close(aggregate_loss(LOSS, MASK, SEQ, mode, max_len=4), expected)


def test_weights_hand_values():
    w = loss_weights(MASK, SEQ, "seq-mean-token-mean", dtype=D)
    close(w, [0, 1 / 6, 1 / 6, 1 / 6, 1 / 6, 1 / 3, 0])
    close(loss_weights(MASK, SEQ, "token-mean", dtype=D), [0, 0.2, 0.2, 0.2, 0.2, 0.2, 0])


def test_batch_counts():
    assert batch_counts(MASK, SEQ) == (5, 3)


def test_global_normalisers():
    # num_tokens=10: loss is this micro-batch's share of a 10-token batch
    close(aggregate_loss(LOSS, MASK, SEQ, "token-mean", num_tokens=10), 2.0)
    close(aggregate_loss(LOSS, MASK, SEQ, "seq-mean-token-sum", num_seqs=4), 20 / 4)


def test_masked_tokens_get_no_gradient_even_if_inf():
    loss = torch.tensor([float("inf"), 1.0, 2.0], dtype=D, requires_grad=True)
    out = aggregate_loss(loss, torch.tensor([False, True, True]), torch.tensor([0, 0, 0]), "token-mean")
    close(out, 1.5)
    out.backward()
    close(loss.grad, [0.0, 0.5, 0.5])


def test_empty_mask_is_zero():
    m = torch.zeros(7, dtype=torch.bool)
    for mode in AGGREGATION_MODES:
        assert float(aggregate_loss(LOSS, m, SEQ, mode, max_len=4)) == 0.0


def _split_check(lengths, masks, cut, mode, values):
    seq = seq_ids_from_lengths(lengths)
    mask = torch.tensor(masks[:seq.numel()])
    token_loss = torch.tensor(values[:seq.numel()], dtype=torch.float32)
    n_tok, n_seq = batch_counts(mask, seq)
    kw = dict(max_len=8)

    full_in = token_loss.clone().requires_grad_()
    full = aggregate_loss(full_in, mask, seq, mode, **kw)
    full.backward()

    boundary = int(torch.tensor(lengths[:cut]).sum())  # micro-batches hold whole sequences
    total, grads = torch.zeros((), dtype=torch.float32), []
    for part in (slice(0, boundary), slice(boundary, None)):
        x = token_loss[part].clone().requires_grad_()
        piece = aggregate_loss(x, mask[part], seq[part], mode, num_tokens=n_tok, num_seqs=n_seq, **kw)
        piece.backward()
        total, grads = total + piece.detach(), grads + [x.grad]
    assert_close_report(total, full.detach(), atol=1e-5, rtol=1e-5, what=mode)
    # the gradient of each per-token loss is its weight: identical bits whatever the split
    assert_bitwise_equal(torch.cat(grads), full_in.grad, what=mode)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=2, max_size=6),
       masks=st.lists(st.booleans(), min_size=36, max_size=36),
       values=st.lists(st.floats(-10, 10, width=32), min_size=36, max_size=36),
       cut=st.integers(1, 5), mode=st.sampled_from(AGGREGATION_MODES))
def test_micro_batch_accumulation_equals_full_batch(lengths, masks, cut, mode, values):
    _split_check(lengths, masks, min(cut, len(lengths) - 1), mode, values)


def test_errors():
    with pytest.raises(ValueError, match="unknown mode 'mean'"):
        aggregate_loss(LOSS, MASK, SEQ, "mean")
    with pytest.raises(ValueError, match="needs max_len"):
        aggregate_loss(LOSS, MASK, SEQ, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="lengths differ"):
        aggregate_loss(LOSS[:3], MASK, SEQ, "token-mean")
    with pytest.raises(ValueError, match="normaliser must be > 0"):
        aggregate_loss(LOSS, MASK, SEQ, "token-mean", num_tokens=0)
