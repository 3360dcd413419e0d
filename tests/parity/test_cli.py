"""``rlalign parity``: exit codes, the --json schema, reports, record/replay, native vs strict."""

from __future__ import annotations

import json

import pytest

from rlalign.cli.main import main
from rlalign.contract.profiles import use_profile
from rlalign.parity import run as parity_run
from rlalign.parity.run import resolve_model_dir

KEYS = ["ok", "tokens_compared", "mismatches", "max_abs_diff", "mean_abs_diff", "first_divergence"]
SMALL = ["--prompts", "3", "--samples", "2", "--max-new-tokens", "6"]


def _parity(capsys, *args) -> tuple[int, dict | None]:
    rc = main(["parity", *args])
    out = capsys.readouterr().out.strip()
    return rc, (json.loads(out.splitlines()[-1]) if "--json" in args else None)


@pytest.mark.parametrize("train", ["rlalign", "transformers"])
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "qwen3-bf16", "qwen3_moe"])
def test_strict_is_bitwise_equal(checkpoints, capsys, family, train):
    rc, summary = _parity(capsys, "--model", str(checkpoints[family]), "--train", train, "--json", *SMALL)
    assert list(summary) == KEYS
    assert rc == 0 and summary["ok"] and summary["mismatches"] == 0 and summary["first_divergence"] is None
    assert 0 < summary["tokens_compared"] <= 3 * 2 * 6      # a stop token may end a sample early


@pytest.mark.parametrize("train", ["rlalign", "transformers"])
def test_native_shows_mismatches_and_report(checkpoints, capsys, tmp_path, train):
    """Measured on this CPU (fp32, 3 layers, 256 tokens): about 50 of 256 logprobs differ in native."""
    rc, summary = _parity(capsys, "--model", str(checkpoints["qwen3"]), "--train", train, "--profile", "native",
                          "--json", "--report", str(tmp_path), "--prompts", "8", "--max-new-tokens", "16")
    assert rc == 1 and not summary["ok"] and summary["mismatches"] > 0 and summary["max_abs_diff"] > 0
    first = summary["first_divergence"]
    assert {"sequence", "position", "token", "rollout_logprob", "train_logprob", "abs_diff"} <= set(first)
    assert first["rollout_logprob"] != first["train_logprob"]
    details = json.loads((tmp_path / "parity.json").read_text())
    assert details["mismatches"] == summary["mismatches"] and len(details["abs_diffs"]) == summary["tokens_compared"]
    assert "## First divergence" in (tmp_path / "parity.md").read_text()
    assert (tmp_path / "logprob_diff_hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_localize_names_the_planted_defect(checkpoints, capsys, monkeypatch):
    build = parity_run.build_trainer

    def with_defect(o, model, model_dir):
        from rlalign.models import load_model
        trainer = build(o, load_model(model_dir)[0], model_dir)
        mlp = trainer.model.model.layers[1].mlp
        strict_forward = mlp.forward

        def native_forward(x):
            with use_profile("native"):
                return strict_forward(x)
        mlp.forward = native_forward
        return trainer

    monkeypatch.setattr(parity_run, "build_trainer", with_defect)
    rc, summary = _parity(capsys, "--model", str(checkpoints["qwen3-bf16"]), "--localize", "--json", *SMALL)
    assert rc == 1
    localized = summary["first_divergence"]["localized"]
    assert (localized["boundary"], localized["layer"], localized["op"]) == ("layers.1.mlp", 1, "mlp")


def test_record_then_replay(checkpoints, capsys, tmp_path):
    path = tmp_path / "rollout.jsonl"
    rc, first = _parity(capsys, "--model", str(checkpoints["llama"]), "--record", str(path), "--json", *SMALL)
    assert rc == 0 and path.is_file()
    rc, again = _parity(capsys, "--model", str(checkpoints["llama"]), "--replay", str(path), "--train",
                        "transformers", "--json")
    assert rc == 0 and again == first


def test_human_output(checkpoints, capsys):
    rc = main(["parity", "--model", str(checkpoints["qwen2"]), *SMALL])
    out = capsys.readouterr().out
    assert rc == 0 and "OK: every token's logprob is bitwise identical" in out and "0 mismatches" in out


def test_errors_exit_2(capsys, tmp_path):
    assert main(["parity", "--model", str(tmp_path / "missing")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:   # an argument error: argparse's exit, one line
        main(["parity", "--model", str(tmp_path), "--prompts", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == ("rlalign parity: error: argument --prompts: must be an integer >= 1, "
                                               "got '0' (see rlalign parity --help)")


def test_default_model(capsys):
    resolve_model_dir("default")  # shipped in the package: a missing model is a failure, not a skip
    for train in ("rlalign", "transformers"):
        rc, summary = _parity(capsys, "--train", train, "--json", *SMALL)
        assert rc == 0 and summary["ok"] and summary["tokens_compared"] > 0


def test_moe_native_localizes_to_a_boundary_and_routing_is_compared(checkpoints, capsys, tmp_path):
    """Native MoE parity: mismatches, and the capture holds the router / routing boundaries of sparse layers."""
    rc, summary = _parity(capsys, "--model", str(checkpoints["qwen3_moe"]), "--profile", "native", "--localize",
                          "--json", "--report", str(tmp_path), "--prompts", "4", "--max-new-tokens", "12")
    assert rc == 1 and summary["mismatches"] > 0
    details = (tmp_path / "parity.md").read_text()
    assert "layers.0.router" in details and "layers.2.routing" in details and "layers.1.router" not in details
