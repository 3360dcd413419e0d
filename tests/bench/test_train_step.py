"""benchmarks/train_step.py: the three variants run on a tiny shape on the CPU (seconds) and agree on the loss
(same weights, same tokens); the FLOP count and the ragged workload are checked against independent counts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "train_step.py"
_spec = importlib.util.spec_from_file_location("bench_train_step", _PATH)
train_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_step)


def test_tiny_run_reports_every_variant_and_the_losses_agree(capsys, tmp_path):
    code = train_step.main(["--shape", "tiny", "--device", "cpu", "--tokens", "128", "--mean-seq", "24",
                            "--iters", "1", "--warmup", "1", "--in-process", "--peak-tflops", "1",
                            "--ceiling-tflops", "0.5", "--json", "--out", str(tmp_path / "r.json")])
    result = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "r.json").read_text()) == result
    assert code == 0
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"strict", "native", "transformers"}
    for r in rows.values():
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_gib"] >= 0
        assert r["mfu"] == pytest.approx(r["model_tflops_per_s"] / 1.0)
        assert r["mfu_vs_cublas_ceiling"] == pytest.approx(r["model_tflops_per_s"] / 0.5)
    # one model, one batch: the three pipelines compute the same loss up to bf16 rounding
    ref = rows["strict"]["loss"]
    assert all(abs(r["loss"] - ref) <= 1e-2 * abs(ref) for r in rows.values()), {k: r["loss"] for k, r in rows.items()}
    assert result["shape"]["tokens"] == 128 and set(result["ratios"]) >= {"time_strict_over_native"}


def test_strict_keep_saves_exactly_the_rebuilt_activations_more(capsys):
    """fp32 on the CPU (where the torch backend's norm and silu_mul save their own inputs): strict_keep, with
    recomputation off, saves per layer 2 norm outputs [T, hidden], silu_mul's output [T, intermediate] and (Qwen3's
    q/k norm) the roped q and k [T, (heads + kv_heads) x head_dim] more, and computes the same loss bits."""
    code = train_step.main(["--shape", "tiny", "--device", "cpu", "--tokens", "128", "--mean-seq", "24",
                            "--dtype", "float32", "--variants", "strict,strict_keep", "--iters", "1", "--warmup", "0",
                            "--in-process", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["variant"]: r for r in result["rows"]}
    shape = train_step.SHAPES["tiny"]
    qk = (shape["num_attention_heads"] + shape["num_key_value_heads"]) * shape["head_dim"]
    per_layer = 128 * (2 * shape["hidden_size"] + shape["intermediate_size"] + qk) * 4
    extra = (rows["strict_keep"]["saved_gib"] - rows["strict"]["saved_gib"]) * 2**30
    assert round(extra) == 2 * per_layer
    assert rows["strict"]["loss"] == rows["strict_keep"]["loss"]


def test_profile_kernels_adds_a_breakdown_of_one_more_step(capsys):
    code = train_step.main(["--shape", "tiny", "--device", "cpu", "--tokens", "128", "--mean-seq", "24",
                            "--variants", "strict", "--iters", "1", "--warmup", "0", "--in-process", "--profile-kernels"])
    assert code == 0
    out = capsys.readouterr().out
    assert "kernels " in out and "gemm " in out, out


def test_matmul_params_equal_the_model_weight_count():
    """N in 6 N T counts every matmul weight (decoder linears + LM head), not the embedding or the norms."""
    from rlalign.models.config import ModelConfig
    from rlalign.models.decoder import CausalLM
    args = train_step.parse_args(["--shape", "tiny", "--device", "cpu", "--layers", "3"])
    cfg = train_step.hf_config(args)
    model = CausalLM(ModelConfig.from_hf_dict(cfg), dtype=torch.float32, device="meta")
    counted = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed_tokens" not in n)
    flops = train_step.model_flops(cfg, [2, 3])
    assert flops["matmul_params"] == counted
    assert flops["dense_flops"] == 6 * counted * 5
    assert flops["attention_flops"] == 6 * cfg["num_attention_heads"] * cfg["head_dim"] * 3 * (4 + 9)


@pytest.mark.parametrize("option, value, message", [
    ("--layers", "0", "must be >= 1"), ("--tokens", "0", "must be >= 1"), ("--mean-seq", "-1", "must be >= 1"),
    ("--iters", "0", "must be >= 1"), ("--peak-tflops", "0", "--peak-tflops must be > 0"),
    ("--ceiling-tflops", "-5", "--ceiling-tflops must be > 0")])
def test_counts_and_peaks_that_are_not_positive_are_refused(option, value, message, capsys):
    """An explicit 0 is refused with one line, not replaced by the default (`--layers 0` ran 2 layers)."""
    with pytest.raises(SystemExit) as exc:
        train_step.parse_args(["--shape", "tiny", "--device", "cpu", option, value])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_qwen3_8b_shape_has_8b_class_parameter_count():
    args = train_step.parse_args(["--device", "cpu", "--layers", "36"])
    n = train_step.model_flops(train_step.hf_config(args), [1])["matmul_params"]
    assert n == 36 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 12288) + 151936 * 4096   # 7.57e9 (+0.62e9 embed)


@settings(max_examples=50, deadline=None)
@given(tokens=st.integers(1, 5000), mean=st.integers(1, 2000), seed=st.integers(0, 100))
def test_sequence_lengths_are_ragged_within_the_budget(tokens, mean, seed):
    lens = train_step.sequence_lengths(tokens, mean, seed)
    assert lens and all(n >= 1 for n in lens)
    assert sum(lens) == tokens
    lo, hi = max(1, mean // 4), max(1, 7 * mean // 4)
    assert all(lo <= n <= hi for n in lens[:-1]) and lens[-1] <= hi
    assert lens == train_step.sequence_lengths(tokens, mean, seed)


def test_peak_from_trace_replays_allocations_and_frees():
    """The peak breakdown's replay: the maximum of baseline + live bytes, and who held them at that moment."""
    ours = [{"filename": "/x/torch/nn/functional.py", "line": 9, "name": "linear"},
            {"filename": "/repo/rlalign/ops/linear.py", "line": 40, "name": "forward"}]
    events = [{"action": "alloc", "addr": 1, "size": 100, "frames": ours},
              {"action": "alloc", "addr": 2, "size": 300, "frames": []},
              {"action": "free_requested", "addr": 1},          # not yet free: the stream may still use it
              {"action": "free_completed", "addr": 1},
              {"action": "alloc", "addr": 3, "size": 50, "frames": ours},
              {"action": "free_completed", "addr": 2},
              {"action": "free_completed", "addr": 99},         # allocated before the trace began: ignored
              {"action": "alloc", "addr": 4, "size": 200, "frames": ours}]
    out = train_step.peak_from_trace(events, baseline=2**30)
    assert out["peak_gib"] * 2**30 == 2**30 + 400 and out["step_allocations_at_peak_gib"] * 2**30 == 400
    assert [(g["where"], g["count"], round(g["gib"] * 2**30)) for g in out["at_peak"]] == \
        [("?:0 ?", 1, 300), ("linear.py:40 forward", 1, 100)]


def test_peak_breakdown_without_cuda_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        train_step.parse_args(["--device", "cpu", "--peak-breakdown"])
    assert exc.value.code == 2 and "--peak-breakdown needs --device cuda" in capsys.readouterr().err
