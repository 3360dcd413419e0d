"""The native profile runs the strict profile's engine machinery (strict / native measures the
cost of the contract and nothing else), CPU tier: the graphs' padded static batches, with the sampler
inside them and overlapped scheduling.

- a native engine builds the same decode graphs as a strict one (buckets, the sampler captured, overlap);
  the one difference left on the CPU is inherent -- its paged attention gathers K/V for SDPA, attending over
  the block table's whole width inside a graph, so its graphs are keyed by width buckets too;
- native decode steps are sampled by the graphs and overlapped (every decode step after the first of a run
  of decode steps), tokens stay in the vocabulary and every logprob equals the native trainer's forward on
  the same tokens to fp32 rounding, with several samples per prompt, ragged prompts and a preemption-free
  page budget and with one that preempts.
"""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from rlalign.contract import use_profile
from rlalign.models.batch import ForwardBatch
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams

NEW = 6


def _machinery(engine: RolloutEngine) -> dict:
    graphs = engine.decode_graphs
    return dict(mode=graphs.mode, buckets=graphs.buckets, samples=graphs.samples, overlap=engine.overlap,
                max_batch=graphs.max_batch, max_pages=graphs.max_pages)


def test_native_builds_the_strict_engines_machinery(model):
    config = dict(num_pages=64, decode_graphs="padded", overlap="on", decode_graph_max_batch=8)
    strict = RolloutEngine(model, RolloutConfig(profile="strict", **config))
    native = RolloutEngine(model, RolloutConfig(profile="native", **config))
    assert _machinery(native) == _machinery(strict)
    assert native.decode_graphs.samples and native.overlap
    # inherent on the CPU: the gathering attention's static form attends over the whole table width
    assert native.decode_graphs.width_buckets and not strict.decode_graphs.width_buckets
    auto = RolloutEngine(model, RolloutConfig(profile="native", num_pages=64, decode_graphs="padded"))
    assert not auto.overlap   # "auto" overlaps CUDA graphs only, as for strict


def _native_trainer_logprobs(model, completions, temperature: float) -> list[torch.Tensor]:
    seqs = [c.prompt_tokens + c.tokens for c in completions]
    targets = torch.tensor([t for q in seqs for t in q[1:] + [0]])
    with use_profile("native"), torch.no_grad():
        lp, _ = model.logprobs(ForwardBatch.packed(seqs, device=model.device), targets,
                               temperature=ops.logprob_temperature(temperature))
    out, start = [], 0
    for c, q in zip(completions, seqs):
        first = start + len(c.prompt_tokens) - 1
        out.append(lp[first:first + len(c.tokens)])
        start += len(q)
    return out


@pytest.mark.parametrize("num_pages, sampling", [
    (256, SamplingParams(n=3, temperature=1.0, max_new_tokens=NEW, seed=11, ignore_eos=True)),
    (256, SamplingParams(n=2, temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=NEW, seed=3, ignore_eos=True)),
    (14, SamplingParams(n=2, temperature=1.0, max_new_tokens=NEW, seed=5, ignore_eos=True)),   # preempts
])
def test_native_decode_is_graph_sampled_overlapped_and_scored_by_the_trainer(model, prompts, num_pages, sampling):
    torch.manual_seed(0)   # the native sampler's static form draws from the default generator
    engine = RolloutEngine(model, RolloutConfig(profile="native", num_pages=num_pages, page_size=4,
                                                decode_graphs="padded", overlap="on", decode_graph_max_batch=16))
    got = engine.generate(prompts[:4], sampling)
    assert engine.counters["graph_steps"] > 0 and engine.counters["overlapped_steps"] > 0
    assert (engine.stats()["preemptions"] > 0) == (num_pages < 64)
    vocab = model.config.vocab_size
    for c, ref in zip(got, _native_trainer_logprobs(model, got, sampling.temperature)):
        assert len(c.tokens) == NEW and all(0 <= t < vocab for t in c.tokens)
        err = (torch.tensor(c.logprobs) - ref).abs().max().item()
        assert err < 1e-4, f"native graph-sampled logprob differs from the native trainer's by {err}"
