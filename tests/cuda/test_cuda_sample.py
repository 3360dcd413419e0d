"""CUDA: strict sampling on the Triton backend -- a row's token does not depend on the batch, and
equals the torch backend's token for the same logits (same hash, libdevice logf == torch's log)."""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from tests.bitwise import assert_bitwise_equal
from tests.cuda.conftest import rand

pytestmark = pytest.mark.cuda


def _kwargs(n, filtered):
    kw = dict(seeds=torch.full((n,), 1234, device="cuda"), seq_ids=torch.arange(n, device="cuda"),
              positions=torch.arange(n, device="cuda") * 7,
              temperature=torch.where(torch.arange(n, device="cuda") % 5 == 1, 0.0, 0.9).float())
    if filtered:
        kw.update(top_k=torch.where(torch.arange(n, device="cuda") % 3 == 0, 50, 0),
                  top_p=torch.where(torch.arange(n, device="cuda") % 2 == 0, 0.9, 1.0).float())
    return kw


@pytest.mark.parametrize("filtered", [False, True])
def test_rows_do_not_depend_on_the_batch(triton_backend, filtered):
    n, vocab = 64, 151936
    logits = rand(n, vocab, dtype=torch.float32, seed=1, scale=3.0)
    kw = _kwargs(n, filtered)
    full = ops.sample(logits, **kw)
    for i in (0, 1, 31, 63):
        one = ops.sample(logits[i:i + 1], **{k: v[i:i + 1] for k, v in kw.items()})
        assert_bitwise_equal(one, full[i:i + 1], f"row {i}")
    assert_bitwise_equal(ops.sample(logits, **kw), full, "run to run")


@pytest.mark.parametrize("filtered", [False, True])
def test_same_tokens_as_torch_backend(triton_backend, filtered):
    from rlalign.ops.torch_backend.sample import sample as torch_sample
    from rlalign.ops.triton_backend.sample import sample as triton_sample
    n, vocab = 64, 32000
    logits = rand(n, vocab, dtype=torch.float32, seed=2, scale=3.0)
    kw = _kwargs(n, filtered)
    k = kw.get("top_k", torch.zeros(n, dtype=torch.int64, device="cuda"))
    p = kw.get("top_p", torch.ones(n, device="cuda"))
    args = (logits, kw["seeds"], kw["seq_ids"], kw["positions"], kw["temperature"], k, p)
    assert_bitwise_equal(triton_sample(*args), torch_sample(*args), "triton vs torch backend tokens")


# ---- the per-row vocabulary chunks (sample_chunk_kernel + sample_fold_kernel) -----------------------------------

DECODE_ROWS, BIG_VOCAB = 244, 151936
TIE = 2.0 ** 30   # z >= 2**30 (ulp >= 128): z - log(-log(u)) rounds back to z, so two TIE logits tie exactly
CHECKED_FLAGS = [0, 1, 3]   # the value flags (flag 2 is 0 on a row that filters)


def _chunk_ties(logits):
    """Plant TIE pairs straddling chunk boundaries on every third row (chunks 0|1 at the edge, 0|1 apart, 1|2, 8|9:
    the last full chunk and the partial one); returns {row: the pair's first column}."""
    from rlalign.ops.triton_backend.sample import BLOCK_V, CHUNK_BLOCKS
    w = CHUNK_BLOCKS * BLOCK_V
    pairs = [(w - 1, w), (5, w + 3), (w + 1, 2 * w), (9 * w - 1, 9 * w)]
    first = {}
    for i, r in enumerate(range(0, logits.shape[0], 3)):
        a, b = pairs[i % len(pairs)]
        logits[r, [a, b]] = TIE
        first[r] = a
    return first


def _decode_params(n, filtered):
    kw = _kwargs(n, filtered)   # greedy every fifth row (from row 1), sampled at 0.9 elsewhere
    zeros = torch.zeros(n, dtype=torch.int64, device="cuda")
    return (kw["seeds"], kw["seq_ids"], kw["positions"], kw["temperature"], kw.get("top_k", zeros),
            kw.get("top_p", torch.ones(n, device="cuda")))


@pytest.mark.parametrize("filtered", [False, True])
def test_chunked_kernel_at_the_decode_shape_equals_the_torch_backend(triton_backend, filtered):
    """244 x 151,936 fp32 (10 chunks a row), ties planted across chunk boundaries, greedy and sampled rows (top-k 50 /
    top-p 0.9 ones when filtered: both keep the tied pair): the tokens are the torch backend's and those of one chunk
    per row (the serial walk), tied rows take the first column; the flags are one chunk's and their torch rule's."""
    from rlalign.ops.torch_backend.sample import sample as torch_sample
    from rlalign.ops.triton_backend.sample import BLOCK_V, CHUNK_BLOCKS, sample as triton_sample
    from tests.ops.sample_chunks_worker import launch, reference_flags
    logits = rand(DECODE_ROWS, BIG_VOCAB, dtype=torch.float32, seed=5, scale=3.0)
    first = _chunk_ties(logits)
    params = _decode_params(DECODE_ROWS, filtered)
    tokens = triton_sample(logits, *params)
    assert_bitwise_equal(tokens, torch_sample(logits, *params), "chunked kernel vs torch backend tokens")
    rows = torch.tensor(list(first), device="cuda")
    assert_bitwise_equal(tokens[rows], torch.tensor(list(first.values()), device="cuda"), "first tied column")
    chunked = launch(logits, params, CHUNK_BLOCKS)
    serial = launch(logits, params, -(-BIG_VOCAB // BLOCK_V))
    assert_bitwise_equal(chunked[0], tokens, "launch vs sample() tokens")
    assert_bitwise_equal(serial[0], tokens, "one chunk per row vs chunks: tokens")
    assert_bitwise_equal(chunked[1], serial[1], "one chunk per row vs chunks: flags")
    assert_bitwise_equal(chunked[1], reference_flags(logits, params), "flags vs their torch rule")
    assert bool(chunked[1][CHECKED_FLAGS].bool().all())


@pytest.mark.parametrize("defect", ["nan", "posinf", "neginf_row", "overflow", "temperature"])
def test_chunked_kernel_flags_defects_at_the_decode_shape(triton_backend, defect):
    """A defect in row 7 at the first column of chunk 1: the flags and tokens of the chunks equal one chunk per row's
    and the flags their torch rule; the eager error is the torch backend's, message for message (a bad temperature is
    ops.sample's host check: flags only)."""
    from rlalign.contract.errors import ContractError
    from rlalign.ops.torch_backend.sample import sample as torch_sample
    from rlalign.ops.triton_backend.sample import BLOCK_V, CHUNK_BLOCKS, sample as triton_sample
    from tests.ops.sample_chunks_worker import launch, plant_defect, reference_flags
    logits = rand(DECODE_ROWS, BIG_VOCAB, dtype=torch.float32, seed=6, scale=3.0)
    _chunk_ties(logits)
    params = _decode_params(DECODE_ROWS, True)
    plant_defect(logits, params, defect, 7, CHUNK_BLOCKS * BLOCK_V)
    chunked = launch(logits, params, CHUNK_BLOCKS)
    serial = launch(logits, params, -(-BIG_VOCAB // BLOCK_V))
    assert_bitwise_equal(chunked[0], serial[0], "one chunk per row vs chunks: tokens")
    assert_bitwise_equal(chunked[1], serial[1], "one chunk per row vs chunks: flags")
    assert_bitwise_equal(chunked[1], reference_flags(logits, params), "flags vs their torch rule")
    assert not bool(chunked[1][CHECKED_FLAGS, 7].bool().all()) and bool(chunked[1][CHECKED_FLAGS, 8:].bool().all())
    if defect == "temperature":
        return
    with pytest.raises(ContractError) as want:
        torch_sample(logits, *params)
    with pytest.raises(ContractError) as got:
        triton_sample(logits, *params)
    assert str(got.value) == str(want.value)
