"""TrainBatch: the step's layout, built once from the step's StepSamples, against a plain re-derivation over
random shapes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.models.batch import ForwardBatch
from rlalign.train.packing import TrainBatch, scored_rows
from rlalign.train.samples import StepSamples


def step_samples(samples, logprobs) -> StepSamples:
    """The record of ``samples`` ((prompt + completion tokens, prompt_len)) with the engine's ``logprobs``."""
    n = len(samples)
    return StepSamples(tokens=torch.tensor([t for tokens, _ in samples for t in tokens], dtype=torch.int64),
                       prompt_lens=torch.tensor([p for _, p in samples], dtype=torch.int64),
                       completion_lens=torch.tensor([len(t) - p for t, p in samples], dtype=torch.int64),
                       logprobs=torch.tensor([x for lp in logprobs for x in lp], dtype=torch.float32),
                       truncated=torch.zeros(n, dtype=torch.bool), prompt_index=torch.arange(n), routing=None,
                       routing_rows=torch.zeros(n, dtype=torch.int64))


@st.composite
def batches(draw):
    n = draw(st.integers(1, 12))
    prompt_lens = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    completion_lens = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    samples = [(list(range(100, 100 + p + c)), p) for p, c in zip(prompt_lens, completion_lens)]
    logprobs = [[-0.01 * (i + 1) - 0.001 * t for t in range(c)] for i, c in enumerate(completion_lens)]
    return samples, logprobs, draw(st.integers(1, 30)), draw(st.integers(1, 15))


@settings(max_examples=60, deadline=None)
@given(batches())
def test_layout_matches_a_plain_derivation(case):
    samples, logprobs, max_tokens, mini_batches = case
    batch = TrainBatch.build(step_samples(samples, logprobs), max_tokens=max_tokens, mini_batches=mini_batches)
    lens = [len(t) - p for t, p in samples]
    assert batch.seq_ids.tolist() == [i for i, n in enumerate(lens) for _ in range(n)]
    assert batch.completion_lens.tolist() == lens
    assert batch.mask.dtype == torch.bool and bool(batch.mask.all()) and batch.mask.numel() == sum(lens)
    assert batch.rollout_logprobs.tolist() == torch.tensor([x for lp in logprobs for x in lp]).tolist()
    # mini-batches: min(M, N) consecutive runs of samples, none empty, sizes within one of each other
    minis = [[i for mb in mini for i in mb.samples] for mini in batch.mini_batches]
    assert len(minis) == min(mini_batches, len(samples))
    assert [i for m in minis for i in m] == list(range(len(samples)))
    assert max(map(len, minis)) - min(map(len, minis)) <= 1
    # micro-batches: consecutive, token budget respected (a longer sample alone), slices tile [0, T)
    stop = 0
    for mb in batch.micro_batches:
        chosen = [samples[i] for i in mb.samples]
        assert sum(len(t) for t, _ in chosen) <= max_tokens or len(chosen) == 1
        assert mb.tokens.start == stop
        stop = mb.tokens.stop
        rows, targets = scored_rows(chosen, "cpu")
        assert torch.equal(mb.rows, rows) and torch.equal(mb.targets, targets)
        assert torch.equal(mb.seq_ids, batch.seq_ids[mb.tokens] - mb.samples.start)
        packed = ForwardBatch.packed([list(t) for t, _ in chosen])   # the forward, exactly as built from lists
        for field in ("input_ids", "positions", "cu_seqlens"):
            got, want = getattr(mb.forward, field), getattr(packed, field)
            assert got.dtype == want.dtype and torch.equal(got, want), field
        assert mb.rows.dtype == mb.targets.dtype == torch.int64
    assert stop == sum(lens)


def test_one_mini_batch_keeps_the_micro_batches_of_the_whole_batch():
    samples = [([1, 2, 3, 4], 2), ([5, 6, 7], 1), ([8, 9], 1)]
    logprobs = [[-1.0, -2.0], [-1.0, -1.0], [-0.5]]
    batch = TrainBatch.build(step_samples(samples, logprobs), max_tokens=7)
    assert [list(mb.samples) for mb in batch.micro_batches] == [[0, 1], [2]]
    assert len(batch.mini_batches) == 1


@pytest.mark.parametrize("logprobs, problem", [([[-1.0]], "one rollout logprob per completion token"),
                                               ([[-1.0, -1.0, -1.0]], "one rollout logprob per completion token")])
def test_bad_input_is_named(logprobs, problem):
    with pytest.raises(ValueError, match=problem):
        TrainBatch.build(step_samples([([1, 2, 3], 1)], logprobs), max_tokens=8)


def test_no_samples_is_named():
    with pytest.raises(ValueError, match="no samples"):
        TrainBatch.build(step_samples([], []), max_tokens=8)
