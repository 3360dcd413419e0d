"""CUDA: the portable profile's bits equal the CPU's -- every primitive, every op, and a rollout recorded on one
device scored on the other (0 mismatches, the same tokens and logprob bits both ways). Not run on the CPU-only CI
machine (skipped without CUDA); ``python benchmarks/portable_check.py`` is the timed version."""

from __future__ import annotations

import struct

import pytest
import torch

from rlalign import ops
from rlalign.contract import use_profile
from rlalign.ops.portable import arith
from rlalign.parity.replay import RolloutRecord
from rlalign.parity.run import ParityOptions, run_parity
from tests.bitwise import assert_bitwise_equal

pytestmark = pytest.mark.cuda


def _both(fn, *inputs):
    """fn on the CPU inputs and on their CUDA copies -> (cpu outputs, cuda outputs moved back), as tuples."""
    def run(args):
        with use_profile("portable"), torch.no_grad():
            out = fn(*args)
        return tuple(x.cpu() for x in (out if isinstance(out, tuple) else (out, )) if x is not None)
    return run(inputs), run(tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs))


def _assert_same(fn, *inputs, what=""):
    cpu, gpu = _both(fn, *inputs)
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert_bitwise_equal(b, a, f"{what} output {i}: CUDA vs CPU")


def _random_floats(n: int, seed: int) -> torch.Tensor:
    """Random fp32 bit patterns (every exponent, subnormals, infinities and NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("fn", [arith.exp, arith.log, arith.sqrt, arith.silu], ids=lambda f: f.__name__)
def test_primitives_over_all_floats(fn):
    x = _random_floats(4_000_000, 1)
    # NaN inputs' payloads are not part of the promise, and the ops refuse non-finite inputs (silu(-inf) is a
    # library NaN); exp / log / sqrt give their one NaN constant or an infinity for the rest
    x = torch.where(torch.isnan(x) | (torch.isinf(x) if fn is arith.silu else False), 0.0, x)
    dense = torch.cat([torch.linspace(-110, 95, 1_000_000), torch.linspace(-1e-3, 1e-3, 100_001)])
    _assert_same(fn, x, what=fn.__name__)
    _assert_same(fn, dense, what=fn.__name__ + " dense")


def test_sin_cos64():
    a = torch.rand(2_000_000, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 1e6
    _assert_same(arith.sin_cos64, a, what="sin_cos64")


@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (7, 5, 3), (33, 129, 257), (64, 896, 4864), (3, 151, 1000)])
def test_matmul_nt(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    _assert_same(arith.matmul_nt, torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), what="matmul_nt")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_op(dtype):
    g = torch.Generator().manual_seed(3)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    t, h, heads, kv, d, vocab = 37, 96, 6, 2, 16, 301
    inv_freq = ops.rope_inv_freq(d, 1e6)
    _assert_same(lambda x, w, b: ops.linear(x, w, b), r(t, h), r(200, h, scale=0.1), r(200), what="linear")
    _assert_same(lambda x, w, res: ops.rms_norm(x, w, 1e-6, residual=res), r(t, h), r(h), r(t, h), what="rms_norm")
    _assert_same(lambda p: ops.rope_cos_sin(p, inv_freq.to(p.device), 1.3), torch.arange(5000) * 13, what="tables")
    cos, sin = ops.rope_cos_sin(torch.arange(t), inv_freq, profile="portable")
    _assert_same(ops.rope, r(t, heads, d), cos, sin, what="rope")
    _assert_same(ops.silu_mul, r(t, h), r(t, h), what="silu_mul")
    cu = torch.tensor([0, 5, 5, 30, t])
    _assert_same(ops.attention_varlen, r(t, heads, d), r(t, kv, d), r(t, kv, d), cu, what="attention_varlen")
    _assert_same(lambda x, w, y: ops.logprob_entropy(x, w, y, temperature=0.7), r(t, h), r(vocab, h, scale=0.1),
                 torch.arange(t) * 7 % vocab, what="logprob_entropy")
    _assert_same(lambda x, w: ops.lm_logits(x, w), r(t, h), r(vocab, h, scale=0.1), what="lm_logits")
    logits = torch.randn(t, vocab, generator=g) * 4
    rows = torch.arange(t)
    _assert_same(lambda z, ids, temp, k, p: ops.sample(z, seeds=9, seq_ids=ids, positions=3, temperature=temp,
                                                      top_k=k, top_p=p, min_p=0.01),
                 logits, rows, (rows % 4).float() * 0.4, rows % 3 * 5, 1.0 - (rows % 2).float() * 0.3, what="sample")


def test_paged_attention():
    g = torch.Generator().manual_seed(4)
    page, lens = 4, [9, 1, 14]
    kc, vc = torch.randn(12, page, 2, 16, generator=g), torch.randn(12, page, 2, 16, generator=g)
    table = torch.tensor([[5, 2, 7, 0], [1, 3, 4, 6], [11, 10, 9, 8]])
    q = torch.randn(6, 4, 16, generator=g)
    _assert_same(ops.attention_paged, q, kc, vc, table, torch.tensor(lens), torch.tensor([0, 3, 4, 6]), what="paged")


def _bits(values):
    return [struct.pack("<f", v) for v in values]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_k=5, top_p=0.9)])
def test_a_rollout_recorded_on_one_device_scores_bitwise_on_the_other(tmp_path, sampling):
    records = {}
    for device in ("cpu", "cuda"):
        path = tmp_path / f"{device}.jsonl"
        result = run_parity(ParityOptions(model="default", profile="portable", device=device, prompts=4, samples=2,
                                          max_new_tokens=12, record=str(path), **sampling))
        assert result.ok, f"{device}: {result.tokens.mismatches} mismatches on the same device"
        records[device] = RolloutRecord.load(path)
    for recorded, scored in (("cuda", "cpu"), ("cpu", "cuda")):
        result = run_parity(ParityOptions(model="default", profile="portable", device=scored,
                                          replay=str(tmp_path / f"{recorded}.jsonl")))
        assert result.ok and result.tokens.mismatches == 0, f"recorded on {recorded}, scored on {scored}"
    for a, b in zip(records["cpu"].sequences, records["cuda"].sequences):
        assert a.tokens == b.tokens and _bits(a.logprobs) == _bits(b.logprobs)
