"""``launcher=ray`` on a real local Ray cluster: the run equals the single-process run bit for bit, and a
rollout worker killed mid-run stops the run with one clear error and its last checkpoint intact."""

import json
import os
import shutil
import threading
import time

import pytest
ray = pytest.importorskip("ray")  # a test extra; machines without it (the GPU image) skip
import torch

from rlalign.configlib import load_config
from rlalign.integrations.ray import run_training_on_ray
from rlalign.integrations.ray.compare import metric_differences, weight_differences
from rlalign.integrations.ray.errors import ActorDiedError
from rlalign.integrations.ray.pool import WORKER_NAME_PREFIX, even_shards
from rlalign.models.checkpoint import load_model
from rlalign.rollout.config import RolloutConfig, SamplingParams
from rlalign.rollout.engine import RolloutEngine
from rlalign.train.config import TrainConfig
from rlalign.train.loop import run_training
from rlalign.train.run.checkpoint_files import load_latest_checkpoint
from rlalign.train.run.metrics import read_metrics
from rlalign.train.setup import DEFAULT_MODEL_DIR
from tests.bitwise import assert_bitwise_equal

os.environ.setdefault("RAY_AUTH_MODE", "disabled")   # a throw-away local cluster needs no auth token file
# Ray kills workers when the whole node is short of memory, whoever uses it; on a shared machine that
# would fail these tests for reasons outside them.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")

STEPS = 3                                           # a few steps of the default config (32 prompts x 8 samples)


def _cfg(run_dir, *overrides):
    return load_config(TrainConfig, None, [f"run.dir={run_dir}", f"run.steps={STEPS}", "run.progress=false",
                                           *overrides])


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    return run_training(_cfg(tmp_path_factory.mktemp("local") / "run"))


def test_even_shards_cover_every_prompt_once():
    assert even_shards(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert even_shards(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_sharded_generate_equals_one_engine():
    """What the pool relies on: prompts split across engines, each keeping its global prompt index, give
    the one engine's completions bit for bit (tokens, logprobs, seeds)."""
    model, _ = load_model(DEFAULT_MODEL_DIR)
    prompts = [[5 + i, 9, 12 + i % 3] for i in range(7)]
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=123)
    whole = RolloutEngine(model, RolloutConfig()).generate(prompts, sampling)
    parts = [RolloutEngine(model, RolloutConfig()).generate(prompts[lo:hi], sampling,
                                                            prompt_indices=list(range(lo, hi)))
             for lo, hi in even_shards(len(prompts), 3)]
    split = [c for part in parts for c in part]
    assert [(c.prompt_index, c.sample_index, c.seed, c.tokens) for c in split] == \
        [(c.prompt_index, c.sample_index, c.seed, c.tokens) for c in whole]
    assert_bitwise_equal(torch.tensor([x for c in split for x in c.logprobs]),
                         torch.tensor([x for c in whole for x in c.logprobs]), "sharded logprobs")


def test_worker_refuses_an_engine_without_prompt_indices(monkeypatch):
    """Such an engine would re-key every sample's seed by its position in the shard: refused, not resampled."""
    from rlalign.integrations.ray.errors import RayLaunchError
    from rlalign.integrations.ray.worker import RolloutWorker
    from rlalign.train import engines

    class PositionalEngine:
        weights_version = 0

        def generate(self, prompts, sampling):
            return []

    monkeypatch.setitem(engines.ENGINES, "positional", lambda *args: PositionalEngine())
    worker = RolloutWorker(load_config(TrainConfig, None, ["rollout.engine=positional", "launcher=ray"]), 0, 1)
    with pytest.raises(RayLaunchError, match="rollout.engine=positional cannot run under launcher=ray"):
        worker.ready()
    assert RolloutWorker(load_config(TrainConfig, None, ["launcher=ray"]), 1, 1).ready() == 1


@pytest.mark.parametrize("sync,workers", [("object_store", 2), ("broadcast", 3)])
def test_ray_run_equals_single_process_run(single_process_run, tmp_path, sync, workers):
    run_dir = run_training_on_ray(_cfg(tmp_path / "run", "launcher=ray", f"ray.weight_sync={sync}",
                                       f"ray.num_rollout_workers={workers}"))
    assert not ray.is_initialized(), "the launcher stops the local cluster it started"
    assert len(read_metrics(run_dir)) == STEPS + 1
    assert metric_differences(run_dir, single_process_run) == []   # every field but time/*, tokens_per_s/*, memory/*
    ours = load_model(run_dir / "policy")[0].state_dict()
    theirs = load_model(single_process_run / "policy")[0].state_dict()
    assert list(ours) == list(theirs)
    for name in theirs:
        assert_bitwise_equal(ours[name], theirs[name], f"final weights {name}")
    assert weight_differences(run_dir, single_process_run) == []


def test_compare_reports_a_changed_metric_and_weight(single_process_run, tmp_path):
    from safetensors.torch import load_file, save_file
    copy = tmp_path / "copy"
    shutil.copytree(single_process_run, copy)
    records = read_metrics(copy)
    records[1]["reward/mean"] += 1e-7
    records[1]["time/rollout_s"] += 1.0   # timings are not compared
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    weights = load_file(copy / "policy" / "model.safetensors")
    name = sorted(weights)[0]
    weights[name].view(-1)[3] = torch.nextafter(weights[name].view(-1)[3], torch.tensor(1e9))
    save_file(weights, copy / "policy" / "model.safetensors")
    assert [d.split(":")[0] for d in metric_differences(copy, single_process_run)] == ["step 1 reward/mean"]
    assert weight_differences(copy, single_process_run) == [
        f"policy {name}: first differing element 3: {weights[name].view(-1)[3].item()!r} vs "
        f"{load_file(single_process_run / 'policy' / 'model.safetensors')[name].view(-1)[3].item()!r}"]


def test_killed_worker_stops_the_run_with_its_checkpoint_intact(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(TrainConfig, None, [f"run.dir={run_dir}", "run.steps=500", "run.progress=false",
                                          "run.checkpoint_every=2", "run.eval_every=1000", "rollout.prompts_per_step=8",
                                          "launcher=ray"])
    killed = []
    killer = threading.Thread(target=_kill_worker_after_step, args=(run_dir, 3, 1, killed), daemon=True)
    killer.start()
    with pytest.raises(ActorDiedError) as info:
        run_training_on_ray(cfg)
    killer.join(timeout=60)
    assert killed, "no worker was killed: the run ended first"
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"rollout worker 1 of 2 (Ray actor {killed[0]}) died during "), msg
    state = load_latest_checkpoint(run_dir)      # checks the file against its sha256
    assert state is not None and state["step"] >= 2 and state["step"] % 2 == 0
    assert f"the last checkpoint (step {state['step']} in {run_dir}/checkpoints) is intact" in msg
    assert f"run.dir={run_dir} run.resume=true" in msg
    assert not ray.is_initialized()


def _kill_worker_after_step(run_dir, step, index, killed):
    """Once ``metrics.jsonl`` shows ``step``, kill rollout worker ``index`` (a real ``ray.kill``: the process dies)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:
        if metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()
                                    if line.endswith("}")):
            break
        time.sleep(0.05)
    names = [n for n in ray.util.list_named_actors() if n.startswith(f"{WORKER_NAME_PREFIX}{index}-")]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]), no_restart=True)
    killed.append(names[0])
