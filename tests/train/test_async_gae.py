"""PPO with a value model (algo.advantage=gae) in asynchronous steps: V-trace value targets and trace-corrected GAE
advantages from the exact ``prox - behav`` log-probs (rlalign.algos.vtrace_gae). At k = 1 the behaviour log-probs
verify bit for bit and the losses are finite; with the asynchronous machinery and no lookahead (every ratio exactly
1) the run is the synchronous GAE run bit for bit: value loss, every metric, policy and value weights."""

import math

import torch

from rlalign.train.loop import run_training
from rlalign.train.run.metrics import read_metrics
from tests.train.test_async_steps import VOLATILE, _cfg, sync_and_k0_async

GAE = ("algo.advantage=gae", "algo.value_lr=0.05")


def test_k1_gae_verifies_the_behaviour_log_probs_and_trains(arithmetic_model_dir, tmp_path):
    run_training(_cfg(arithmetic_model_dir, tmp_path / "run", 3, *GAE, "rollout.async_steps=1",
                      "run.verify_behaviour=true", "run.on_mismatch=stop", "algo.vtrace_c_cap=0.9"))
    records = read_metrics(tmp_path / "run")[1:]
    assert len(records) == 3
    assert all(r["verify/behaviour_mismatch"] == 0 and r["verify/behaviour_tokens"] > 0 for r in records)
    assert all(math.isfinite(r["loss/value"]) and math.isfinite(r["loss/policy"]) for r in records)
    assert [r["offpolicy/staleness_max"] for r in records] == [0, 1, 1]
    assert any(r["loss/value"] > 0 for r in records)


def test_async_gae_without_lookahead_is_the_synchronous_gae_run_bit_for_bit(arithmetic_model_dir, tmp_path):
    """k = 0 through the asynchronous source: prox == behav bit for bit, so every V-trace ratio is exactly 1 and the
    value targets, value loss and advantages are the synchronous GAE run's."""
    sync, piped = sync_and_k0_async(arithmetic_model_dir, tmp_path, *GAE)
    try:
        value_moved = 0
        for step in (1, 2, 3):
            a, b = sync.train_step(step), piped.train_step(step)
            sync.step = piped.step = step
            assert b["offpolicy/weight_min"] == b["offpolicy/weight_max"] == 1.0
            common = sorted(k for k in a if k in b and not k.startswith(VOLATILE) and k != "weights_version")
            assert "loss/value" in common
            assert {k: a[k] for k in common} == {k: b[k] for k in common}, step
            value_moved += a["loss/value"] > 0
        assert value_moved >= 2
        for mine, theirs in ((sync.policy, piped.policy), (sync.update.value, piped.update.value)):
            for (name, p), (_, q) in zip(mine.named_parameters(), theirs.named_parameters()):
                assert torch.equal(p, q), name
    finally:
        for trainer in (sync, piped):
            trainer.close()
            trainer.run_lock.release()
