"""bench/grpo_lr_proxy.py: the prompt-blind first-token values and a two-step run on a toy checkpoint."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


proxy = _load("grpo_lr_proxy", REPO / "bench" / "grpo_lr_proxy.py")
kit = _load("make_qwen3_8b", REPO / "scripts" / "make_qwen3_8b.py")


def test_first_token_values():
    texts = proxy.token_texts(400)
    assert texts[2] == "" and texts[3] == "0" and texts[15] == "10" and texts[399] == "394"
    values = proxy.first_token_values(400, ["357"])
    assert values[2] == 0.0                                     # <eos>: the empty completion
    assert values[texts.index("357")] == pytest.approx(0.9)     # the answer, then more digits: -0.1
    assert values[texts.index("35")] == pytest.approx(2 / 3 + 0.1 / 3 - 0.1)   # the third place by chance


def test_two_steps_write_one_record_each(tmp_path, capsys):
    assert kit.main([str(tmp_path / "m"), "--test-body", "--layers", "1", "--vocab", "600", "--device", "cpu"]) == 0
    out = tmp_path / "proxy.jsonl"
    assert proxy.main([str(tmp_path / "m"), "--lr", "1e-3", "--steps", "2", "--new", "3", "--prompts", "2",
                       "--samples", "4", "--reward", "match_then_stop", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[0]["lr"] == pytest.approx(1e-4)
    assert all(-1.0 <= r["reward"] <= 1.0 and 0 < r["mean_len"] <= 3 for r in records)
    # step 1's tokens with positive advantage gained log-prob, those with negative advantage lost it
    assert records[0]["gain_pos"] > 0 > records[0]["gain_neg"]
