"""benchmarks/sft_step.py: both variants run the tiny shape on the CPU (each in its own process, as on the GPU) and
report finite numbers; step 1's loss (before any update) is the same objective on the same weights and tokens, so
the two agree up to bf16 rounding; the workload's pairs and the Trainer's padded labels are checked against the
examples they come from."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sft_step.py"
_spec = importlib.util.spec_from_file_location("bench_sft_step", _PATH)
sft_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sft_step)

ROW_FIELDS = {"variant", "step_s", "step_s_all", "tokens_per_s", "peak_gib", "peak_kind", "loss_first", "loss"}


def test_tiny_cpu_run_reports_both_variants_with_finite_numbers(capsys, tmp_path):
    out = tmp_path / "r.json"
    code = sft_step.main(["--shape", "tiny", "--device", "cpu", "--iters", "1", "--warmup", "0", "--json",
                          "--out", str(out)])
    result = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == result
    assert code == 0, result["rows"]
    assert {"name", "date", "torch", "transformers", "device", "shape", "rlalign_sft", "warmup", "iters", "rows",
            "ratios"} <= set(result)
    assert result["shape"]["tokens"] == 256 and result["shape"]["layers"] == 2
    assert 0 < result["shape"]["scored_tokens"] < 256
    assert result["rlalign_sft"]["profile"] == "strict" and result["rlalign_sft"]["micro_batches"] == 1
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"rlalign", "transformers"}
    ran = ["rlalign"]
    if sft_step.transformers_missing():
        assert rows["transformers"]["skipped"].startswith("skipped: ")
        assert result["ratios"] == {}
    else:
        ran.append("transformers")
    for name in ran:
        r = rows[name]
        assert ROW_FIELDS <= set(r), (name, r)
        assert len(r["step_s_all"]) == 1 and r["step_s"] == r["step_s_all"][0] > 0
        assert all(math.isfinite(r[k]) for k in ("step_s", "tokens_per_s", "peak_gib", "loss_first", "loss")), r
        assert r["peak_gib"] >= 0 and r["tokens_per_s"] == pytest.approx(256 / r["step_s"])
    if len(ran) == 2:
        ref = rows["rlalign"]["loss_first"]
        assert abs(rows["transformers"]["loss_first"] - ref) <= 1e-2 * abs(ref), rows
        ratios = result["ratios"]
        assert ratios["time_transformers_over_rlalign"] == pytest.approx(
            rows["transformers"]["step_s"] / rows["rlalign"]["step_s"])
        assert set(ratios) == {"time_transformers_over_rlalign", "memory_rlalign_over_transformers"}


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 300), mean=st.integers(1, 80), seed=st.integers(0, 3))
def test_pairs_cover_the_tokens_and_the_padded_labels_are_the_scored_tokens(tokens, mean, seed):
    args = sft_step.parse_args(["--shape", "tiny", "--device", "cpu", "--tokens", str(tokens), "--mean-seq",
                                str(mean), "--seed", str(seed)])
    examples = sft_step.make_examples(args, 1000)
    assert sum(len(ex.tokens) for ex in examples) == tokens
    for ex in examples:
        assert not ex.scored[0] and all(0 <= t < 1000 for t in ex.tokens)
        # a prompt of >= 1 token, then the response: scored from the first response token to the end
        first = ex.scored.index(True) if any(ex.scored) else len(ex.tokens)
        assert first >= 1 and all(ex.scored[first:]) and not any(ex.scored[:first])
        assert (first < len(ex.tokens)) == (len(ex.tokens) >= 2)
    rows = sft_step._padded_rows(examples, pad_id=7)
    l_max = max(len(ex.tokens) for ex in examples)
    for ex, row in zip(examples, rows):
        n = len(ex.tokens)
        assert all(row[k].shape == (l_max,) for k in row)
        assert row["input_ids"][:n].tolist() == list(ex.tokens) and (row["input_ids"][n:] == 7).all()
        assert row["attention_mask"].tolist() == [1] * n + [0] * (l_max - n)
        expected = [t if s else -100 for t, s in zip(ex.tokens, ex.scored)] + [-100] * (l_max - n)
        assert row["labels"].tolist() == expected


def test_the_8b_shape_is_the_rollout_preset_cut_to_the_layers():
    from rlalign.bench.rollout import PRESETS
    args = sft_step.parse_args(["--device", "cpu", "--layers", "3"])
    assert sft_step.hf_config(args) == dict(PRESETS["qwen3-8b"], num_hidden_layers=3)
    assert (args.tokens, args.mean_seq, args.warmup, args.iters) == (8192, 1024, 2, 5)


@pytest.mark.parametrize("option, value, message", [
    ("--layers", "0", "must be >= 1"), ("--tokens", "0", "must be >= 1"), ("--iters", "0", "must be >= 1"),
    ("--warmup", "-1", "--warmup >= 0"), ("--micro-batch-tokens", "0", "--micro-batch-tokens must be >= 1"),
    ("--variants", "rlalign,bogus", "unknown variants"),
])
def test_bad_options_are_one_line_errors(option, value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sft_step.parse_args(["--device", "cpu", option, value])
    assert exc.value.code == 2 and message in capsys.readouterr().err

