"""``rlalign bench rollout --json`` runs end to end on a tiny preset and prints the documented schema."""

from __future__ import annotations

import json

from rlalign.cli.main import main


def test_bench_rollout_json_schema(capsys):
    code = main(["bench", "rollout", "--preset", "tiny", "--prompts", "3", "--samples", "2", "--new-tokens", "4",
                 "--prompt-len", "3:6", "--verify", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["name"] == "rollout"
    rows = {(r["engine"], r["profile"]): r for r in result["rows"]}
    assert set(rows) == {("rlalign", "strict"), ("rlalign", "native"), ("transformers", "native")}
    assert all(r["tokens_per_s"] > 0 and r["generated_tokens"] == 3 * 2 * 4 for r in rows.values())
    assert rows[("rlalign", "strict")]["logprob_mismatches"] == 0
    assert rows[("rlalign", "strict")]["logprob_tokens_checked"] == 24
    assert set(result["ratios"]) == {"strict_vs_native", "strict_vs_transformers", "native_vs_transformers"}


def test_bench_without_a_benchmark_prints_usage(capsys):
    assert main(["bench"]) == 2
    assert "rollout" in capsys.readouterr().out
