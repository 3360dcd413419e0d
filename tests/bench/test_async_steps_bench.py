"""benchmarks/async_steps.py: a tiny synchronous and one-step-ahead pair of runs through ``--config`` / ``--set``
reports every setting, the device peak, and the runs' log-prob agreement (0 mismatches)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "async_steps.py"
_spec = importlib.util.spec_from_file_location("bench_async_steps", _PATH)
async_steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(async_steps)


def test_two_settings_from_a_config_with_overrides(tmp_path, monkeypatch, capsys):
    config = tmp_path / "small.yaml"
    config.write_text("rollout:\n  prompts_per_step: 2\n  samples_per_prompt: 2\n  max_new_tokens: 4\n")
    monkeypatch.setattr(sys, "argv", ["async_steps.py", "--config", str(config), "--set", "run.seed=3",
                                      "--steps", "2", "--repeats", "1", "--async", "0", "1", "--json",
                                      "--out", str(tmp_path / "r.json")])
    assert async_steps.main() == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "r.json").read_text()) == result
    assert set(result) == {"async_steps=0", "async_steps=1"}
    for row in result.values():
        assert row["steps_timed"] == 1 and row["median_step_s"] > 0 and row["mismatches"] == 0
        assert row["peak_device_mb"] >= 0 and row["peak_rss_mb"] > 0
    assert result["async_steps=0"]["engine_weight_copy_mb"] == 0.0
    assert result["async_steps=1"]["engine_weight_copy_mb"] > 0.0
