"""A run whose memory budget (rlalign.train.budget, every row live at once) exceeds the GPU's total or the host's
physical memory is refused in one line before any weight is loaded, leaving no run directory behind;
``run.check_memory=false`` starts it anyway."""

from __future__ import annotations

import pytest

from rlalign.train import budget
from rlalign.train.loop import Trainer
from rlalign.train.run.config_file import resolve_train_config

GIB = 2**30


def _trainer(tmp_path, *overrides):
    cfg = resolve_train_config(None, [f"run.dir={tmp_path / 'run'}", "run.progress=false", *overrides])
    return Trainer(cfg, None)


def _close(trainer):
    trainer.close()
    trainer.run_lock.release()


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["host", "gpu"])   # nothing reaches a GPU: refused first
def test_over_the_machine_is_one_line_before_loading(tmp_path, monkeypatch, device):
    loaded = []
    monkeypatch.setattr("rlalign.train.loop.load_policy", lambda section: loaded.append(section) or 1 / 0)
    monkeypatch.setattr(budget, "host_capacity", lambda: 2 * GIB)
    monkeypatch.setattr(budget, "device_capacity", lambda cfg: 1 * GIB)
    # 2M tokens of the default model's activations: ~10 GiB, over either limit
    with pytest.raises(budget.BudgetError) as err:
        _trainer(tmp_path, f"model.device={device}", "optim.micro_batch_tokens=2000000")
    text = str(err.value)
    assert "\n" not in text and ("on the GPU" if device == "cuda" else "on the host") in text
    assert "run.check_memory=false" in text and not loaded
    assert not (tmp_path / "run").exists()   # the run directory this run created is gone again


def test_check_memory_false_starts_the_run_and_a_fitting_run_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(budget, "host_capacity", lambda: 2 * GIB)
    _close(_trainer(tmp_path / "a", "optim.micro_batch_tokens=2000000", "run.check_memory=false"))
    _close(_trainer(tmp_path / "b"))   # the default run fits 2 GiB


def test_the_refusal_compares_the_budgets_totals(tmp_path, monkeypatch):
    """The limit is exactly the budget's total: one byte less capacity refuses, the total itself passes."""
    cfg = resolve_train_config(None, [f"run.dir={tmp_path / 'run'}"])
    from rlalign.models.config import ModelConfig
    from rlalign.models.checkpoint import read_config_json
    from rlalign.train.setup import resolve_model_dir

    model_dir = resolve_model_dir(cfg.model.path)
    totals = budget.totals(budget.memory_budget(cfg, ModelConfig.from_hf_dict(read_config_json(model_dir)[1])))
    need = totals.get("host", 0) + totals["device"]   # a CPU run: its "device" is the host (disk is not counted)
    monkeypatch.setattr(budget, "host_capacity", lambda: need)
    budget.refuse_what_cannot_fit(cfg, model_dir)
    monkeypatch.setattr(budget, "host_capacity", lambda: need - 1)
    with pytest.raises(budget.BudgetError):
        budget.refuse_what_cannot_fit(cfg, model_dir)
