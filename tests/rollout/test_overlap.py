"""Overlapped scheduling (RolloutConfig.overlap) changes no token, logprob, finish reason or routing record.

On the CPU ``decode_graphs="padded"`` runs the decode graphs' body eagerly -- the forward and the sampler in
its static form -- and ``overlap="on"`` runs the same launch / continuation / one-step-late page release
state machine as on a GPU (the host is the device, so it overlaps nothing in time). Workloads are chosen by
hypothesis: stop tokens, mixes of max_new_tokens, samples per prompt (forks with shared prefixes),
requests with different sampling settings in flight together (one or several logprob temperatures, top-k /
top-p), prefix caching, KV caches small enough to preempt, requests arriving while others run. Every
completion with overlap on must equal the one with overlap off bit for bit, and the plain engine's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from rlalign.contract.errors import ContractError
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.rollout.block_manager import pages_for
from rlalign.rollout.errors import RolloutConfigError
from tests.bitwise import assert_bitwise_equal
from tests.rollout.test_engine_bitwise import STOPS, make_prompts

PROMPTS = make_prompts(21, count=6)
LONGEST_NEW = 12
SETTINGS = {   # (temperature, top_k, top_p): t1 and greedy score at 1.0; t07 at 0.7
    "t1": (1.0, 0, 1.0), "t1_topk_topp": (1.0, 20, 0.9), "greedy": (0.0, 0, 1.0), "greedy_topk": (0.0, 5, 1.0),
    "t07": (0.7, 0, 1.0),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=3, init_std=0.1)


def run_workload(engine: RolloutEngine, requests: list[tuple[int, int, SamplingParams]]) -> dict:
    """Drive ``engine`` step by step; request (arrival call, prompt index, sampling) is added before that
    step() call. Returns {(prompt index, sample index): Completion}."""
    pending, done, call = sorted(requests, key=lambda r: r[0]), {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= call:
            _, index, sampling = pending.pop(0)
            engine.add_request(PROMPTS[index], sampling, prompt_index=index)
        for out in engine.step():
            if out.completion is not None:
                done[(out.prompt_index, out.sample_index)] = out.completion
        call += 1
    assert engine._inflight is None, "a step is still in flight with nothing unfinished"
    stats = engine.stats()
    assert stats["free_pages"] == stats["num_pages"], "pages leaked"
    return done


def assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, w in want.items():
        g = got[key]
        where = f"{what}: prompt {key[0]} sample {key[1]}"
        assert g.tokens == w.tokens, f"{where}: tokens {g.tokens} vs {w.tokens}"
        assert_bitwise_equal(torch.tensor(g.logprobs, dtype=torch.float32),
                             torch.tensor(w.logprobs, dtype=torch.float32), f"{where}: logprobs")
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason), where
        if w.routing is None:
            assert g.routing is None, where
        else:
            assert_bitwise_equal(g.routing, w.routing, f"{where}: routing")


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([1, 3, 8, 16]))
    longest = max(len(p) for p in PROMPTS) + LONGEST_NEW + 1
    minimal = pages_for(longest, page_size) + 1   # one sequence + the one-step-late page of a finished one
    config = dict(page_size=page_size, max_num_seqs=draw(st.integers(1, 12)),
                  max_num_batched_tokens=draw(st.sampled_from([13, 64, 512])),
                  max_prefill_chunk=draw(st.sampled_from([None, 3, 8])), share_prefix=draw(st.booleans()),
                  enable_prefix_caching=draw(st.booleans()),
                  num_pages=draw(st.sampled_from([minimal, minimal + 3, 10 * minimal])),
                  decode_graph_max_batch=draw(st.sampled_from([3, 8, 64])))
    mixed = draw(st.booleans())   # several settings in flight together, or one for all
    shared = draw(st.sampled_from(sorted(SETTINGS)))
    indices = draw(st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=len(PROMPTS), unique=True))
    requests = []
    for index in indices:
        t, k, p = SETTINGS[draw(st.sampled_from(sorted(SETTINGS))) if mixed else shared]
        sampling = SamplingParams(n=draw(st.integers(1, 3)), temperature=t, top_k=k, top_p=p, seed=7,
                                  max_new_tokens=draw(st.integers(1, LONGEST_NEW)),
                                  stop_token_ids=STOPS if draw(st.booleans()) else ())
        requests.append((draw(st.integers(0, 6)), index, sampling))
    return config, requests


def engines(model, config: dict, **extra) -> tuple[RolloutEngine, RolloutEngine, RolloutEngine]:
    """(plain eager engine, padded graphs serial, padded graphs overlapped) of one configuration."""
    plain = RolloutEngine(model, RolloutConfig(**config, decode_graphs="off", **extra))
    serial = RolloutEngine(model, RolloutConfig(**config, decode_graphs="padded", overlap="off", **extra))
    overlapped = RolloutEngine(model, RolloutConfig(**config, decode_graphs="padded", overlap="on", **extra))
    return plain, serial, overlapped


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_overlap_changes_no_bit(model, workload):
    config, requests = workload
    plain, serial, overlapped = engines(model, config)
    want = run_workload(serial, requests)
    assert_same(run_workload(overlapped, requests), want, "overlap on vs off")
    assert_same(run_workload(plain, requests), want, "padded graphs vs plain engine")


def test_overlap_runs_continuations_and_drains_for_preemption(model):
    """The state machine is exercised, not bypassed: continuations run (and some of their rows belong to
    sequences that ended a step earlier), and a cache of one sequence's pages forces drains + preemption."""
    sampling = SamplingParams(n=3, max_new_tokens=LONGEST_NEW, seed=3, stop_token_ids=STOPS)
    requests = [(0, i, sampling) for i in range(len(PROMPTS))] + [(4, 0, SamplingParams(n=2, seed=9))]
    requests[-1] = (4, 5, SamplingParams(n=2, max_new_tokens=5, seed=9))
    requests = requests[:5] + [requests[-1]]
    config = dict(page_size=4, num_pages=pages_for(max(len(p) for p in PROMPTS) + LONGEST_NEW + 1, 4) + 1,
                  max_num_seqs=8)
    _, serial, overlapped = engines(model, config)
    want = run_workload(serial, requests)
    assert_same(run_workload(overlapped, requests), want, "small cache")
    assert overlapped.scheduler.num_preemptions > 0
    assert overlapped.counters["overlapped_steps"] > 0 and serial.counters["overlapped_steps"] == 0

    roomy = dict(config, num_pages=512)
    _, serial, overlapped = engines(model, roomy)
    want = run_workload(serial, requests)
    assert_same(run_workload(overlapped, requests), want, "roomy cache")
    # most decode steps overlap once every request is admitted
    assert overlapped.counters["overlapped_steps"] > overlapped.counters["steps"] // 3


def test_abort_while_a_step_is_in_flight(model):
    """An aborted request's rows in the step in flight are dropped and its pages freed once that step has
    run; the other requests' completions do not change."""
    sampling = SamplingParams(n=2, max_new_tokens=LONGEST_NEW, seed=1, ignore_eos=True)
    results = []
    for overlap in ("off", "on"):
        engine = RolloutEngine(model, RolloutConfig(num_pages=256, page_size=4, decode_graphs="padded",
                                                    overlap=overlap))
        for i in range(3):
            engine.add_request(PROMPTS[i], sampling, request_id=f"r{i}", prompt_index=i)
        done = {}
        for call in range(40):
            if call == 4:
                if overlap == "on":
                    assert engine._inflight is not None
                for out in engine.abort("r1"):
                    done[(out.prompt_index, out.sample_index)] = out.completion
            if not engine.has_unfinished():
                break
            for out in engine.step():
                if out.completion is not None:
                    done[(out.prompt_index, out.sample_index)] = out.completion
        assert engine._inflight is None and engine.stats()["free_pages"] == engine.stats()["num_pages"]
        results.append(done)
    assert_same(results[1], results[0], "abort mid-run")
    assert {c.finish_reason for k, c in results[1].items() if k[0] == 1} == {"abort"}


def test_overlap_records_the_same_routing():
    from tests.rollout.test_engine_routing import MOE
    moe = tiny_model("qwen3_moe", seed=4, init_std=0.2, **MOE)
    sampling = SamplingParams(n=2, max_new_tokens=8, seed=2, stop_token_ids=STOPS)
    requests = [(0, 0, sampling), (0, 1, sampling), (3, 2, sampling)]
    config = dict(page_size=4, num_pages=pages_for(max(len(p) for p in PROMPTS) + 9, 4) + 2, max_prefill_chunk=5)
    plain, serial, overlapped = engines(moe, config, record_routing=True)
    want = run_workload(plain, requests)
    assert_same(run_workload(serial, requests), want, "padded vs plain (routing)")
    assert_same(run_workload(overlapped, requests), want, "overlap vs plain (routing)")
    assert overlapped.counters["overlapped_steps"] > 0


def test_overlap_setting_is_checked(model):
    with pytest.raises(RolloutConfigError, match="overlap must be one of"):
        RolloutConfig(overlap="yes")
    with pytest.raises(RolloutConfigError, match="overlap='on' needs decode steps sampled inside"):
        RolloutEngine(model, RolloutConfig(num_pages=16, overlap="on"))   # CPU, no graphs
    # the native profile samples inside its graphs too (tests/rollout/test_native_machinery.py)
    assert RolloutEngine(model, RolloutConfig(num_pages=16, profile="native", decode_graphs="padded",
                                              overlap="on")).overlap
    # auto: only for CUDA graphs (padded steps on the CPU run serially unless asked)
    assert not RolloutEngine(model, RolloutConfig(num_pages=16, decode_graphs="padded")).overlap


def test_a_failed_step_leaks_nothing_and_the_engine_recovers():
    """A NaN in the weights mid-run raises (CPU: the static sampler's verdict or the forward's check) with a
    step in flight; abort_all() then leaves no page held and no step in flight, and the engine runs again."""
    model = tiny_model("qwen3", seed=3, init_std=0.1)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    engine = RolloutEngine(model, RolloutConfig(num_pages=64, page_size=4, decode_graphs="padded", overlap="on"))
    sampling = SamplingParams(n=2, max_new_tokens=LONGEST_NEW, seed=1, stop_token_ids=STOPS)
    for i in range(3):
        engine.add_request(PROMPTS[i], sampling, prompt_index=i)
    while engine.counters["overlapped_steps"] < 2:
        engine.step()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ContractError, match="NaN"):
        for _ in range(2):
            engine.step()
    engine.abort_all()
    assert engine._inflight is None and not engine.has_unfinished()
    assert engine.stats()["free_pages"] == engine.stats()["num_pages"]
    engine.update_weights(good)
    requests = [(0, i, sampling) for i in range(3)]
    reference = RolloutEngine(tiny_model("qwen3", seed=3, init_std=0.1), RolloutConfig(num_pages=64))
    assert_same(run_workload(engine, requests), run_workload(reference, requests), "after recovery")


def test_overlap_while_requests_wait_for_a_seat_and_through_generate(model):
    """With every seat taken (max_num_seqs) schedule() admits nothing, so decode steps still overlap while
    requests wait; generate() (which asks only for finished outputs) gives the same completions."""
    sampling = SamplingParams(n=2, max_new_tokens=LONGEST_NEW, seed=4, ignore_eos=True)
    config = dict(page_size=4, num_pages=256, max_num_seqs=4)
    _, serial, overlapped = engines(model, config)
    want = serial.generate(PROMPTS, sampling)
    got = overlapped.generate(PROMPTS, sampling)
    assert_same({(c.prompt_index, c.sample_index): c for c in got},
                {(c.prompt_index, c.sample_index): c for c in want}, "generate(), seats full")
    assert overlapped._inflight is None and overlapped.stats()["free_pages"] == overlapped.stats()["num_pages"]
    # 6 prompts x 2 samples through 4 seats: most decode steps run while others wait, and overlap
    assert overlapped.counters["overlapped_steps"] > overlapped.counters["steps"] // 2
