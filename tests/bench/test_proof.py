"""benchmarks/proof.py: pretraining, two arms of one step (the profile and the correction each arm asked for), the
overlay report of both, the resume rule of an arm and the folder's refusals."""

import importlib.util
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


proof = _load("benchmarks_proof", REPO / "benchmarks" / "proof.py")


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_arms_run_with_their_profile_and_are_overlaid(tmp_path, capsys):
    out = tmp_path / "proof"
    argv = ["--out", str(out), "--size", "tiny", "--arms", "strict,native-tis", "--steps", "1"]
    assert proof.main(argv) == 0
    base = json.loads((out / "base" / "pretrain.json").read_text())
    assert base["pretrain_config"]["steps"] == 2 and base["pretrain_config"]["habit_prob"] == 0.0
    for arm, profile, correction in (("strict", "strict", "none"), ("native-tis", "native", "token_tis")):
        run = out / "runs" / arm
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert (saved["run"]["profile"], saved["algo"]["mismatch_correction"]) == (profile, correction)
        assert saved["model"]["path"] == str(out / "base") and saved["model"]["dtype"] == "bfloat16"
        step = [r for r in _records(run) if r["step"] == 1][0]
        assert step["mismatch/tokens"] > 0
        if profile == "strict":   # bitwise: nothing differs, the spread is not logged, no correction ran
            assert step["mismatch/count"] == 0 and "mismatch/abs_p50" not in step and "rollout_corr/ratio_max" not in step
        else:
            assert {"mismatch/abs_p99", "mismatch/ratio_min", "rollout_corr/truncated_frac"} <= step.keys()
    compare = (out / "report" / "compare.md").read_text()
    assert "| strict | 1 |" in compare and "| native-tis | 1 |" in compare
    assert (out / "report" / "compare.png").stat().st_size > 50_000
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["arms"]) == ["strict", "native-tis"] and summary["arms"]["strict"]["logprobs_differing"] == 0
    # the same command again keeps every stage; other settings in the folder are refused in one line
    capsys.readouterr()
    assert proof.main(argv) == 0
    assert "arm strict: kept" in capsys.readouterr().out
    assert proof.main(argv[:5] + ["strict,native-tis,native", "--steps", "1", "--minutes", "0.01"]) == 0
    assert "time budget (--minutes 0.01) used before arm native" in capsys.readouterr().out
    assert not (out / "runs" / "native").exists()
    assert proof.main(argv[:-1] + ["2"]) == 2
    assert "other settings (steps 1 -> 2)" in capsys.readouterr().err


def test_arm_state_and_refusals(tmp_path, capsys):
    run = tmp_path / "run"
    assert proof.arm_state(run, 3) == "fresh"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    assert proof.arm_state(run, 3) == "resume"
    (run / "policy").mkdir()
    (run / "policy" / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2}) + "\n")
    assert proof.arm_state(run, 3) == "resume"        # stopped after step 2 of 3: continue from its checkpoint
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3}) + "\n")
    assert proof.arm_state(run, 3) == "done"
    argv = ["--out", str(tmp_path / "o"), "--size", "tiny"]
    assert proof.main(argv + ["--arms", "strict,bogus"]) == 2
    assert "unknown arm(s) bogus" in capsys.readouterr().err
    assert proof.main(["--out", str(tmp_path / "d"), "--size", "tiny", "--device", "gpu"]) == 2
    assert "--device must be cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    assert proof.main(["--out", str(foreign), "--size", "tiny"]) == 2
    assert "not an experiment folder" in capsys.readouterr().err and (foreign / "notes.txt").read_text() == "keep"
    argv = proof.arm_argv(tmp_path, "native-mis", tmp_path / "base", resume=True)
    assert argv[-3:] == ["run.dir=" + str(tmp_path / "runs" / "native-mis"), "algo.mismatch_correction=token_mis",
                         "run.resume=true"] and "run.profile=native" in argv


def test_pretraining_ends_at_the_first_evaluation_that_reaches_the_accuracy(tmp_path, monkeypatch):
    """stop_at_accuracy: the run ends after the first evaluation whose sampled accuracy reaches it (the
    evaluations' accuracies are stood in for: a tiny model learns nothing in a few steps) and records where."""
    from rlalign.train import pretrain as pt
    seen = iter([0.1, 0.3, 0.9])
    monkeypatch.setattr(pt, "_accuracies", lambda *a: {"greedy": 0.0, "greedy_knows_sum": 0.0, "sampled": next(seen)})
    cfg = pt.PretrainConfig(out=str(tmp_path / "m"), steps=9, hidden_size=16, num_layers=1, num_heads=1,
                            num_kv_heads=1, head_dim=16, intermediate_size=32, batch_size=4, eval_every=2,
                            stop_at_accuracy=0.25)
    lines = []
    pt.pretrain(cfg, log=lines.append)
    record = json.loads((tmp_path / "m" / "pretrain.json").read_text())
    assert record["steps_run"] == 4 and record["eval_accuracy"]["sampled"] == 0.3
    assert lines[-1].startswith(f"saved {tmp_path / 'm'} after 4 steps")


def test_the_replay_arm_is_native_moe_with_routing_replay_and_no_correction(tmp_path):
    argv = proof.arm_argv(tmp_path, "moe-native-replay", tmp_path / "base-moe", resume=False)
    assert "run.profile=native" in argv and "algo.routing_replay=true" in argv
    assert not any(a.startswith("algo.mismatch_correction") for a in argv)
    assert proof.ARMS["moe-native-replay"][0] == "moe"
    assert all("algo.routing_replay=true" not in proof.arm_argv(tmp_path, arm, tmp_path, resume=False)
               for arm in proof.ARMS if arm != "moe-native-replay")
