"""`rlalign train` with parallel.tp / parallel.dp (spawned gloo processes): tp=2 trains to the same
bits as tp=1, for the default model and for a Qwen3-MoE upcycled from it; a dp=2 run completes with one writer and
zero mismatches, its ranks splitting the rollout into the one-process run's samples; parallel.shard=grads and
parallel.shard=params resume it to the same bits. (DP determinism is tested at the gradient level in test_collectives_dp.py; a dp=2 run stopped
and resumed was checked by hand to end with the bits of an uninterrupted one, 2026-11-30.)"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file

from rlalign.train.checkpointing import with_parts
from tests.bitwise import assert_bitwise_equal

# the CLI in a subprocess: one OpenMP thread, like the spawned ranks (and fast on a busy 2-core machine)
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")
ARGS = ["run.steps=2", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "run.eval_every=2",
        "task.eval_size=2", "run.eval_samples=1", "optim.micro_batch_tokens=64", "run.progress=false",
        "run.checkpoint_every=1"]
TIMING = ("time", "tokens_per_s", "memory")   # wall-clock measurements, not results


def _train(run_dir, *extra):
    proc = subprocess.run([sys.executable, "-m", "rlalign.cli.main", "train", *ARGS, f"run.dir={run_dir}", *extra],
                          capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    return proc


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


def _metrics(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)} for line in lines]


def _weights(run):
    return (run / "policy" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("parallel")
    out = {name: base / name for name in ("tp1", "tp2", "dp2")}
    _ok(_train(out["tp1"], "parallel.tp=1"))
    _ok(_train(out["tp2"], "parallel.tp=2"))
    _ok(_train(out["dp2"], "parallel.dp=2"))
    return out


def test_tp2_training_equals_tp1_bitwise(runs):
    assert _weights(runs["tp2"]) == _weights(runs["tp1"])
    assert _metrics(runs["tp2"]) == _metrics(runs["tp1"])
    assert [r["step"] for r in _metrics(runs["tp2"])] == [0, 1, 2]     # one writer, one line per step
    assert all(r.get("mismatch/count", 0) == 0 for r in _metrics(runs["tp2"]))


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """A strict GRPO run on a Qwen3-MoE (the default model upcycled: 4 experts, top-2, moe_intermediate_size 384)
    at tp=1 and tp=2, with the router's load-balancing loss on so its gradient crosses the sharded experts too."""
    base = tmp_path_factory.mktemp("moe_parallel")
    script = Path(__file__).resolve().parents[2] / "scripts" / "make_moe_model.py"
    made = subprocess.run([sys.executable, str(script), str(base / "model"), "--experts", "4", "--top-k", "2"],
                          capture_output=True, text=True, env=ONE_THREAD)
    assert made.returncode == 0, made.stderr
    out = {name: base / name for name in ("tp1", "tp2")}
    for name, run in out.items():
        _ok(_train(run, f"parallel.tp={name[-1]}", f"model.path={base / 'model'}", "algo.router_aux_coef=0.1"))
    return out


def test_moe_tp2_training_equals_tp1_bitwise(moe_runs):
    metrics = _metrics(moe_runs["tp2"])
    assert _weights(moe_runs["tp2"]) == _weights(moe_runs["tp1"])
    assert metrics == _metrics(moe_runs["tp1"])
    assert [r["step"] for r in metrics] == [0, 1, 2]
    steps = [r for r in metrics if "reward/mean" in r]
    assert steps and all(r["mismatch/count"] == 0 and r["mismatch/tokens"] > 0 and r["moe/aux_loss"] > 0
                         for r in steps)


def test_dp2_training_runs_with_one_writer(runs):
    metrics = _metrics(runs["dp2"])
    assert [r["step"] for r in metrics] == [0, 1, 2]
    assert all(r.get("mismatch/count", 0) == 0 for r in metrics)
    assert (runs["dp2"] / "checkpoints" / "latest.json").exists() and _weights(runs["dp2"])


def test_dp2_ranks_split_the_rollout_and_train_on_the_one_process_samples(runs):
    """Each DP rank generated half of step 1's prompts (and of step 0's eval) (rlalign/train/dp_rollout.py) and all ranks trained on all
    samples: the rollout's statistics equal those of the one-process run on the same initial weights."""
    keys = ("reward/mean", "reward/std", "reward/min", "reward/max", "reward/zero_std_frac", "completion/mean_len",
            "completion/min_len", "completion/max_len", "completion/truncated_frac", "mismatch/tokens")
    dp2, tp1 = ({k: r[k] for k in keys} for run in ("dp2", "tp1") for r in _metrics(runs[run]) if r["step"] == 1)
    assert dp2 == tp1
    evals = ("eval/accuracy", "eval/accuracy_greedy")   # step 0's eval, split over the ranks the same way
    dp2, tp1 = ({k: r[k] for k in evals} for run in ("dp2", "tp1") for r in _metrics(runs[run]) if r["step"] == 0)
    assert dp2 == tp1


def _rewind(run: Path, step: int) -> None:
    """The run directory as it was after checkpoint ``step``: later checkpoints gone, latest.json pointing at it."""
    ckpt = run / "checkpoints"
    manifest = json.loads((ckpt / "latest.json").read_text())
    name = f"step_{step:06d}.pt"
    for later in manifest["history"][manifest["history"].index(name) + 1:]:
        (ckpt / later).unlink()
    sha = manifest["sha256s"][name]
    (ckpt / "latest.json").write_text(json.dumps({"step": step, "file": name, "sha256": sha, "history": [name],
                                                  "bytes": (ckpt / name).stat().st_size, "sha256s": {name: sha}}))


def _checkpoint(run: Path) -> dict:
    manifest = json.loads((run / "checkpoints" / "latest.json").read_text())
    return torch.load(run / "checkpoints" / manifest["file"], weights_only=True)


@pytest.mark.parametrize("shard", ["grads", "params"])
def test_dp2_sharded_resume_continues_the_unsharded_run_bitwise(runs, tmp_path, shard):
    """parallel.shard=grads (rlalign.train.sharding) and parallel.shard=params (the weights too, gathered per
    decoder layer: rlalign.train.weight_shards; the rollout engine on a whole copy) resume the unsharded dp=2 run's
    step-1 checkpoint and end with its bits: weights and metrics; the step-2 checkpoint (a main file with the whole
    weights + one part per rank), read as an unsharded run reads it (any parallel.dp), is the unsharded run's;
    `rlalign export` makes the same model."""
    run = tmp_path / "dp2shard"
    shutil.copytree(runs["dp2"], run)
    _rewind(run, 1)
    _ok(_train(run, "parallel.dp=2", f"parallel.shard={shard}", "run.resume=true"))
    assert _weights(run) == _weights(runs["dp2"])
    assert _metrics(run) == _metrics(runs["dp2"])
    assert sorted(p.name for p in (run / "checkpoints").glob("step_000002*")) == [
        "step_000002.pt", "step_000002.rank0.pt", "step_000002.rank1.pt"]
    got, want = with_parts(run, _checkpoint(run), sharded=False), _checkpoint(runs["dp2"])
    assert got["step"] == want["step"] == 2
    for key in ("model", "optimizer", "schedule"):
        assert_same_state(got[key], want[key], key)
    exported = subprocess.run([sys.executable, "-m", "rlalign.cli.main", "export", str(run), str(tmp_path / "hf")],
                              capture_output=True, text=True, timeout=300, env=ONE_THREAD)
    _ok(exported)
    assert_same_state(load_file(tmp_path / "hf" / "model.safetensors"),
                      load_file(runs["dp2"] / "policy" / "model.safetensors"), "exported")


def assert_same_state(got, want, where: str) -> None:
    """Nested dicts / lists of tensors and plain values: the same keys, raw-bit equal tensors."""
    if isinstance(want, torch.Tensor):
        assert_bitwise_equal(got, want, where)
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            assert_same_state(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for k, (a, b) in enumerate(zip(got, want)):
            assert_same_state(a, b, f"{where}[{k}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("extra, message", [
    (["parallel.tp=3"], "tp must be 1, 2, 4 or 8"),
    (["parallel.dp=2", "launcher=ray"], "launcher=local"),
    (["parallel.tp=2", "algo.advantage=gae"], "value model"),
    (["parallel.tp=2", "model.device=cuda:1"], "use model.device=cuda (rank r takes GPU r"),
])
def test_parallel_config_errors_are_one_line(tmp_path, extra, message):
    proc = _train(tmp_path / "x", *extra)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
