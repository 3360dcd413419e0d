"""GRPO on a Qwen3-MoE model (upcycled from the embedded default): zero train/rollout mismatches, bitwise resume."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlalign.configlib import load_config
from rlalign.train.config import TrainConfig
from rlalign.train.loop import run_training
from rlalign.train.run.metrics import read_metrics
from tests.train.conftest import tiny_overrides

SCRIPT_ARGS = ["--experts", "4", "--top-k", "2"]


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "model"
    script = Path(__file__).resolve().parents[2] / "scripts" / "make_moe_model.py"
    done = subprocess.run([sys.executable, str(script), str(out), *SCRIPT_ARGS], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Qwen3-MoE, 4 layers x 4 experts (top-2)" in done.stdout
    return out


def test_grpo_on_moe_has_zero_mismatches_and_learns_from_the_dense_skills(moe_model_dir, tmp_path):
    cfg = load_config(TrainConfig, None, tiny_overrides(moe_model_dir, tmp_path / "run", steps=2) + ["optim.lr=1e-4"])
    records = read_metrics(run_training(cfg))
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["mismatch/count"] == 0 and r["mismatch/tokens"] > 0 for r in steps)
    # upcycled from the default model: it already adds (the default model's step-0 accuracy is ~0.18)
    assert records[0]["eval/accuracy"] > 0.05


def test_router_aux_loss_changes_the_update_and_is_refused_on_dense_models(moe_model_dir, arithmetic_model_dir,
                                                                             tmp_path):
    def run(name, *extra):
        cfg = load_config(TrainConfig, None, tiny_overrides(moe_model_dir, tmp_path / name, steps=1) + list(extra))
        return [r for r in read_metrics(run_training(cfg)) if "reward/mean" in r][0]

    plain, with_aux = run("plain"), run("aux", "algo.router_aux_coef=0.5")
    assert plain["mismatch/count"] == 0 and with_aux["mismatch/count"] == 0
    assert 0.0 < plain["moe/load_entropy"] <= 1.0 and plain["moe/aux_loss"] > 0
    assert plain["grad_norm"] != with_aux["grad_norm"]        # the aux term reaches the gradient
    assert plain["moe/aux_loss"] == with_aux["moe/aux_loss"]  # same forward before the update
    dense = load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / "dense", steps=1)
                        + ["algo.router_aux_coef=0.1"])
    with pytest.raises(Exception, match="no mixture-of-experts layers"):
        run_training(dense)


def test_async_steps_on_moe_verify_log_probs_and_routing_under_the_sampling_version(moe_model_dir, tmp_path):
    """rollout.async_steps=1 on an MoE policy: the step's agreement check compares the routing of the samples the
    current weights drew only (none once every sample is stale), and run.verify_behaviour recomputes every sample
    under the version that drew it -- log-probs and experts, 0 differ -- and names a single changed expert."""
    import torch

    from rlalign.train import sources
    from rlalign.train.agreement import MismatchError
    from rlalign.train.loop import Trainer

    extra = ["optim.lr=1e-3", "rollout.async_steps=1", "run.verify_behaviour=true", "run.on_mismatch=stop",
             "run.save_checkpoints=false"]
    records = read_metrics(run_training(load_config(TrainConfig, None,
                                                    tiny_overrides(moe_model_dir, tmp_path / "run", steps=3) + extra)))
    steps = [r for r in records if "reward/mean" in r]
    assert [r["offpolicy/behaviour_version"] for r in steps] == [0, 0, 1]
    assert steps[0]["moe/routing_tokens"] > 0 and [r["moe/routing_tokens"] for r in steps[1:]] == [0, 0]
    for r in steps:
        assert r["verify/behaviour_mismatch"] == 0 and r["verify/routing_mismatch"] == 0
        assert r["verify/routing_tokens"] > 0 and r["moe/routing_mismatch"] == 0

    trainer = Trainer(load_config(TrainConfig, None, tiny_overrides(moe_model_dir, tmp_path / "flip", steps=3) + extra))
    trainer.resume_if_asked()
    try:
        trainer.train_step(1)
        trainer.step = 1
        trainer.source._wait_all()   # step 2's samples, drawn by version 0: one expert of one row changed
        samples, stats, t = trainer.source._ready[2]
        routing = samples.routing.clone()
        row = routing[3, 0]
        routing[3, 0, 0] = next(e for e in range(4) if e not in row.tolist())
        trainer.source._ready[2] = (samples.__class__(**{**sources.samples_state(samples), "routing": routing}),
                                      stats, t)
        with pytest.raises(MismatchError, match="step 2: 1 of \\d+ \\(token, sparse layer\\) routing choices differ "
                                                "from a trainer forward under the weights version that sampled them "
                                                "\\(first: version 0, row 3, sparse layer 0\\)"):
            trainer.train_step(2)
    finally:
        trainer.close()
        trainer.run_lock.release()
