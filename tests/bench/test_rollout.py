"""``rlalign bench rollout --json`` runs end to end on a tiny preset and prints the documented schema."""

from __future__ import annotations

import json

import pytest

from rlalign.cli.main import main

DECODE_FIELDS = {"decode_steps", "decode_rows_mean", "decode_context_mean", "decode_step_ms", "decode_step_ms_median",
                 "decode_tokens_per_s", "bytes_per_decode_step", "weight_bytes_per_decode_step",
                 "kv_bytes_per_decode_step", "achieved_gbps", "roofline_fraction", "forward_gpu_ms",
                 "host_ms_per_step", "forward_roofline_fraction", "timed_forward_steps", "graph_finite_checks_per_step",
                 "op_floor_ms", "op_roofline_fraction", "forward_op_roofline_fraction"}


def test_bench_rollout_json_schema(capsys):
    code = main(["bench", "rollout", "--workload", "tiny", "--verify", "--peak-gbps", "0.001", "--peak-tflops", "1e-6",
                 "--repeat", "1", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["name"] == "rollout" and result["workload"]["name"] == "tiny"
    assert result["workload"]["peak_gbps"] == 0.001 and result["workload"]["peak_tflops"] == 1e-6
    # the CPU: no card; the figures are the flags' (tests/bench/test_cards.py: a card's spec figures on CUDA)
    assert result["workload"]["card"] is None and result["workload"]["datasheet"] is None
    assert result["workload"]["peak_gbps_source"] == result["workload"]["peak_tflops_source"] == "flag"
    rows = {(r["engine"], r["profile"]): r for r in result["rows"]}
    assert set(rows) == {("rlalign", "strict"), ("rlalign", "native"), ("transformers", "native")}
    assert all(r["tokens_per_s"] > 0 and r["generated_tokens"] == 3 * 2 * 4 for r in rows.values())
    for profile in ("strict", "native"):
        row = rows[("rlalign", profile)]
        assert DECODE_FIELDS <= set(row)
        assert row["decode_steps"] >= 3 and row["decode_rows_mean"] <= 6      # 6 sequences, 4 tokens each
        assert row["bytes_per_decode_step"] == row["weight_bytes_per_decode_step"] + row["kv_bytes_per_decode_step"]
        assert row["roofline_fraction"] == pytest.approx(row["achieved_gbps"] / 0.001, rel=1e-2, abs=1e-3)
        assert row["forward_gpu_ms"] is None and row["decode_graphs"] == "off"   # the CPU: no graph replays
        # the per-op floor is at least the bytes at the bandwidth peak, so its fraction at least the bandwidth one
        assert row["op_floor_ms"] > 0 and row["op_roofline_fraction"] >= row["roofline_fraction"] * (1 - 1e-2)
        assert row["logprob_tokens_checked"] == 24
    assert rows[("rlalign", "strict")]["logprob_mismatches"] == 0
    assert set(result["ratios"]) == {"strict_vs_native", "strict_vs_transformers", "native_vs_transformers"}


def _refused(capsys, *argv) -> str:
    """The one line a refused benchmark ends with (exit 2; progress lines may come first), without its prefix."""
    assert main(["bench", "rollout", *argv]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("rlalign bench rollout: error: "), last
    return last.removeprefix("rlalign bench rollout: error: ")


def test_bench_refuses_unknown_workloads_and_bad_layers(capsys):
    assert "unknown workload 'huge'" in _refused(capsys, "--workload", "huge", "--engines", "strict")
    assert "--layers must be in 1..2 for tiny" in _refused(capsys, "--workload", "tiny", "--layers", "3",
                                                           "--engines", "strict")


@pytest.mark.parametrize("option", ["--peak-gbps", "--peak-tflops", "--kv-cache-gb"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_bench_refuses_peaks_and_sizes_that_are_not_positive(option, value, capsys):
    assert _refused(capsys, "--workload", "tiny", "--engines", "strict", option, value).startswith(
        f"{option} must be > 0, got {value}")


@pytest.mark.parametrize("option", ["--prompts", "--samples", "--new-tokens", "--page-size", "--repeat", "--hf-prompts",
                                    "--layers"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_bench_refuses_counts_that_are_not_positive(option, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "rollout", "--workload", "tiny", "--engines", "strict", option, value])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (f"rlalign bench rollout: error: argument {option}: must be an integer "
                                               f">= 1, got '{value}' (see rlalign bench rollout --help)")


def test_layers_cut_the_preset(capsys):
    assert main(["bench", "rollout", "--workload", "tiny", "--layers", "1", "--engines", "strict", "--repeat", "1",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "first 1 of 2 layers" in result["workload"]["model"]
    row = result["rows"][0]
    rows, context = row["decode_rows_mean"], row["decode_context_mean"]
    # one layer (37,024 weights) + final norm + LM head, fp32, + the gathered embedding rows
    assert row["weight_bytes_per_decode_step"] == pytest.approx((37024 + 64 + 512 * 64 + rows * 64) * 4, rel=1e-3)
    # K and V of one layer: 2 * 2 kv heads * 16 * 4 bytes per token read (context) and written (rows)
    assert row["kv_bytes_per_decode_step"] == pytest.approx(256 * (context * rows + rows), rel=2e-2)


def test_max_model_len_is_the_workloads_by_default(capsys):
    """--max-model-len: the longest prompt + new tokens by default (as verl sets it), the model's with 'model', a
    number checked against both ends."""
    assert main(["bench", "rollout", "--workload", "tiny", "--engines", "strict", "--repeat", "1", "--json",
                 "--verify"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert main(["bench", "rollout", "--workload", "tiny", "--engines", "strict", "--repeat", "1", "--json",
                 "--verify", "--max-model-len", "model"]) == 0
    model_row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["max_model_len"] < model_row["max_model_len"]
    assert row["logprob_mismatches"] == model_row["logprob_mismatches"] == 0
    assert "must hold the workload's longest sequence" in _refused(capsys, "--workload", "tiny", "--engines",
                                                                    "strict", "--max-model-len", "2")
    assert "is not a number" in _refused(capsys, "--workload", "tiny", "--engines", "strict", "--max-model-len", "big")


def test_bench_without_a_benchmark_prints_usage(capsys):
    assert main(["bench"]) == 2
    assert "rollout" in capsys.readouterr().out


def test_bench_rollout_strict_and_native_on_the_same_machinery(capsys):
    """--engines strict,native with the graphs' padded batches and overlap on (the CPU form of the CUDA run):
    both rows sampled their decode steps in the graphs, overlapped them and report the same fields."""
    code = main(["bench", "rollout", "--workload", "tiny", "--engines", "strict,native", "--decode-graphs", "padded",
                 "--overlap", "on", "--repeat", "1", "--json"])
    assert code == 0
    rows = {r["profile"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"strict", "native"}
    for profile, row in rows.items():
        assert row["decode_graphs"] == "padded" and row["graph_steps"] > 0, profile
        assert row["overlap"] is True and row["overlapped_steps"] > 0, profile
    assert set(rows["strict"]) == set(rows["native"])
