"""The sampler's static form (CUDA-graph capture; ``ops.static_decode()`` runs it eagerly) gives the eager bits.

Inside a captured decode graph ``ops.sample_and_score`` may not read tensor data on the host nor allocate a
data-dependent shape: its validations become device verdicts, top-k/top-p rows are masked from a full
stable sort of every row (``static_keep_mask``) and the rows are scored in one call at
``score_temperature``. These tests run that form on the CPU and compare raw bits with the eager op over
hypothesis-chosen batches: rows with and without filtering mixed, greedy rows, tied and masked (-inf)
logits, top_k >= V, degenerate sizes (one row, a vocabulary of one or two tokens).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from rlalign import ops
from rlalign.contract.errors import ContractError
from rlalign.ops import capturing_graph
from rlalign.ops.torch_backend import sample as backend
from tests.bitwise import assert_bitwise_equal

SETTINGS = dict(max_examples=30, deadline=None)


def _logits(rows: int, vocab: int, seed: int, ties: bool, masked: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * 3
    if ties:   # few distinct values: the order's id tie-break decides top-k and the nucleus
        z = z.round()
    if masked and vocab > 1:
        z[torch.rand(rows, vocab, generator=g) < 0.3] = float("-inf")
        z[:, 0] = z[:, 0].clamp(min=-5.0)   # every row keeps a finite logit
    return z


@settings(**SETTINGS)
@given(data=st.data(), rows=st.integers(1, 12), vocab=st.sampled_from([1, 2, 7, 300, 1500]),
       seed=st.integers(0, 2 ** 20), ties=st.booleans(), masked=st.booleans())
def test_static_keep_mask_equals_keep_mask(data, rows, vocab, seed, ties, masked):
    z = _logits(rows, vocab, seed, ties, masked)
    k = torch.tensor(data.draw(st.lists(st.integers(0, vocab + 2), min_size=rows, max_size=rows)))
    k = torch.where(k >= vocab, 0, k)   # as ops.sample passes it
    p = torch.tensor(data.draw(st.lists(st.sampled_from([1.0, 0.05, 0.5, 0.9, 0.999]), min_size=rows,
                                        max_size=rows)), dtype=torch.float32)
    assert_bitwise_equal(backend.static_keep_mask(z, k, p), backend.keep_mask(z, k, p), "static vs eager keep mask")


def _hidden_head(rows: int, vocab: int, seed: int, bf16: bool):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    return (torch.randn(rows, 16, generator=g) * 2).to(dtype), torch.randn(vocab, 16, generator=g).to(dtype)


@settings(**SETTINGS)
@given(data=st.data(), rows=st.integers(1, 10), vocab=st.sampled_from([1, 2, 37, 1025]),
       seed=st.integers(0, 2 ** 20), bf16=st.booleans(), score_t=st.sampled_from([0.3, 1.0, 1.7]))
def test_static_sample_and_score_equals_eager(data, rows, vocab, seed, bf16, score_t):
    hidden, weight = _hidden_head(rows, vocab, seed, bf16)
    # one logprob temperature per call (the static form's condition): T everywhere, greedy rows only at 1.0
    temps = data.draw(st.lists(st.sampled_from([score_t, 0.0] if score_t == 1.0 else [score_t]),
                               min_size=rows, max_size=rows), "temperatures")
    ks = data.draw(st.lists(st.sampled_from([0, 0, 1, 3, vocab, vocab + 5]), min_size=rows, max_size=rows), "top_k")
    ps = data.draw(st.lists(st.sampled_from([1.0, 1.0, 0.5, 0.9]), min_size=rows, max_size=rows), "top_p")
    seeds = torch.tensor(data.draw(st.lists(st.integers(0, 2 ** 62), min_size=rows, max_size=rows)))
    positions = torch.tensor(data.draw(st.lists(st.integers(0, 5000), min_size=rows, max_size=rows)))
    want = ops.sample_and_score(hidden, weight, seeds=seeds, positions=positions, temperature=temps, top_k=ks,
                                top_p=ps)
    with ops.static_decode():
        got = ops.sample_and_score(hidden, weight, seeds=seeds, positions=positions,
                                   temperature=torch.tensor(temps, dtype=torch.float32), top_k=torch.tensor(ks),
                                   top_p=torch.tensor(ps, dtype=torch.float32), score_temperature=score_t)
    assert_bitwise_equal(got[0], want[0], "static vs eager tokens")
    assert_bitwise_equal(got[1], want[1], "static vs eager logprobs")


def test_static_form_refuses_a_wrong_score_temperature():
    hidden, weight = _hidden_head(3, 40, 0, False)
    kwargs = dict(seeds=torch.arange(3), positions=torch.arange(3), top_k=torch.zeros(3, dtype=torch.int64),
                  top_p=torch.ones(3))
    with ops.static_decode(), pytest.raises(ContractError, match="score_temperature=0.5 is not every row"):
        ops.sample_and_score(hidden, weight, temperature=torch.tensor([0.5, 0.7, 0.5]), score_temperature=0.5, **kwargs)
    with ops.static_decode(), pytest.raises(ContractError, match="needs score_temperature"):
        ops.sample_and_score(hidden, weight, temperature=torch.full((3,), 0.5), **kwargs)
    with pytest.raises(ContractError, match="a row's logprob temperature is 1.0"):   # greedy rows score at 1.0
        ops.sample_and_score(hidden, weight, temperature=[0.0, 0.5, 0.5], score_temperature=0.5, **kwargs)


def test_static_form_turns_validations_into_verdicts():
    """Bad values still raise in the static form (checked on the device: at once on the CPU)."""
    hidden, weight = _hidden_head(2, 40, 1, False)
    kwargs = dict(seeds=torch.arange(2), positions=torch.arange(2), temperature=torch.ones(2), score_temperature=1.0)
    with ops.static_decode(), pytest.raises(ContractError, match="top_p .* is out of range"):
        ops.sample_and_score(hidden, weight, top_k=torch.zeros(2, dtype=torch.int64),
                             top_p=torch.tensor([1.0, 0.0]), **kwargs)
    logits = torch.randn(2, 40)
    logits[1, 3] = float("nan")
    with ops.static_decode(), pytest.raises(ContractError, match="NaN or \\+inf"):
        ops.sample(logits, seeds=0, seq_ids=0, positions=0)


class _NoHostReads(TorchDispatchMode):
    """Fails on what cannot happen inside a CUDA-graph capture: reading a tensor's value on the host
    (``bool(t)``, ``t.item()``, ``t.tolist()``) or an op whose output shape depends on the data."""
    FORBIDDEN = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "repeat_interleave"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.FORBIDDEN:
            raise AssertionError(f"host read / data-dependent shape inside the static form: aten.{name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("filtered", [False, True])
def test_captured_form_reads_nothing_on_the_host_and_records_its_verdicts(filtered):
    """The capture-time branches on the CPU: under ``capturing_graph`` the op runs with no host read and no
    data-dependent shape (aten-level check), its validations are recorded as verdicts (all passing here),
    and its bits are the eager op's."""
    rows, vocab = 6, 300
    hidden, weight = _hidden_head(rows, vocab, 3, False)
    temps = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    ks = torch.tensor([0, 0, 5, 0, 0, 0] if filtered else [0] * rows)
    ps = torch.tensor([1.0, 1.0, 1.0, 0.8, 1.0, 1.0] if filtered else [1.0] * rows)
    kwargs = dict(seeds=torch.arange(rows) * 977, positions=torch.arange(rows) + 40)
    want = ops.sample_and_score(hidden, weight, temperature=temps.tolist(), top_k=ks.tolist(), top_p=ps.tolist(),
                                **kwargs)
    with capturing_graph(max_query_len=1, sample_filtered=filtered) as verdicts, _NoHostReads():
        got = ops.sample_and_score(hidden, weight, temperature=temps, top_k=ks, top_p=ps, score_temperature=1.0,
                                   **kwargs)
    assert_bitwise_equal(got[0], want[0], "captured-form tokens")
    assert_bitwise_equal(got[1], want[1], "captured-form logprobs")
    assert verdicts and all(bool(ok) for _, _, ok in verdicts)


def test_a_graph_captured_without_filtering_refuses_a_filtering_row():
    hidden, weight = _hidden_head(2, 50, 4, False)
    with capturing_graph(max_query_len=1, sample_filtered=False) as verdicts:
        ops.sample_and_score(hidden, weight, seeds=torch.arange(2), positions=torch.arange(2),
                             temperature=torch.ones(2), top_k=torch.tensor([0, 3]), top_p=torch.ones(2),
                             score_temperature=1.0)
    failed = [message for _, message, ok in verdicts if not bool(ok)]
    assert len(failed) == 1 and "captured without filtering" in failed[0]
