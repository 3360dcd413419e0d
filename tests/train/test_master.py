"""fp32 master weights: low-precision training tracks fp32 (where stepping bf16 directly stalls), one
stated rounding from master to model, fp32 runs untouched, masters saved and restored bitwise."""

import pytest
import torch

from rlalign.configlib import load_config
from rlalign.train.config import TrainConfig
from rlalign.train.loop import Trainer
from rlalign.train.master import MasterWeights
from rlalign.train.runio import load_latest_checkpoint
from tests.bitwise import assert_bitwise_equal
from tests.train.conftest import tiny_overrides

# Relative tolerance of the tracking test: |w_bf16 - w_fp32| / |w_fp32 - w_0| after many small steps.
# The residual comes from the bf16 forward (gradients of bf16 weights), not from lost updates (measured 1.3%).
TRACKING_TOL = 0.05


def _small_lr_trajectory(dtype, master: bool, steps=300, lr=1e-5, seed=0, offload=False):
    """AdamW on 0.5 |w - target|^2 with the gradient computed in the model's dtype (as a bf16 backward does)."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(64, 64, generator=g) * 0.02
    target = w0 + 0.01 * torch.randn(64, 64, generator=g)
    layer = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w0)
    layer.to(dtype)
    mw = MasterWeights(layer, enabled=master, offload=offload)
    opt = torch.optim.AdamW(mw.optim_params(), lr=lr, weight_decay=0.0, foreach=False)
    for _ in range(steps):
        layer.weight.grad = layer.weight.detach() - target.to(dtype)
        mw.grads_to_master()
        opt.step()
        mw.master_to_model()
    return w0, layer.weight.detach(), mw


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_with_masters_tracks_fp32_where_plain_bf16_stalls(seed):
    w0, ref, _ = _small_lr_trajectory(torch.float32, master=True, seed=seed)
    _, model, mw = _small_lr_trajectory(torch.bfloat16, master=True, seed=seed)
    _, stalled, _ = _small_lr_trajectory(torch.bfloat16, master=False, seed=seed)
    moved = (ref - w0).norm()
    master = mw.masters[0].detach()
    assert (master - ref).norm() / moved < TRACKING_TOL
    assert (model.float() - ref).norm() / moved < TRACKING_TOL
    # the defect this fixes: stepping the bf16 weights directly loses most of the trajectory
    assert (stalled.float() - ref).norm() / moved > 0.5
    # the model copy is the round-to-nearest-even cast of the master, bit for bit
    assert_bitwise_equal(model, master.to(torch.bfloat16))


def test_offload_gives_the_same_bits():
    """optim.offload only moves the masters and the optimizer state (here CPU to CPU: the same arithmetic)."""
    _, a, _ = _small_lr_trajectory(torch.bfloat16, master=True, steps=20)
    _, b, mw = _small_lr_trajectory(torch.bfloat16, master=True, steps=20, offload=True)
    assert mw.masters[0].device.type == "cpu"
    assert_bitwise_equal(a, b)


def test_fp32_parameters_get_no_master():
    layer = torch.nn.Linear(8, 8)
    mw = MasterWeights(layer)
    assert not mw.active and all(a is b for a, b in zip(mw.optim_params(), layer.parameters()))
    offloaded = MasterWeights(layer, offload=True)   # offload keeps an fp32 CPU master of every parameter
    assert offloaded.active and all(m.device.type == "cpu" and m.dtype == torch.float32 for m in offloaded.masters)


def test_bf16_trainer_steps_masters_and_resumes_them_bitwise(arithmetic_model_dir, tmp_path):
    over = tiny_overrides(arithmetic_model_dir, tmp_path / "run", steps=1, dense_reward=True) + [
        "model.dtype=bfloat16", "optim.lr=1e-6", "optim.warmup_steps=1"]
    trainer = Trainer(load_config(TrainConfig, None, over))
    trainer.resume_if_asked()
    before = [m.detach().clone() for m in trainer.master.masters]
    assert all(m is not None and m.dtype == torch.float32 for m in before)
    record = trainer.train_step(1)
    trainer.step = 1
    assert record["grad_norm"] > 0 and record["mismatch/count"] == 0
    changed = sum(int((m.detach() != b).sum()) for m, b in zip(trainer.master.masters, before))
    total = sum(b.numel() for b in before)
    assert changed / total > 0.5, f"only {changed} of {total} master weights moved at lr 1e-6"
    for (name, p), m in zip(trainer.master.named, trainer.master.masters):
        assert_bitwise_equal(p.detach(), m.detach().to(torch.bfloat16), name)
    trainer.save()
    saved = load_latest_checkpoint(tmp_path / "run")
    assert set(saved["master"]) == {n for n, _ in trainer.master.named}
    trainer.run_lock.release()   # the run ends here; the resumed trainer takes the run directory

    resumed = Trainer(load_config(TrainConfig, None, over + ["run.resume=true", "run.steps=2"]))
    resumed.resume_if_asked()
    for a, b in zip(trainer.master.masters, resumed.master.masters):
        assert_bitwise_equal(a.detach(), b.detach())
    for (name, p), (_, q) in zip(trainer.master.named, resumed.master.named):
        assert_bitwise_equal(p.detach(), q.detach(), name)
