"""`rlalign train parallel.dp=2`: two gloo processes, each back-propagating half of the micro-batches;
the run is bitwise reproducible (metrics and final weights)."""

import json
import subprocess
import sys

import pytest

ARGS = ["run.steps=2", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "run.eval_every=2",
        "task.eval_size=16", "optim.micro_batch_tokens=128", "run.progress=false"]


def _train(run_dir, *extra):
    return subprocess.run([sys.executable, "-m", "rlalign.cli.main", "train", *ARGS, f"run.dir={run_dir}", *extra],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dp")
    runs = [base / "a", base / "b"]
    for run in runs:
        proc = _train(run, "parallel.dp=2")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return runs


def test_dp2_training_is_bitwise_reproducible(two_runs):
    a, b = two_runs
    assert (a / "policy" / "model.safetensors").read_bytes() == (b / "policy" / "model.safetensors").read_bytes()
    metrics = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in two_runs]
    timing = ("time", "tokens_per_s", "memory")   # wall-clock measurements, not results
    strip = [[{k: v for k, v in r.items() if not k.startswith(timing)} for r in m] for m in metrics]
    assert strip[0] == strip[1]
    assert [r["step"] for r in metrics[0]] == [0, 1, 2]     # rank 0 alone writes, one line per step
    assert all(r.get("mismatch/count", 0) == 0 for r in metrics[0])


def test_dp_with_ray_launcher_is_a_one_line_error(tmp_path):
    proc = _train(tmp_path / "r", "parallel.dp=2", "launcher=ray")
    assert proc.returncode == 2
    assert "launcher=local" in proc.stderr and "Traceback" not in proc.stderr
