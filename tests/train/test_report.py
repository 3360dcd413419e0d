"""rlalign report: every panel drawn, notes on absent / all-zero panels, several runs overlaid, smoothing."""

import json

import pytest

from rlalign.cli.main import main
from rlalign.train.run.report import PANELS, ema, panel_note, write_report


def _fake_run(path, steps=30, kl=False, reward_shift=0.0):
    path.mkdir(parents=True)
    lines = [{"step": 0, "eval/accuracy": 0.1, "time/eval_s": 0.5}]
    for s in range(1, steps + 1):
        r = {"step": s, "reward/mean": 0.1 + reward_shift + s / steps * 0.5, "reward/std": 0.2, "reward/min": 0.0,
             "reward/max": 1.0, "mismatch/count": 0, "mismatch/tokens": 100, "rollout_corr/kl_k3": 0.0,
             "kl/ppo": 0.0, "entropy": 1.0 - s / 100, "clip_frac": 0.0, "completion/mean_len": 5.0,
             "completion/min_len": 2, "completion/max_len": 6, "loss/policy": -0.01, "loss/kl": 0.0,
             "grad_norm": 0.5, "lr": 1e-4, "time/rollout_s": 1.0, "time/train_s": 0.5, "tokens_per_s/rollout": 100.0}
        if kl:
            r["kl/ref"] = 0.01 * s
        if s % 10 == 0:
            r["eval/accuracy"] = s / steps
        lines.append(r)
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_single_run_report_and_notes(tmp_path):
    run = _fake_run(tmp_path / "a")
    png, md = write_report(run)
    assert png.stat().st_size > 50_000 and png.name == "report.png"
    text = md.read_text()
    assert "0 of 3000 tokens compared (bitwise identical" in text and "clip fraction" in text and "eval 0.5" in text
    runs = [("a", [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()])]
    notes = {p[0]: panel_note(runs, p) for p in PANELS}
    assert "bitwise identical" in notes["train/rollout mismatch"]
    assert "all 0" in notes["KL"] and "no token's ratio" in notes["clip fraction"]
    assert notes["reward"] is None and notes["entropy"] is None and notes["losses"] is None
    value_only = [("b", [{"step": 1, "reward/mean": 0.5}])]
    assert panel_note(value_only, [p for p in PANELS if p[0] == "grad norm"][0]) == "not logged in this run"


def test_runs_overlaid_with_kl_not_noted(tmp_path):
    a, b = _fake_run(tmp_path / "a"), _fake_run(tmp_path / "b", kl=True, reward_shift=0.2)
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "cmp"), "--smooth", "0.8"]) == 0
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| a | 30 |" in md and "| b | 30 |" in md and (tmp_path / "cmp" / "compare.png").stat().st_size > 50_000
    runs = [(d.name, [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]) for d in (a, b)]
    assert panel_note(runs, [p for p in PANELS if p[0] == "KL"][0]) is None   # b's kl/ref is not zero
    assert main(["report", str(a), "--smooth", "1.5"]) == 2


@pytest.mark.parametrize("values", [[1.0], [3.0, 1.0, 2.0, 5.0], [0.0] * 5])
def test_ema_starts_at_the_first_value_and_stays_in_range(values):
    out = ema(values, 0.6)
    assert out[0] == pytest.approx(values[0], rel=1e-12) and len(out) == len(values)
    assert all(min(values) - 1e-12 <= v <= max(values) + 1e-12 for v in out)


def test_moe_routing_mismatches_are_reported_next_to_the_logprob_ones(tmp_path):
    run = _fake_run(tmp_path / "moe", steps=4)
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records[1:]:
        r.update({"moe/routing_tokens": 50, "moe/routing_mismatch": r["step"] % 2, "moe/routing_mismatch_frac": 0.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    _, md = write_report(run)
    assert "MoE routing mismatches: 2 of 200 (token, sparse layer) pairs" in md.read_text()
    panel = [p for p in PANELS if p[0] == "train/rollout mismatch"][0]
    assert panel_note([("moe", records)], panel) is None          # the routing curve is not all zero
    dense = _fake_run(tmp_path / "dense", steps=2)
    _, dense_md = write_report(dense)
    assert "routing" not in dense_md.read_text()
    assert main(["report", str(run), str(dense), "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| 0 of 400; routing 2 of 200 |" in table and "| 0 of 200 |" in table


def test_the_spread_of_a_native_run_is_drawn_and_compared(tmp_path):
    """A native run's log-prob difference quantiles, importance-ratio extremes and TIS share get their panels (a
    strict run's say why they are empty or zero) and the comparison table's max |difference|, clip and grad norm."""
    strict = _fake_run(tmp_path / "strict", steps=3)
    native = _fake_run(tmp_path / "native", steps=3)
    records = [json.loads(l) for l in (native / "metrics.jsonl").read_text().splitlines()]
    for r in records[1:]:
        r.update({"mismatch/count": 7, "mismatch/max_abs": 0.02 * r["step"], "mismatch/abs_p50": 0.001,
                  "mismatch/abs_p90": 0.004, "mismatch/abs_p99": 0.01, "mismatch/ratio_min": 0.97,
                  "mismatch/ratio_max": 1.04, "rollout_corr/truncated_frac": 0.0, "clip_frac": 0.01 * r["step"]})
    (native / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    strict_runs = [("strict", [json.loads(l) for l in (strict / "metrics.jsonl").read_text().splitlines()])]
    panels = {p[0]: p for p in PANELS}
    assert "native profile" in panel_note(strict_runs, panels["importance ratio trainer/rollout"])
    assert "no correction" in panel_note(strict_runs, panels["mismatch correction"])
    assert "no token's ratio reached the bound" in panel_note([("native", records)], panels["mismatch correction"])
    for name in ("train/rollout |logprob difference|", "importance ratio trainer/rollout"):
        assert panel_note([("native", records)], panels[name]) is None
    assert main(["report", str(strict), str(native), "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| 0 of 300 | 1.50 | - | 0.0000 | 0.500 |" in table   # the fake strict run logs no max_abs
    assert "| 21 of 300 | 1.50 | 0.06 | 0.0200 | 0.500 |" in table
