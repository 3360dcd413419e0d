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
