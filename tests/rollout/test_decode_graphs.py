"""Decode steps replayed from CUDA graphs (rlalign.rollout.decode_graphs) change no token and no logprob.

CPU (CI): ``decode_graphs="padded"`` runs the graphs' padded static batches eagerly; every token and
logprob equals the eager engine's across random engine configurations, and steps larger than the
biggest bucket fall back to eager forwards. CUDA (skipped without a GPU): captured graphs give the
same completions as eager steps, also after a weight update, and a NaN in the weights still raises.
"""

from __future__ import annotations

import random

import pytest
import torch

from rlalign.contract.errors import ContractError
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.rollout.decode_graphs import buckets_up_to
from rlalign.rollout.errors import RolloutConfigError
from tests.rollout.test_engine_bitwise import (MAX_NEW, SAMPLINGS, assert_matches_trainer, assert_same_completions,
                                               make_prompts, random_config)


def test_buckets_cover_every_batch_size_with_little_padding():
    sizes = buckets_up_to(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and sizes == sorted(set(sizes))
    for n in range(1, 513):
        b = next(s for s in sizes if s >= n)
        assert n > 16 and b - n < b / 5 or b <= 16, (n, b)
    assert buckets_up_to(1) == [1] and buckets_up_to(20)[-1] == 20


def test_config_refuses_impossible_graph_settings():
    model = tiny_model("qwen3", seed=0)
    with pytest.raises(RolloutConfigError, match="decode_graphs must be one of"):
        RolloutConfig(decode_graphs="yes")
    with pytest.raises(RolloutConfigError, match="needs a CUDA model"):
        RolloutEngine(model, RolloutConfig(decode_graphs="on", num_pages=16))
    # auto on the CPU: eager, no scratch pages
    engine = RolloutEngine(model, RolloutConfig(num_pages=16))
    assert engine.decode_graphs is None and engine.kv_cache.num_pages == 16


@pytest.mark.parametrize("seed", range(4))
def test_padded_decode_batches_change_nothing(model, prompts, seed):
    rng = random.Random(100 + seed)
    name = list(SAMPLINGS)[seed % len(SAMPLINGS)]
    sampling = SAMPLINGS[name]
    config = random_config(rng, max(len(p) for p in prompts) + MAX_NEW)
    want = RolloutEngine(model, config).generate(prompts, sampling)
    config.decode_graphs = "padded"
    config.decode_graph_max_batch = rng.choice([3, 8, 64])   # 3: larger decode steps run eagerly
    engine = RolloutEngine(model, config)
    got = engine.generate(prompts, sampling)
    assert_same_completions(got, want)
    assert engine.counters["graph_steps"] > 0
    assert engine.stats()["free_pages"] == engine.stats()["num_pages"]


# ---- CUDA -----------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def cuda_model():
    return tiny_model("qwen3", seed=5, init_std=0.1, dtype="bfloat16", device="cuda")


@cuda
@pytest.mark.cuda
def test_cuda_graph_replays_equal_eager_steps_and_the_trainer(cuda_model):
    prompts = make_prompts(2, count=9)
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=7)
    eager = RolloutEngine(cuda_model, RolloutConfig(num_pages=512, decode_graphs="off")).generate(prompts, sampling)
    engine = RolloutEngine(cuda_model, RolloutConfig(num_pages=512, decode_graphs="on", decode_graph_max_batch=48))
    got = engine.generate(prompts, sampling)
    assert_same_completions(got, eager)
    assert engine.counters["graph_steps"] > 0 and engine.decode_graphs.replays > 0
    assert_matches_trainer(cuda_model, got, 1.0)
    # a second, smaller generate reuses the captured graphs (other buckets)
    again = engine.generate(prompts[:3], sampling)
    assert_same_completions(again, eager[:12])


@cuda
@pytest.mark.cuda
def test_cuda_graphs_follow_weight_updates_and_fail_closed_on_nan():
    model = tiny_model("llama", seed=6, init_std=0.1, dtype="bfloat16", device="cuda")
    other = tiny_model("llama", seed=7, init_std=0.1, dtype="bfloat16", device="cuda")
    prompts = make_prompts(3, count=5)
    sampling = SamplingParams(n=3, max_new_tokens=12, seed=1)
    engine = RolloutEngine(model, RolloutConfig(num_pages=256, decode_graphs="on", decode_graph_max_batch=16))
    engine.generate(prompts, sampling)
    engine.update_weights(other.state_dict())
    got = engine.generate(prompts, sampling)
    want = RolloutEngine(other, RolloutConfig(num_pages=256, decode_graphs="off")).generate(prompts, sampling)
    assert_same_completions(got, want)
    steps_before = engine.counters["graph_steps"]
    # a NaN appearing between two replayed decode steps is caught by the verdicts recorded in the graph
    for i, p in enumerate(prompts):
        engine.add_request(p, sampling, prompt_index=i)
    while engine.counters["graph_steps"] == steps_before:
        engine.step()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    # with overlapped scheduling (auto on CUDA) the step already in flight was queued before the NaN and
    # completes cleanly; the next step reads it and raises
    with pytest.raises(ContractError, match="NaN"):
        for _ in range(2):
            engine.step()


def test_the_host_check_refuses_what_the_ops_would():
    """Inside a graph the ops cannot validate their index tensors; DecodeGraphs.check does it on the host."""
    import numpy as np

    from rlalign.models.batch import KVCache
    from rlalign.rollout.decode_graphs import DecodeGraphs, HostDecode
    from rlalign.rollout.errors import RolloutError

    model = tiny_model("qwen3", seed=0)
    cfg = model.config
    cache = KVCache(cfg.num_layers, 10, 4, cfg.num_kv_heads, cfg.head_dim)
    graphs = DecodeGraphs(model, cache, scratch_pages=[8, 9], max_batch=8, max_pages=3, mode="padded")

    def host(table, seq_lens, slots):
        n = len(seq_lens)
        return HostDecode(np.zeros(n, np.int64), np.asarray(seq_lens, np.int64) - 1, np.asarray(table, np.int32),
                          np.asarray(seq_lens, np.int32), np.asarray(slots, np.int64))

    good = host([[0, 1], [2, 0]], [6, 3], [1 * 4 + 1, 2 * 4 + 2])
    graphs.check(good, num_pages=8)
    with pytest.raises(RolloutError, match="block table points outside"):
        graphs.check(host([[0, 8], [2, 0]], [6, 3], [8 * 4 + 1, 10]), num_pages=8)     # a scratch page
    with pytest.raises(RolloutError, match="block table points outside"):
        graphs.check(host([[0], [2]], [6, 3], [5, 10]), num_pages=8)                     # a page missing
    with pytest.raises(RolloutError, match="slots or positions"):
        graphs.check(host([[0, 1], [2, 0]], [6, 3], [5, 5]), num_pages=8)                # one slot twice
    bad_id = host([[0, 1], [2, 0]], [6, 3], [5, 10])
    bad_id.ids[1] = cfg.vocab_size
    with pytest.raises(RolloutError, match="token id outside the vocabulary"):
        graphs.check(bad_id, num_pages=8)
    with pytest.raises(RolloutError, match="graphs hold 3"):
        graphs.check(host([[0, 1, 2, 3]], [14], [13]), num_pages=8)
    hidden = graphs.run(good)                                                           # padded to bucket 2
    assert hidden.shape == (2, cfg.hidden_size) and torch.isfinite(hidden).all()


def test_native_padded_decode_runs_and_matches_the_native_trainer(model, prompts):
    """Native through the graphs' padded static batches (its static-shape attention over width buckets):
    every logprob agrees with the native trainer forward on the same tokens to fp32 rounding (native
    promises no bits), and tokens are drawn from the model's own distribution."""
    from rlalign.contract import use_profile
    from rlalign.models.batch import ForwardBatch

    torch.manual_seed(0)   # the native sampler's static form draws from the default generator
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=MAX_NEW, seed=11)
    engine = RolloutEngine(model, RolloutConfig(profile="native", num_pages=256, decode_graphs="padded",
                                                decode_graph_max_batch=16))
    got = engine.generate(prompts, sampling)
    assert engine.counters["graph_steps"] > 0
    assert engine.decode_graphs.width_buckets and engine.decode_graphs.widths[0] == 1
    seqs = [c.prompt_tokens + c.tokens for c in got]
    targets = torch.tensor([t for q in seqs for t in q[1:] + [0]])
    with use_profile("native"), torch.no_grad():
        lp, _ = model.logprobs(ForwardBatch.packed(seqs, device=model.device), targets)
    starts = torch.tensor([0] + [len(q) for q in seqs]).cumsum(0).tolist()
    want = [lp[a + len(c.prompt_tokens) - 1:a + len(c.prompt_tokens) - 1 + len(c.tokens)] for a, c in zip(starts, got)]
    for c, ref in zip(got, want):
        assert len(c.tokens) == MAX_NEW and all(0 <= t < model.config.vocab_size for t in c.tokens)
        err = (torch.tensor(c.logprobs) - ref).abs().max().item()
        assert err < 1e-4, f"native padded decode logprob differs from the native trainer's by {err}"


@cuda
@pytest.mark.cuda
def test_cuda_native_profile_replays_sampling_graphs_with_overlap(cuda_model):
    """Native runs through the same decode graphs as strict (the fair baseline): full-width graphs (its paged
    kernel reads each sequence's length on the device), the sampler captured with the forward, overlapped
    steps; its logprobs stay close to the native trainer's (native promises no bits: bf16 rounding of a
    different attention formulation)."""
    from rlalign.contract import use_profile
    from rlalign.models.batch import ForwardBatch

    prompts = make_prompts(2, count=9)
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=7)
    engine = RolloutEngine(cuda_model, RolloutConfig(profile="native", num_pages=512, decode_graphs="auto",
                                                     decode_graph_max_batch=48))
    got = engine.generate(prompts, sampling)
    graphs = engine.decode_graphs
    assert graphs is not None and not graphs.width_buckets and graphs.samples
    assert graphs.captures > 0 and graphs.replays > 0
    assert engine.overlap and engine.counters["graph_steps"] > 0 and engine.counters["overlapped_steps"] > 0
    seqs = [c.prompt_tokens + c.tokens for c in got]
    targets = torch.tensor([t for q in seqs for t in q[1:] + [0]], device="cuda")
    with use_profile("native"), torch.no_grad():
        lp, _ = cuda_model.logprobs(ForwardBatch.packed(seqs, device="cuda"), targets)
    lp, offset, diffs = lp.cpu(), 0, []
    for c, q in zip(got, seqs):
        first = offset + len(c.prompt_tokens) - 1
        diffs.append((torch.tensor(c.logprobs) - lp[first:first + len(c.tokens)]).abs())
        offset += len(q)
    diffs = torch.cat(diffs)
    assert float(diffs.mean()) < 0.05 and float(diffs.max()) < 0.5, (float(diffs.mean()), float(diffs.max()))
    captured = graphs.captures
    engine.blocks.reset_prefix_cache()                      # the same schedule again: nothing new to capture
    engine.generate(prompts, sampling)
    assert graphs.captures == captured


@cuda
@pytest.mark.cuda
def test_cuda_native_static_decode_matches_the_eager_native_op():
    from rlalign import ops
    from tests.ops.test_native_decode import _inputs

    q, kc, vc, table, lens, cu = (t.cuda() for t in _inputs(16, 8, 2, 128, [1, 17, 300, 64, 65], 3, 0))
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    want = ops.attention_paged(q, kc, vc, table, lens, cu, profile="native").float()
    with ops.static_decode():
        got = ops.attention_paged(q, kc, vc, table, lens, cu, profile="native").float()
    assert float((got - want).abs().max()) < 2e-2


def test_native_forward_takes_the_capture_paths_on_the_cpu(model):
    """What a CUDA capture of the native forward runs -- the ops' capture paths (index validation skipped,
    decode form chosen from the capture hint) -- runs on the CPU too and equals the padded (eager) form."""
    import numpy as np

    from rlalign.contract import use_profile
    from rlalign.models.batch import KVCache
    from rlalign.ops import capturing_graph
    from rlalign.rollout.decode_graphs import DecodeGraphs, HostDecode

    cfg = model.config
    cache = KVCache(cfg.num_layers, 12, 4, cfg.num_kv_heads, cfg.head_dim)
    cache.k[0].normal_(), cache.v[0].normal_(), cache.k[1].normal_(), cache.v[1].normal_()
    graphs = DecodeGraphs(model, cache, scratch_pages=[10, 11], max_batch=8, max_pages=4, mode="padded",
                          width_buckets=True)
    host = HostDecode(np.array([5, 9, 17], np.int64), np.array([6, 2, 9], np.int64),
                      np.array([[0, 1, 0], [2, 0, 0], [3, 4, 5]], np.int32), np.array([7, 3, 10], np.int32),
                      np.array([1 * 4 + 2, 2 * 4 + 2, 5 * 4 + 1], np.int64))
    graphs.check(host, num_pages=10)
    with use_profile("native"):
        padded = graphs.run(host).clone()
        b, w = graphs.bucket(3), graphs.width(3)
        graphs._fill(host, b)
        with capturing_graph(max_query_len=1):
            captured_path = model.forward_hidden(graphs._batch(b, w))[:3]
    assert torch.equal(captured_path, padded)
