"""The colocated rollout engine sharing the policy's weight tensors (``rollout.share_weights``,
rlalign.train.engines): no copy, updated in place by the optimizer step, the same metrics bit for bit as
the copy path (fresh and resumed), a reallocated parameter refused, and the copy kept where sharing is
impossible."""

import pytest
import torch

from rlalign.configlib import load_config
from rlalign.integrations.ray.compare import metric_differences, weight_differences
from rlalign.train.config import TrainConfig
from rlalign.train.engines import ENGINES, WeightsSharingError, weights_path
from rlalign.train.loop import Trainer, run_training
from rlalign.train.run.metrics import read_metrics
from tests.train.conftest import tiny_overrides


COPY_MB = "memory/engine_weight_copy_mb"   # the path a run took: 0 when the engine shares the policy's tensors


def _over(model_dir, run_dir, steps, share, *extra):
    return tiny_overrides(model_dir, run_dir, steps=steps, dense_reward=True) + [
        f"rollout.share_weights={share}", "optim.warmup_steps=1", *extra]


def _trainer(model_dir, run_dir, share, *extra):
    trainer = Trainer(load_config(TrainConfig, None, _over(model_dir, run_dir, 1, share, *extra)))
    trainer.resume_if_asked()
    return trainer


@pytest.mark.parametrize("dtype,profile", [("float32", "strict"), ("bfloat16", "strict"), ("bfloat16", "native")])
def test_shared_engine_steps_the_policys_own_tensors(arithmetic_model_dir, tmp_path, dtype, profile):
    """Unset (null) shares: every engine parameter IS the policy's (same object, same storage); the engine has its
    own modules; after a training step (bf16: fp32 masters rounded into the weights) nothing was copied and
    both still hold the same storage, with the stepped values."""
    trainer = _trainer(arithmetic_model_dir, tmp_path / "run", "null", f"model.dtype={dtype}", f"run.profile={profile}")
    try:
        assert trainer.weight_sync.shared
        engine_params = dict(trainer.engine.model.named_parameters())
        addresses = {}
        for name, p in trainer.policy.named_parameters():
            assert engine_params[name] is p, name
            addresses[name] = p.data_ptr()
        assert trainer.engine.model is not trainer.policy and not trainer.engine.model.training
        before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
        for step in (1, 2, 3):   # until a step has a non-zero advantage (a group whose rewards differ)
            record = trainer.train_step(step)
            trainer.step = step
            assert record[COPY_MB] == 0
            assert record["mismatch/count"] == 0 or profile == "native"   # native: vendor kernels, no bitwise contract
            if record["grad_norm"] > 0:
                break
        moved = sum(int((p.detach() != before[n]).sum()) for n, p in trainer.policy.named_parameters())
        assert moved > 0, "no step changed a weight: the test would prove nothing"
        for name, p in trainer.engine.model.named_parameters():
            assert p.data_ptr() == addresses[name], f"{name} was reallocated by the step"
        assert trainer.engine.weights_version == step
    finally:
        trainer.run_lock.release()


def test_copy_path_keeps_its_own_tensors(arithmetic_model_dir, tmp_path):
    trainer = _trainer(arithmetic_model_dir, tmp_path / "run", "false")
    try:
        assert not trainer.weight_sync.shared
        engine_params = dict(trainer.engine.model.named_parameters())
        for name, p in trainer.policy.named_parameters():
            assert engine_params[name] is not p and engine_params[name].data_ptr() != p.data_ptr(), name
        copy_mb = sum(p.numel() * p.element_size() for p in trainer.policy.parameters()) / 2**20
        assert trainer.train_step(1)[COPY_MB] == copy_mb > 0
    finally:
        trainer.run_lock.release()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_run_gives_the_copy_runs_metrics_bitwise_also_resumed(arithmetic_model_dir, tmp_path, dtype):
    """4 steps with the copy vs a shared run stopped after step 2 (run.stop_at_step) and resumed to 4 (bf16:
    masters, a step chunked at 100 elements): every metric value equal (JSON floats round-trip exactly),
    evals included, and the exported weights' bits, as `python -m rlalign.integrations.ray.compare` (the GPU
    resume proof's checker) says."""
    extra = [f"model.dtype={dtype}", "run.eval_every=2"] + (["optim.step_chunk_elements=100"] if dtype == "bfloat16" else [])
    copied = run_training(load_config(TrainConfig, None, _over(arithmetic_model_dir, tmp_path / "copy", 4, "false", *extra)))
    shared_dir = tmp_path / "shared"
    run_training(load_config(TrainConfig, None, _over(arithmetic_model_dir, shared_dir, 4, "true", *extra,
                                                      "run.stop_at_step=2")))
    assert [r["step"] for r in read_metrics(shared_dir)] == [0, 1, 2]
    run_training(load_config(TrainConfig, None, _over(arithmetic_model_dir, shared_dir, 4, "true", *extra,
                                                      "run.resume=true", "run.stop_at_step=null")))
    a, b = read_metrics(copied), read_metrics(shared_dir)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert all(r[COPY_MB] > 0 for r in a[1:]) and all(r[COPY_MB] == 0 for r in b[1:])
    assert metric_differences(copied, shared_dir) == []
    assert weight_differences(copied, shared_dir) == []
    assert sum(r["grad_norm"] > 0 for r in a if "grad_norm" in r) >= 3


def test_reallocated_parameter_stops_the_shared_run(arithmetic_model_dir, tmp_path):
    """Rebinding a parameter's storage (``p.data = ...``) would leave the engine (and its CUDA graphs) reading
    the old memory: the next sync refuses it with the parameter named."""
    trainer = _trainer(arithmetic_model_dir, tmp_path / "run", "null")
    try:
        p = trainer.policy.model.layers[0].mlp.down_proj.weight
        p.data = p.data.clone()
        with pytest.raises(WeightsSharingError, match="model.layers.0.mlp.down_proj.weight was reallocated"):
            trainer.weight_sync.push(lambda: {}, version=1)
    finally:
        trainer.run_lock.release()


@pytest.mark.parametrize("extra,reason", [
    (["parallel.tp=1"], "parallel.tp shards the policy"),
    (["rollout.engine=other"], "rollout.engine=other keeps its weights"),
    (["launcher=ray"], "launcher=ray runs the engines in other processes"),
])
def test_sharing_is_refused_where_impossible_and_unset_copies(extra, reason, monkeypatch):
    monkeypatch.setitem(ENGINES, "other", lambda *args: None)   # another engine (e.g. vLLM's), registered
    unset = weights_path(load_config(TrainConfig, None, extra))
    assert not unset.shared and reason in unset.reason and reason in unset.describe()
    with pytest.raises(WeightsSharingError, match=f"rollout.share_weights=true, but {reason}"):
        weights_path(load_config(TrainConfig, None, extra + ["rollout.share_weights=true"]))
    assert not weights_path(load_config(TrainConfig, None, ["rollout.share_weights=false"])).shared
    assert weights_path(load_config(TrainConfig, None, [])).shared


def test_share_weights_setting_is_checked():
    from rlalign.configlib import ConfigError
    with pytest.raises(ConfigError, match="share_weights"):
        load_config(TrainConfig, None, ["rollout.share_weights=sometimes"])


def shared_engine_sees_in_place_steps(device: str, graphs: str, dtype: str = "bfloat16"):
    """An engine on :func:`shared_module` of a policy (decode steps through ``graphs``: "padded" on the CPU,
    captured CUDA graphs with "on"), a generate (graphs made), then two AdamW steps through MasterWeights
    (fp32 masters, chunks of 1,000 elements, rounded into the shared tensors in place), each followed by the
    trainer's sync: every generate equals a fresh eager engine's on a deep copy of the updated policy --
    tokens and logprob bits -- so the engine (and any graph it captured) reads the updated weights."""
    import copy

    from rlalign.models.testing import tiny_model
    from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
    from rlalign.train.engines import WeightsPath, WeightSync, shared_module
    from rlalign.train.master import MasterWeights
    from tests.rollout.test_engine_bitwise import assert_same_completions, make_prompts

    policy = tiny_model("qwen3", seed=0, dtype=dtype, device=device, init_std=0.1).train()
    config = lambda mode: RolloutConfig(num_pages=64, decode_graphs=mode)  # noqa: E731
    engine = RolloutEngine(shared_module(policy).eval(), config(graphs))
    sync = WeightSync(engine, policy, WeightsPath(True, "test"))
    master = MasterWeights(policy, chunk_elements=1000)
    opt = torch.optim.AdamW(master.optim_params(), lr=3e-2, foreach=False)
    prompts, sampling = make_prompts(7), SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5)
    gen = torch.Generator(device=device).manual_seed(1)
    for version in range(3):
        if version:
            for p in policy.parameters():
                p.grad = torch.randn(p.shape, generator=gen, device=device).to(p.dtype)
            master.step(opt)
            sync.push(lambda: {}, version=version)
        got = engine.generate(prompts, sampling)
        fresh = RolloutEngine(copy.deepcopy(policy).eval(), config("off")).generate(prompts, sampling)
        assert_same_completions(got, fresh)
        assert all(c.weights_version == version for c in got)
    return engine, got


def test_shared_engine_with_padded_decode_batches_sees_every_in_place_step():
    engine, got = shared_engine_sees_in_place_steps("cpu", "padded")
    assert engine.counters["graph_steps"] > 0
