"""The engine's vectorised per-step host work: requests with different sampling settings, stop tokens and
length limits in flight together (the per-step code takes a shortcut when every request agrees and must
give the same completions when they do not). The slot table's own operations: tests/rollout/test_slots.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tests.bitwise import assert_bitwise_equal


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=5, init_std=0.1)


def _run(model, requests: dict) -> dict:
    """{prompt index: completions} of ``requests`` {prompt index: (prompt, SamplingParams)}, all in flight
    in one engine (the prompt index keys the seeds)."""
    engine = RolloutEngine(model, RolloutConfig(num_pages=96, page_size=4, max_model_len=40))
    ids = {engine.add_request(p, s, prompt_index=k): k for k, (p, s) in requests.items()}
    out: dict[int, list] = {k: [None] * s.n for k, (_, s) in requests.items()}
    while engine.has_unfinished():
        for step_out in engine.step():
            if step_out.completion is not None:
                out[ids[step_out.request_id]][step_out.sample_index] = step_out.completion
    return out


REQUEST = st.tuples(
    st.lists(st.integers(3, 300), min_size=1, max_size=20),
    st.builds(SamplingParams, n=st.integers(1, 3), temperature=st.sampled_from([0.0, 0.7, 1.0]),
              top_k=st.sampled_from([0, 5]), top_p=st.sampled_from([1.0, 0.9]), max_new_tokens=st.integers(1, 30),
              stop_token_ids=st.lists(st.integers(3, 300), max_size=40).map(tuple), ignore_eos=st.booleans(),
              seed=st.integers(0, 3)))


@settings(max_examples=12, deadline=None)
@given(st.lists(REQUEST, min_size=1, max_size=4))
def test_requests_with_different_settings_together_equal_each_alone(model, requests):
    together = _run(model, dict(enumerate(requests)))
    for k, request in enumerate(requests):
        alone = _run(model, {k: request})[k]
        for j, (g, w) in enumerate(zip(together[k], alone)):
            where = f"request {k} sample {j}"
            assert (g.tokens, g.finish_reason, g.stop_reason) == (w.tokens, w.finish_reason, w.stop_reason), where
            assert_bitwise_equal(torch.tensor(g.logprobs, dtype=torch.float32),
                                 torch.tensor(w.logprobs, dtype=torch.float32), where)
