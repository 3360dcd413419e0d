"""rlalign/bench/kernel_profile.py: kernel names map to the families the benchmarks report, the families sum to
the window's total, and ``rlalign bench rollout --profile-kernels`` profiles the decode steps only."""

from __future__ import annotations

import json

import pytest
import torch

from rlalign.bench.kernel_profile import family, idle_gaps, profile_breakdown
from rlalign.cli.main import main


@pytest.mark.parametrize("name,expected", [
    # our Triton kernels (rlalign/ops/triton_backend)
    ("attn_fwd_kernel", "attention"), ("attn_merge_kernel", "attention"), ("gemm_kernel", "gemm"),
    ("kpart_ws_kernel", "gemm"),
    ("segment_partials_kernel", "gemm"), ("merge_partials_kernel", "gemm"), ("grouped_rows_kernel", "moe"),
    ("route_kernel", "moe"), ("combine_fwd_kernel", "moe"), ("_moe_dispatch_place_kernel", "moe"), ("lp_stats_kernel", "logprob_sample"),
    ("sample_chunk_kernel", "logprob_sample"), ("sample_fold_kernel", "logprob_sample"),
    ("attn_stream_kernel", "attention"), ("attn_stream_work_kernel", "attention"), ("rms_fwd_kernel", "norm_rope_act"), ("rope_kernel", "norm_rope_act"),
    ("rope_write_kv_kernel", "norm_rope_act"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<bool, at::native::func_wrapper_t<bool, "
     "at::native::and_kernel_cuda(at::TensorIterator&)::{lambda()#1}>, unsigned int, bool, 4, 4> >", "checks"),
    ("silu_mul_fwd_kernel", "norm_rope_act"),
    # vendor kernels the native profile and the baselines launch
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"), ("nvjet_tst_192x192_64x4_2x1_v", "gemm"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::isfinite_kernel>", "checks"),
    ("aten::mm", "gemm"), ("some_new_kernel", "other"),
])
def test_kernel_names_map_to_their_family(name, expected):
    assert family(name) == expected, f"{name!r} -> {family(name)!r}, expected {expected!r}"


def test_idle_gaps_union_overlaps_and_charge_each_gap_to_the_sync_that_ended_in_it():
    # kernels a [0, 100], b [50, 150] (overlap: one busy stretch), c [400, 500], d [530, 600], e [1000, 1010]
    kernels = [(400.0, 500.0, "c"), (0.0, 100.0, "a"), (50.0, 150.0, "b"), (530.0, 600.0, "d"),
               (1000.0, 1010.0, "e")]
    # a sync that ended inside the 150..400 gap, one that ended before it (not the cause), none in 600..1000
    syncs = [(20.0, 60.0, "early via aten::item"), (100.0, 155.0, "ops.py(12) via aten::item")]
    out = idle_gaps(kernels, syncs, min_gap_us=20.0)
    assert out["span_ms"] == pytest.approx(1.010) and out["busy_ms"] == pytest.approx(0.330)
    assert out["idle_ms"] == pytest.approx(0.680)
    # the 30 us gap (500..530) counts, and is a launch gap; 150..400 is the sync's; 600..1000 a launch gap
    assert out["gaps"] == 3
    causes = {c["cause"]: (c["ms"], c["gaps"]) for c in out["by_cause"]}
    assert causes == {"launch": (pytest.approx(0.430), 2), "ops.py(12) via aten::item": (pytest.approx(0.250), 1)}
    assert out["largest"][0] == {"us": 400.0, "after": "d", "before": "e", "cause": "launch"}
    assert idle_gaps([], [])["idle_ms"] == 0.0
    # a gap shorter than the threshold is idle time but no listed gap
    assert idle_gaps([(0.0, 10.0, "a"), (15.0, 20.0, "b")], [])["gaps"] == 0


def test_families_sum_to_the_total_and_steps_divide():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    whole = profile_breakdown(lambda: [torch.mm(a, b).exp() for _ in range(4)], "cpu")
    per_step = profile_breakdown(lambda: [torch.mm(a, b).exp() for _ in range(4)], "cpu", steps=4)
    assert whole["per"] == "call" and per_step["per"] == "step (4 profiled)"
    assert whole["kernel_ms"] > 0
    assert sum(f["ms"] for f in whole["families"].values()) == pytest.approx(whole["kernel_ms"], rel=1e-3, abs=1e-3)
    assert sum(f["share"] for f in whole["families"].values()) == pytest.approx(1.0, abs=1e-3)
    assert {"gemm", "logprob_sample"} <= set(whole["families"])     # aten::mm, aten::exp
    assert whole["top"][0]["calls"] >= 4
    # kernel_calls: every counted op's calls (4 mm + 4 exp at least), per step when steps are given
    assert whole["kernel_calls"] >= 8 and per_step["kernel_calls"] == pytest.approx(whole["kernel_calls"] / 4, abs=1)


def test_bench_rollout_profiles_the_decode_steps(capsys):
    code = main(["bench", "rollout", "--workload", "tiny", "--engines", "strict", "--repeat", "1",
                 "--profile-kernels", "--json"])
    assert code == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    profile = row["kernel_profile"]
    # profiled from the first decode step's end: every later decode step of the extra call, no prefill
    assert profile["per"] == f"step ({row['decode_steps'] - 1} profiled)"
    assert profile["kernel_ms"] > 0 and profile["families"] and profile["top"]
