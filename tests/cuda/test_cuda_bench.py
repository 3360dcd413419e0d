"""``rlalign bench rollout --device cuda`` on the tiny workload: both rlalign profiles replay decode graphs,
the per-step GPU and host times and the roofline fields are filled, strict has 0 mismatches. Skipped
without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from rlalign.bench.cards import card_spec
from rlalign.cli.main import main

pytestmark = pytest.mark.cuda


def test_bench_rollout_cuda_reports_the_roofline(capsys):
    spec = card_spec(torch.cuda.get_device_name())   # the card's datasheet figures (rlalign/bench/cards.py)
    peaks = [] if spec is not None else ["--peak-gbps", "1000", "--peak-tflops", "100"]   # a card not in the table
    code = main(["bench", "rollout", "--device", "cuda", "--workload", "tiny", "--engines", "strict,native",
                 "--warmup", "full", "--verify", "--json", *peaks])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    if spec is not None:
        assert result["workload"]["peak_gbps"] == spec.peak_gbps and result["workload"]["peak_gbps_source"] == "spec"
    for row in result["rows"]:
        assert row["decode_graphs"] == "graphs" and row["graph_steps"] > 0, row
        assert row["graph_captures_timed"] == 0, "a full warm-up leaves nothing to capture in the timed call"
        assert row["timed_forward_steps"] > 0 and row["forward_gpu_ms"] > 0
        assert row["host_ms_per_step"] >= 0 and 0 < row["roofline_fraction"] <= row["forward_roofline_fraction"]
        assert row["forward_roofline_fraction"] <= 1.0
    strict_checks = next(r for r in result["rows"] if r["profile"] == "strict")["graph_finite_checks_per_step"]
    # boundary policy (the CUDA default): one k check per layer (2 layers) in the graph's forward (the hidden
    # rows' checks belong to the sampler's ops, captured after it and not counted here)
    assert strict_checks == 2
    strict = next(r for r in result["rows"] if r["profile"] == "strict")
    assert strict["logprob_mismatches"] == 0 and strict["logprob_tokens_checked"] == 24
