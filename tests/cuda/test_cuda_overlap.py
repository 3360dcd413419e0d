"""CUDA tier of sampling inside the decode graphs and overlapped scheduling (skipped without CUDA).

On an H200: captured decode graphs that sample give the eager sampler's bits (tokens,
logprobs, finish reasons), for plain, top-k/top-p (the graph variant that sorts every row), greedy and
mixed-temperature workloads (mixed logprob temperatures: the graph replays and the step samples eagerly);
overlapped scheduling (the next step queued before the current one's tokens are read, input ids copied on
the device, pinned uploads and readbacks) gives the serial engine's bits, with stops, arrivals mid-run,
preemption under a small KV cache and MoE routing records; a NaN still raises.
"""

from __future__ import annotations

import pytest
import torch

from rlalign.contract.errors import ContractError
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.rollout.block_manager import pages_for
from tests.rollout.test_engine_bitwise import STOPS, assert_matches_trainer, make_prompts
from tests.rollout.test_overlap import PROMPTS, assert_same, run_workload

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORKLOADS = {
    "t1_stops": [SamplingParams(n=3, max_new_tokens=20, seed=4, stop_token_ids=STOPS)],
    "topk_topp": [SamplingParams(n=2, temperature=0.8, top_k=7, top_p=0.85, max_new_tokens=16, seed=5)],
    "greedy_and_t1": [SamplingParams(n=2, temperature=0.0, max_new_tokens=12, seed=1),
                      SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=14, seed=2)],
    "two_logprob_temperatures": [SamplingParams(n=2, temperature=0.7, max_new_tokens=12, seed=3),
                                 SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3)],
}


@pytest.fixture(scope="module")
def cuda_model():
    return tiny_model("qwen3", seed=5, init_std=0.1, dtype="bfloat16", device="cuda")


def _requests(settings: list[SamplingParams]) -> list[tuple[int, int, SamplingParams]]:
    """Every prompt, settings in turn; the last two arrive while the others run."""
    return [(0 if i < len(PROMPTS) - 2 else 3 + i, i, settings[i % len(settings)]) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_graph_sampling_equals_eager_sampling(cuda_model, name):
    requests = _requests(WORKLOADS[name])
    eager = RolloutEngine(cuda_model, RolloutConfig(num_pages=512, decode_graphs="off"))
    graphs = RolloutEngine(cuda_model, RolloutConfig(num_pages=512, decode_graphs="on", overlap="off",
                                                     decode_graph_max_batch=32))
    want = run_workload(eager, requests)
    assert_same(run_workload(graphs, requests), want, f"{name}: graph-sampled vs eager")
    assert graphs.counters["graph_steps"] > 0 and graphs.decode_graphs.samples


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_overlap_on_equals_off(cuda_model, name):
    requests = _requests(WORKLOADS[name])
    config = dict(num_pages=512, decode_graphs="on", decode_graph_max_batch=32)
    serial = RolloutEngine(cuda_model, RolloutConfig(**config, overlap="off"))
    overlapped = RolloutEngine(cuda_model, RolloutConfig(**config))   # auto: on for strict CUDA graphs
    assert overlapped.overlap and not serial.overlap
    want = run_workload(serial, requests)
    assert_same(run_workload(overlapped, requests), want, f"{name}: overlap on vs off")
    if name != "two_logprob_temperatures":   # two logprob temperatures in flight: serial steps only
        assert overlapped.counters["overlapped_steps"] > 0


def test_overlap_under_preemption_and_with_the_trainer(cuda_model):
    sampling = SamplingParams(n=3, max_new_tokens=20, seed=8, stop_token_ids=STOPS)
    requests = [(0, i, sampling) for i in range(len(PROMPTS))]
    small = pages_for(max(len(p) for p in PROMPTS) + 21, 4) + 1
    config = dict(page_size=4, num_pages=small, max_num_seqs=8, decode_graphs="on", decode_graph_max_batch=16)
    want = run_workload(RolloutEngine(cuda_model, RolloutConfig(**config, overlap="off")), requests)
    engine = RolloutEngine(cuda_model, RolloutConfig(**config, overlap="on"))
    got = run_workload(engine, requests)
    assert_same(got, want, "small KV cache: overlap on vs off")
    assert engine.scheduler.num_preemptions > 0 and engine.counters["overlapped_steps"] > 0
    assert_matches_trainer(cuda_model, [got[k] for k in sorted(got)], 1.0)


def test_overlap_records_the_same_routing():
    from tests.rollout.test_engine_routing import MOE, assert_routing_is_the_forwards
    model = tiny_model("qwen3_moe", seed=4, init_std=0.2, dtype="bfloat16", device="cuda", **MOE)
    sampling = SamplingParams(n=3, max_new_tokens=12, seed=2, stop_token_ids=STOPS)
    requests = [(0, i, sampling) for i in range(len(PROMPTS))]
    config = dict(num_pages=512, decode_graphs="on", decode_graph_max_batch=48, record_routing=True)
    want = run_workload(RolloutEngine(model, RolloutConfig(**config, overlap="off")), requests)
    engine = RolloutEngine(model, RolloutConfig(**config, overlap="on"))
    got = run_workload(engine, requests)
    assert_same(got, want, "MoE routing: overlap on vs off")
    assert engine.counters["overlapped_steps"] > 0
    assert_routing_is_the_forwards(model, list(got.values()))


def test_a_nan_raises_from_the_graph_sampled_verdicts(cuda_model):
    model = tiny_model("qwen3", seed=6, init_std=0.1, dtype="bfloat16", device="cuda")
    engine = RolloutEngine(model, RolloutConfig(num_pages=256, decode_graphs="on", decode_graph_max_batch=16))
    for i, p in enumerate(make_prompts(4, count=4)):
        engine.add_request(p, SamplingParams(n=2, max_new_tokens=30, seed=i, ignore_eos=True), prompt_index=i)
    for _ in range(10):
        engine.step()
    assert engine.counters["overlapped_steps"] > 0 and engine._inflight is not None
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ContractError, match="NaN"):
        for _ in range(2):   # the step in flight was queued before the NaN
            engine.step()
    engine.abort_all()
    assert engine._inflight is None and engine.stats()["free_pages"] == engine.stats()["num_pages"]
