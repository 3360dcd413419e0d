"""``algo.routing_replay`` (R3) on an MoE policy in the native profile: the trainer's forwards -- the old policy's and
the update's -- route every row the engine recorded by the engine's experts.

A planted disagreement (one expert of one recorded row swapped for an unchosen one) is what the trainer then uses:
``moe/routing_mismatch`` is 0 by construction, ``moe/routing_replayed`` counts every recorded (row, layer) pair and
``moe/routing_overridden`` at least the planted one; without replay the same plant is a mismatch. The settings it
cannot serve are refused in one line (strict/portable profile, vLLM, no record, dp/tp, Ray, async, episodes, a
model without Qwen3-MoE sparse layers).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign.configlib import ConfigError, load_config
from rlalign.contract.errors import RLAlignError
from rlalign.models import moe
from rlalign.rollout.engine import RolloutEngine
from rlalign.train.config import TrainConfig
from rlalign.train.loop import run_training
from rlalign.train.packing import TrainBatch
from rlalign.train.run.metrics import read_metrics
from rlalign.train.samples import StepSamples
from tests.train.conftest import tiny_overrides
from tests.train.test_moe_routing import EXPERTS, PLANT_LAYER, PLANT_ROW, SAMPLES, TOP_K, compared_pairs, moe_arith_dir  # noqa: F401

REPLAY = ["run.profile=native", "algo.routing_replay=true"]


@pytest.fixture
def planted(monkeypatch):
    """Every training rollout's completions, with one expert of the first completion's row PLANT_ROW in sparse layer
    PLANT_LAYER swapped for one the engine did not choose; and every call of the replayed routing as
    (grad enabled, rows, layer)."""
    seen, calls, generate, route = [], [], RolloutEngine.generate, moe.RoutingReplay.route

    def recording(self, prompts, sampling=None, **kw):
        out = generate(self, prompts, sampling, **kw)
        if sampling is not None and sampling.n == SAMPLES:
            seen.append(out)
            ids = out[0].routing[PLANT_ROW, PLANT_LAYER]
            ids[0] = next(e for e in range(EXPERTS) if e not in set(ids.tolist()))
        return out

    def spied(self, logits, layer, top_k, normalize):
        calls.append((torch.is_grad_enabled(), logits.shape[0], layer))
        return route(self, logits, layer, top_k, normalize)

    monkeypatch.setattr(RolloutEngine, "generate", recording)
    monkeypatch.setattr(moe.RoutingReplay, "route", spied)
    return seen, calls


def train(model_dir, run_dir, *extra):
    cfg = load_config(TrainConfig, None, tiny_overrides(model_dir, run_dir, steps=1) + list(extra))
    (record,) = [r for r in read_metrics(run_training(cfg)) if "reward/mean" in r]
    return record


def test_replay_routes_the_old_policy_and_the_update_by_the_engines_record(moe_arith_dir, tmp_path, planted):
    seen, calls = planted
    record = train(moe_arith_dir, tmp_path / "replay", *REPLAY, "run.on_mismatch=stop")
    pairs = compared_pairs(seen[0])
    assert record["moe/routing_tokens"] == record["moe/routing_replayed"] == pairs > 0
    assert record["moe/routing_mismatch"] == 0 and record["moe/routing_mismatch_frac"] == 0.0
    assert 1 <= record["moe/routing_overridden"] <= pairs   # the planted expert at least
    assert record["moe/routing_overridden_frac"] == record["moe/routing_overridden"] / pairs
    assert math.isfinite(record["loss/policy"]) and record["grad_norm"] > 0
    rows = sum(len(c.prompt_tokens) + len(c.tokens) for c in seen[0])
    for grad in (False, True):   # the old policy's no-grad forward and the update's forward: every row, every layer
        for layer in (0, 1):
            assert sum(n for g, n, i in calls if g == grad and i == layer) == rows, (grad, layer)

    calls.clear()
    plain = train(moe_arith_dir, tmp_path / "plain", "run.profile=native")
    assert plain["moe/routing_mismatch"] >= 1 and "moe/routing_replayed" not in plain and not calls


@pytest.mark.parametrize("extra, refusal", [
    (["algo.routing_replay=true"], "needs run.profile=native: in the strict profile"),
    (["algo.routing_replay=true", "run.profile=portable"], "needs run.profile=native: in the portable profile"),
    (REPLAY + ["rollout.record_routing=false"], "with rollout.record_routing=false"),
    (REPLAY + ["parallel.dp=2"], "with parallel.dp / parallel.tp is not supported yet"),
    (REPLAY + ["rollout.async_steps=1"], "with rollout.async_steps > 0 is not supported yet"),
    (REPLAY + ["launcher=ray"], "with launcher=ray is not supported yet"),
], ids=["strict", "portable", "no-record", "dp", "async", "ray"])
def test_what_replay_cannot_serve_is_refused_in_one_line(tmp_path, extra, refusal):
    with pytest.raises(ConfigError, match=refusal) as err:
        load_config(TrainConfig, None, [f"run.dir={tmp_path}"] + extra)
    assert "\n" not in str(err.value) and str(err.value).startswith("algo.routing_replay=true")


def test_a_model_without_qwen3_moe_sparse_layers_is_refused(arithmetic_model_dir, tmp_path):
    cfg = load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / "dense", steps=1) + REPLAY)
    with pytest.raises(Exception, match="algo.routing_replay=true replays .* FFN kind is 'dense'"):
        run_training(cfg)


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=5),
       max_tokens=st.integers(1, 12), mini_batches=st.integers(1, 3))
def test_each_micro_batch_carries_the_record_of_its_rows(shapes, max_tokens, mini_batches):
    """TrainBatch(replay_routing=True): in every micro-batch, row j of sample i is replayed iff j < routing_rows[i]
    (every token the engine fed: the prompt and the completion but its last token; a completion of one token
    replays its prompt only), with the record's experts of that row."""
    n, layers = len(shapes), 2
    prompt_lens = torch.tensor([p for p, _ in shapes])
    completion_lens = torch.tensor([c for _, c in shapes])
    rows = prompt_lens + completion_lens - 1
    routing = torch.arange(int(rows.sum()) * layers * TOP_K, dtype=torch.int64).reshape(-1, layers, TOP_K)
    samples = StepSamples(tokens=torch.arange(int((prompt_lens + completion_lens).sum())), prompt_lens=prompt_lens,
                          completion_lens=completion_lens, logprobs=torch.zeros(int(completion_lens.sum())),
                          truncated=torch.zeros(n, dtype=torch.bool), prompt_index=torch.arange(n),
                          routing=routing.to(torch.int16), routing_rows=rows)
    batch = TrainBatch.build(samples, max_tokens=max_tokens, mini_batches=mini_batches, replay_routing=True)
    record = iter(routing.split(rows.tolist()))
    for mb in batch.micro_batches:
        experts, replayed = mb.replay
        offset = 0
        for i in mb.samples:
            length = int(prompt_lens[i] + completion_lens[i])
            want = torch.arange(length) < rows[i]
            assert torch.equal(replayed[offset:offset + length], want)
            assert torch.equal(experts[offset:offset + int(rows[i])], next(record))
            offset += length
        assert offset == experts.shape[0] == mb.forward.input_ids.shape[0]
    assert TrainBatch.build(samples, max_tokens=max_tokens).micro_batches[0].replay is None


def test_replay_without_a_record_is_one_line():
    samples = StepSamples(tokens=torch.arange(3), prompt_lens=torch.tensor([2]), completion_lens=torch.tensor([1]),
                          logprobs=torch.zeros(1), truncated=torch.zeros(1, dtype=torch.bool),
                          prompt_index=torch.arange(1), routing=None, routing_rows=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(RLAlignError, match="algo.routing_replay=true: the rollout engine recorded no expert choices"):
        TrainBatch.build(samples, max_tokens=8, replay_routing=True)
