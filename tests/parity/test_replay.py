"""Rollout records: exact round trip, clear errors on bad files, replay in another process."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rlalign.models import load_model
from rlalign.parity.replay import RecordedSequence, ReplayError, RolloutRecord
from rlalign.parity.run import ParityOptions, run_parity
from rlalign.parity.sides import RLAlignRollout, RLAlignTrainer

REPO = Path(__file__).resolve().parents[2]


def _f32_bits(values):
    return [struct.pack("<f", v) for v in values]


def _record() -> RolloutRecord:
    tricky = [-0.0, 0.0, -1.401298464324817e-45, -87.33654022216797, float(struct.unpack("<f", b"\x01\x00\x80\xbf")[0])]
    return RolloutRecord([RecordedSequence(0, 0, [1, 2, 3], [4, 5, 6, 7, 8], tricky, seed=123, finish_reason="length"),
                          RecordedSequence(0, 1, [1, 2, 3], [9], [-3.5], seed=124, finish_reason="stop")],
                         "ab" * 32, {"n": 2, "temperature": 0.7, "logprob_temperature": 0.7, "seed": 0})


def test_round_trip_keeps_every_bit(tmp_path):
    rec = _record()
    back = RolloutRecord.load(rec.save(tmp_path / "r.jsonl"))
    for a, b in zip(rec.sequences, back.sequences):
        assert _f32_bits(a.logprobs) == _f32_bits(b.logprobs)
        assert (a.prompt_tokens, a.tokens, a.seed, a.finish_reason) == (b.prompt_tokens, b.tokens, b.seed,
                                                                         b.finish_reason)
    assert back.weights_hash == rec.weights_hash and back.logprob_temperature == 0.7
    line = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[1])
    assert line["positions"] == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("mutate, message", [
    (lambda lines: lines[:2], "header says 2 sequences but the file holds 1"),
    (lambda lines: [lines[0].replace('"version": 1', '"version": 9')] + lines[1:], "unsupported record version 9"),
    (lambda lines: lines[:1] + ["{not json"] + lines[2:], r"r.jsonl:2: invalid JSON"),
    (lambda lines: lines[:2] + [lines[2].replace('"logprobs": [-3.5]', '"logprobs": []')], r"r.jsonl:3: 1 tokens but 0"),
    (lambda lines: [lines[0].replace("rlalign-rollout", "other")] + lines[1:], "not an rlalign-rollout record"),
])
def test_bad_files_raise_clear_errors(tmp_path, mutate, message):
    path = _record().save(tmp_path / "r.jsonl")
    path.write_text("\n".join(mutate(path.read_text().splitlines())) + "\n")
    with pytest.raises(ReplayError, match=message):
        RolloutRecord.load(path)


def test_replay_in_another_process(checkpoints, tmp_path):
    """Record a rollout here; a fresh process scores it with the patched transformers model: zero mismatches."""
    model, _ = load_model(checkpoints["qwen2"])
    record = RLAlignRollout(model).generate([[5, 6, 7], [8, 9, 10, 11, 12]], n=2, max_new_tokens=6,
                                            temperature=0.8, seed=7)
    path = record.save(tmp_path / "rollout.jsonl")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "rlalign.cli.main", "parity", "--model", str(checkpoints["qwen2"]),
                           "--replay", str(path), "--train", "transformers", "--json"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == {"ok": True, "tokens_compared": record.num_tokens, "mismatches": 0, "max_abs_diff": 0.0,
                       "mean_abs_diff": 0.0, "first_divergence": None}


def test_replay_against_other_weights_is_not_comparable(checkpoints, tmp_path):
    model, _ = load_model(checkpoints["qwen3"])
    record = RLAlignRollout(model).generate([[5, 6, 7]], n=1, max_new_tokens=4)
    path = record.save(tmp_path / "rollout.jsonl")
    result = run_parity(ParityOptions(model=str(checkpoints["llama"]), replay=str(path)))
    assert not result.ok and "different weights" in result.tokens.not_comparable
    same = run_parity(ParityOptions(model=str(checkpoints["qwen3"]), replay=str(path)))
    assert same.ok and same.tokens.tokens_compared == 4


def test_trainer_micro_batches_do_not_change_bits(checkpoints):
    model, _ = load_model(checkpoints["llama"])
    record = RLAlignRollout(model).generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], n=2, max_new_tokens=5)
    whole = RLAlignTrainer(model).score(record)
    for micro in (1, 4):
        parts = RLAlignTrainer(model, micro_batch=micro).score(record)
        assert [_f32_bits(s) for s in parts] == [_f32_bits(s) for s in whole]
    assert [_f32_bits(s) for s in whole] == [_f32_bits(s.logprobs) for s in record.sequences]
