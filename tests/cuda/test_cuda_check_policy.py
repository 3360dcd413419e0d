"""The boundary check policy on the GPU (the default there): a NaN/inf planted in any weight, in the KV
cache or in a prompt's embedding row stops a strict rollout, with and without decode graphs -- the
propagation argument of docs/gpu.md ("Finiteness checks") run through the Triton kernels, whose
max() ignores NaN and whose softmax drops -inf scores. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from rlalign import ops
from rlalign.contract.errors import ContractError
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tests.ops.test_check_policy import PLANTABLE
from tests.rollout.test_engine_bitwise import make_prompts

pytestmark = pytest.mark.cuda


def _model():
    return tiny_model("qwen3", seed=4, init_std=0.1, dtype="bfloat16", device="cuda")


def _generate(model, graphs: str):
    engine = RolloutEngine(model, RolloutConfig(num_pages=128, decode_graphs=graphs, decode_graph_max_batch=16))
    return engine.generate(make_prompts(1, count=3), SamplingParams(n=2, max_new_tokens=6, seed=3))


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_a_clean_model_runs_under_the_boundary_policy(graphs):
    with ops.use_check_policy("boundary"):
        assert len(_generate(_model(), graphs)) == 6


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", PLANTABLE)
def test_a_value_planted_in_any_weight_stops_eager_and_replayed_steps(name, value):
    for layer in (0, 1):
        model = _model()
        param = dict(model.named_parameters())[name.format(i=layer)]
        with torch.no_grad():
            param.view(-1)[param.numel() // 3] = value
        with ops.use_check_policy("boundary"), pytest.raises(ContractError, match="NaN or inf"):
            _generate(model, "off")
    # the same value appearing between two replayed decode steps
    model = _model()
    engine = RolloutEngine(model, RolloutConfig(num_pages=128, decode_graphs="on", decode_graph_max_batch=16))
    for i, p in enumerate(make_prompts(1, count=3)):
        engine.add_request(p, SamplingParams(n=2, max_new_tokens=12, seed=3), prompt_index=i)
    with ops.use_check_policy("boundary"):
        while engine.counters["graph_steps"] == 0:
            engine.step()
        param = dict(model.named_parameters())[name.format(i=1)]
        with torch.no_grad():
            param.view(-1)[param.numel() // 2] = value
        # with overlapped scheduling (auto on CUDA) a step queued before the value completes cleanly first
        with pytest.raises(ContractError, match="NaN or inf"):
            for _ in range(2):
                engine.step()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("which", ["k", "v"])
def test_a_value_planted_in_the_kv_cache_stops_the_next_decode_step(which, value):
    model = _model()
    engine = RolloutEngine(model, RolloutConfig(num_pages=64, decode_graphs="on", decode_graph_max_batch=16))
    engine.add_request(make_prompts(1, count=1)[0], SamplingParams(max_new_tokens=8))
    with ops.use_check_policy("boundary"):
        engine.step()
        cache = engine.kv_cache.k if which == "k" else engine.kv_cache.v
        cache[0][:, 0] = value     # every page's first slot, all heads and features: inside the context
        with pytest.raises(ContractError, match="NaN or inf"):
            engine.step()
