"""Routing agreement between the rollout engine and the trainer on an MoE policy (``moe/routing_*``).

Strict: 0 of N (token, sparse layer) pairs differ, N = every row both sides computed, whether the first
update pass supplies the trainer's routing (no re-score) or a re-score forward does (mini_batches > 1). A
planted disagreement (one expert id of one recorded row swapped for an unchosen expert) is counted and,
with run.on_mismatch=stop, stops the step naming the step, the count and the first sample / position /
layer; native only reports it. Dense policies and rollout.record_routing=false log no routing metric.
"""

from __future__ import annotations

import pytest

from rlalign.configlib import load_config
from rlalign.models import architectures
from rlalign.models.checkpoint import save_model
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.rollout.engine import RolloutEngine
from rlalign.train.config import TrainConfig
from rlalign.train.loop import MismatchError, Trainer, run_training
from rlalign.train.pretrain import PretrainConfig, hf_config, write_char_tokenizer
from rlalign.train.run.metrics import read_metrics
from tests.bitwise import assert_bitwise_equal
from tests.train.conftest import DENSE_REWARD, tiny_overrides

EXPERTS, TOP_K, SAMPLES = 4, 2, 4
PLANT_ROW, PLANT_LAYER = 2, 1


@pytest.fixture(scope="module")
def moe_arith_dir(tmp_path_factory):
    """The tiny arithmetic model's shapes as a Qwen3-MoE (every layer sparse, 4 experts, top-2), random init."""
    path = tmp_path_factory.mktemp("moe_arith") / "model"
    cfg = PretrainConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
    hf = dict(hf_config(cfg), model_type="qwen3_moe", architectures=[architectures.get("qwen3_moe").architecture],
              num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32, norm_topk_prob=True)
    save_model(CausalLM(ModelConfig.from_hf_dict(hf)).init_random_(seed=0, std=0.1), path)
    write_char_tokenizer(path)
    return path


@pytest.fixture
def rollouts(monkeypatch):
    """Every training rollout's completions (n = samples_per_prompt; evals use other n), and a switch that
    plants one disagreement in the first completion of each: ``plant["on"] = True``."""
    seen, plant, generate = [], {"on": False}, RolloutEngine.generate

    def recording(self, prompts, sampling=None, **kw):
        out = generate(self, prompts, sampling, **kw)
        if sampling is not None and sampling.n == SAMPLES:
            seen.append(out)
            if plant["on"]:
                ids = out[0].routing[PLANT_ROW, PLANT_LAYER]
                ids[0] = next(e for e in range(EXPERTS) if e not in set(ids.tolist()))
        return out

    monkeypatch.setattr(RolloutEngine, "generate", recording)
    return seen, plant


def train(model_dir, run_dir, *extra, steps=1):
    cfg = load_config(TrainConfig, None, tiny_overrides(model_dir, run_dir, steps=steps) + list(extra))
    return [r for r in read_metrics(run_training(cfg)) if "reward/mean" in r]


def compared_pairs(completions) -> int:
    return 2 * sum(len(c.prompt_tokens) + len(c.tokens) - 1 for c in completions)   # 2 sparse layers


@pytest.mark.parametrize("extra", [[], ["algo.mini_batches=2"]], ids=["first-pass", "rescore"])
def test_strict_routing_agrees_on_every_row_both_sides_computed(moe_arith_dir, tmp_path, rollouts, extra):
    seen, _ = rollouts
    records = train(moe_arith_dir, tmp_path / "run", *extra, steps=2)
    assert len(records) == len(seen) == 2
    for record, completions in zip(records, seen):
        assert record["moe/routing_mismatch"] == 0 and record["moe/routing_mismatch_frac"] == 0.0
        assert record["moe/routing_tokens"] == compared_pairs(completions) > 0
        assert record["mismatch/count"] == 0


@pytest.mark.parametrize("extra", [[], ["algo.mini_batches=2"]], ids=["first-pass", "rescore"])
def test_a_planted_disagreement_stops_a_strict_step(moe_arith_dir, tmp_path, rollouts, extra):
    _, plant = rollouts
    plant["on"] = True
    with pytest.raises(MismatchError) as err:
        train(moe_arith_dir, tmp_path / "run", "run.on_mismatch=stop", *extra)
    message = str(err.value)
    assert message.startswith("step 1: 1 of ") and "routing choices differ" in message
    assert f"first at sample 0 token position {PLANT_ROW}, layer {PLANT_LAYER}" in message
    assert "\n" not in message


def test_a_strict_routing_mismatch_stops_before_any_optimizer_step(moe_arith_dir, tmp_path, rollouts):
    _, plant = rollouts
    plant["on"] = True
    trainer = Trainer(load_config(TrainConfig, None, tiny_overrides(moe_arith_dir, tmp_path / "run", 1)
                                  + ["run.on_mismatch=stop"]))
    trainer.resume_if_asked()
    assert not trainer.needs_rescore()   # the first update pass supplies the trainer's routing
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    with pytest.raises(MismatchError, match="routing choices differ"):
        trainer.train_step(1)
    assert not trainer.update.optimizer.state   # AdamW never stepped
    for name, value in trainer.policy.state_dict().items():
        assert_bitwise_equal(value, before[name], name)


def test_dynamic_sampling_keeps_each_samples_record(moe_arith_dir, tmp_path, rollouts):
    (record,) = train(moe_arith_dir, tmp_path / "run", "algo.dynamic_sampling=true", "algo.max_draw_rounds=3",
                      "task.reward=" + DENSE_REWARD)
    assert record["dynamic_sampling/drawn_groups"] > record["dynamic_sampling/kept_groups"] > 0   # select + add ran
    assert record["moe/routing_mismatch"] == 0 and record["moe/routing_tokens"] > 0


def test_a_planted_disagreement_is_counted_under_warn(moe_arith_dir, tmp_path, rollouts):
    seen, plant = rollouts
    plant["on"] = True
    (record,) = train(moe_arith_dir, tmp_path / "run", "run.on_mismatch=warn")
    assert record["moe/routing_mismatch"] == 1 and record["moe/routing_tokens"] == compared_pairs(seen[0])
    assert record["moe/routing_mismatch_frac"] == 1 / record["moe/routing_tokens"]


def test_native_reports_the_fraction_and_never_stops(moe_arith_dir, tmp_path, rollouts):
    seen, plant = rollouts
    plant["on"] = True
    (record,) = train(moe_arith_dir, tmp_path / "run", "run.profile=native", "run.on_mismatch=stop")
    assert record["moe/routing_tokens"] == compared_pairs(seen[0])
    assert 1 <= record["moe/routing_mismatch"] <= record["moe/routing_tokens"]
    assert record["moe/routing_mismatch_frac"] == record["moe/routing_mismatch"] / record["moe/routing_tokens"]


def test_no_routing_metric_without_a_record(moe_arith_dir, arithmetic_model_dir, tmp_path, rollouts):
    seen, _ = rollouts
    (off,) = train(moe_arith_dir, tmp_path / "off", "rollout.record_routing=false")
    (dense,) = train(arithmetic_model_dir, tmp_path / "dense")
    assert all(c.routing is None for completions in seen for c in completions)
    for record in (off, dense):
        assert not any(k.startswith("moe/routing") for k in record)
    assert "moe/load_entropy" in off and not any(k.startswith("moe/") for k in dense)


def test_data_parallel_ranks_compare_every_row(moe_arith_dir, tmp_path):
    """parallel.dp=2 (spawned gloo ranks): the re-score forward covers every sample on each rank."""
    (record,) = train(moe_arith_dir, tmp_path / "dp2", "parallel.dp=2")
    assert record["moe/routing_mismatch"] == 0 and record["moe/routing_tokens"] > 0 and record["mismatch/count"] == 0
