"""fp32 master weights: low-precision training tracks fp32 (where stepping bf16 directly stalls), one
stated rounding from master to model, fp32 runs untouched, masters saved and restored bitwise."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.configlib import load_config
from rlalign.contract.errors import RLAlignError
from rlalign.models.checkpoint import load_model
from rlalign.train.config import TrainConfig
from rlalign.train.loop import Trainer
from rlalign.train.master import DEFAULT_STEP_CHUNK, MasterWeights
from rlalign.train.parallel import clip_grad_norm_
from rlalign.train.run.checkpoint_files import load_latest_checkpoint
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


# ---- the per-parameter optimizer step (MasterWeights.step) -------------------------------------------

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=2).map(tuple)   # scalars and 0-element tensors too


def _params_module(specs, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    module.ps = torch.nn.ParameterList(torch.nn.Parameter((torch.randn(shape, generator=g) * 0.1).to(device, _DTYPES[d]))
                                       for shape, d in specs)
    return module


def _stepped(specs, offload, clip, steps, seed, per_parameter, chunk=DEFAULT_STEP_CHUNK, masters=True, device="cpu"):
    """The trainer's step on ``specs`` (shape, dtype) parameters: clip the model's gradients, then the
    per-parameter step (in chunks of ``chunk`` elements) or the all-at-once reference (grads_to_master,
    optimizer.step(), master_to_model)."""
    module = _params_module(specs, seed, device)
    mw = MasterWeights(module, enabled=masters, offload=offload, chunk_elements=chunk)
    opt = torch.optim.AdamW(mw.optim_params(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(seed + 1)
    norms = []
    for step in range(steps):
        for i, p in enumerate(module.ps):
            grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
            p.grad = None if (i + step) % 3 == 2 else grad   # some parameters get no gradient at some steps
        norms.append(clip_grad_norm_(module, 0.05) if clip else None)
        if per_parameter:
            mw.step(opt)
        else:
            mw.grads_to_master()
            opt.step()
            mw.master_to_model()
    return module, mw, opt, norms


def _assert_same_step(specs, offload, clip, seed, chunk=DEFAULT_STEP_CHUNK, masters=True, device="cpu"):
    a_mod, a_mw, a_opt, a_norms = _stepped(specs, offload, clip, 3, seed, True, chunk, masters, device)
    b_mod, b_mw, b_opt, b_norms = _stepped(specs, offload, clip, 3, seed, False, chunk, masters, device)
    for i, (p, q, m) in enumerate(zip(a_mod.ps, b_mod.ps, a_mw.masters)):
        assert_bitwise_equal(p.detach(), q.detach(), f"weight {i}")
        assert p.grad is None or m is None, "the step frees the gradient of every parameter with a master"
    for i, (m, n) in enumerate(zip(a_mw.masters, b_mw.masters)):
        assert (m is None) == (n is None)
        if m is not None:
            assert_bitwise_equal(m.detach(), n.detach(), f"master {i}")
            assert m.grad is None
    sa, sb = a_opt.state_dict()["state"], b_opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for index in sa:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(sa[index][key], sb[index][key], f"AdamW {key} of parameter {index}")
    for x, y in zip(a_norms, b_norms):
        if x is not None:
            assert_bitwise_equal(x, y, "grad norm")


@settings(max_examples=25, deadline=None)
@given(specs=st.lists(st.tuples(_shapes, st.sampled_from(sorted(_DTYPES))), min_size=1, max_size=4),
       offload=st.booleans(), clip=st.booleans(), seed=st.integers(0, 2**16))
def test_per_parameter_step_equals_the_all_at_once_step_bitwise(specs, offload, clip, seed):
    """Masters, model weights, AdamW state and grad norms after 3 steps: the same bits either way, for
    bf16/fp16/fp32 parameters (fp32 ones have no master without offload), gradients missing at some
    steps, with and without clipping."""
    _assert_same_step(specs, offload, clip, seed)


_sizes = st.integers(0, 3000)   # flat sizes: 0 elements, 1, around SIMD widths and thread splits, a few pages


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(_sizes, min_size=1, max_size=3), dtype=st.sampled_from(sorted(_DTYPES)),
       chunk=st.one_of(st.integers(1, 9), st.integers(10, 4000)), offload=st.booleans(), masters=st.booleans(),
       seed=st.integers(0, 2**16))
def test_chunked_step_equals_the_whole_parameter_step_bitwise(sizes, dtype, chunk, offload, masters, seed):
    """The step in chunks of any size (1 element, a divisor, a non-divisor, larger than the parameter) gives
    the bits of the unchunked all-at-once step: masters, weights, AdamW step/m/v; with and without masters
    (without: the parameters themselves are stepped chunk by chunk, in their own dtype)."""
    specs = [((n,), dtype) for n in sizes] + [((3, max(sizes) // 3 + 1), dtype)]   # a 2-D one too
    _assert_same_step(specs, offload, clip=True, seed=seed, chunk=chunk, masters=masters)


def test_clipping_case_clips():
    """The clipped variant of the equivalence test really scales the gradients (the norm is above 0.05)."""
    _, _, _, norms = _stepped([((5, 5), "bf16"), ((5,), "fp32")], offload=True, clip=True, steps=3, seed=0,
                              per_parameter=True)
    assert all(float(n) > 0.5 for n in norms)


@pytest.mark.parametrize("chunk", [32_771, 65_536])
def test_chunked_step_equals_the_whole_step_across_thread_splits(chunk):
    """A parameter large enough for torch's CPU kernels to split it across threads (grain 32,768 elements),
    chunked at a prime and at a power of two: the same bits as the unchunked step."""
    _assert_same_step([((100_003,), "bf16"), ((70_000,), "fp32")], offload=False, clip=True, seed=3, chunk=chunk)


@pytest.mark.parametrize("offload", [False, True])
def test_step_widens_one_chunk_at_a_time(monkeypatch, offload):
    """The working set is one chunk: AdamW's arithmetic gets at most ``chunk_elements`` widened fp32 gradient
    elements per call, parameter after parameter, and no master ever holds a whole widened gradient."""
    import rlalign.train.master as master_mod
    module = _params_module([((4, 4), "bf16"), ((3,), "bf16"), ((2, 5), "fp32")], seed=0)
    mw = MasterWeights(module, offload=offload, chunk_elements=4)
    opt = torch.optim.AdamW(mw.optim_params(), foreach=False)
    seen = []
    real = master_mod.adam_arithmetic

    def recording(params, grads, *args, **kw):
        seen.append((grads[0].numel(), grads[0].dtype, [m.grad is not None for m in mw.masters if m is not None]))
        return real(params, grads, *args, **kw)

    monkeypatch.setattr(master_mod, "adam_arithmetic", recording)
    for p in module.ps:
        p.grad = torch.ones_like(p)
    mw.step(opt)
    assert [n for n, _, _ in seen] == [4, 4, 4, 4, 3, 4, 4, 2]
    assert all(dtype == torch.float32 and not any(held) for _, dtype, held in seen)
    assert all(p.grad is None for p in module.ps)


def test_step_refuses_an_optimizer_it_does_not_reproduce():
    module = _params_module([((4,), "bf16")], seed=0)
    mw = MasterWeights(module)
    module.ps[0].grad = torch.ones(4, dtype=torch.bfloat16)
    for opt in (torch.optim.SGD(mw.optim_params(), lr=0.1), torch.optim.AdamW(mw.optim_params(), foreach=True),
                torch.optim.AdamW(mw.optim_params()), torch.optim.AdamW(mw.optim_params(), foreach=False, amsgrad=True)):
        with pytest.raises(RLAlignError, match="AdamW"):
            mw.step(opt)
    with pytest.raises(RLAlignError, match="step_chunk_elements"):
        MasterWeights(module, chunk_elements=0)


# ---- checkpoints of a bf16 run with offloaded masters: streamed, weights derived, resumed bitwise ------

def _offload_over(model_dir, run_dir, steps, *extra):
    return tiny_overrides(model_dir, run_dir, steps=steps, dense_reward=True) + [
        "model.dtype=bfloat16", "optim.lr=1e-3", "optim.warmup_steps=1", "optim.offload=true", *extra]


def _trained(over, steps):
    trainer = Trainer(load_config(TrainConfig, None, over))
    trainer.resume_if_asked()
    records = []
    for step in range(trainer.step + 1, steps + 1):
        records.append(trainer.train_step(step))
        trainer.step = step
    return trainer, records


def _assert_same_training_state(a: Trainer, b: Trainer) -> None:
    for (name, p), (_, q) in zip(a.master.named, b.master.named):
        assert_bitwise_equal(p.detach(), q.detach(), name)
    for (name, _), m, n in zip(a.master.named, a.master.masters, b.master.masters):
        assert_bitwise_equal(m.detach(), n.detach(), f"master {name}")
    sa, sb = a.update.optimizer.state_dict()["state"], b.update.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and len(sa) == len(a.master.named)
    for index in sa:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(sa[index][key], sb[index][key], f"AdamW {key} of parameter {index}")


def _mapped(path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(str(path)) for line in f)


def test_offloaded_resume_from_a_streamed_checkpoint_is_bitwise(arithmetic_model_dir, tmp_path):
    import gc
    import shutil

    from rlalign.train.export import export_checkpoint
    from rlalign.train.master import ROUNDED_KEY, checkpoint_model_weights
    from rlalign.train.run.checkpoint_files import file_sha256

    full, full_records = _trained(_offload_over(arithmetic_model_dir, tmp_path / "full", 2), 2)
    full.run_lock.release()
    assert all(r["grad_norm"] > 0 and r["mismatch/count"] == 0 for r in full_records)

    cut, _ = _trained(_offload_over(arithmetic_model_dir, tmp_path / "cut", 2), 1)
    cut.save()
    cut.run_lock.release()
    ckpt = tmp_path / "cut" / "checkpoints" / "step_000001.pt"
    saved = load_latest_checkpoint(tmp_path / "cut")
    names = {n for n, _ in cut.master.named}
    # the bf16 weights are stored once, as their fp32 masters; derived on load with the run's rounding
    assert not names & set(saved["model"]) and saved[ROUNDED_KEY] == {n: "bfloat16" for n in names}
    derived = checkpoint_model_weights(saved)
    for name, p in cut.master.named:
        assert_bitwise_equal(derived[name], p.detach(), name)
    exported, _ = load_model(export_checkpoint(ckpt, tmp_path / "hf"))
    for name, p in cut.master.named:
        assert_bitwise_equal(dict(exported.named_parameters())[name].detach(), p.detach(), f"exported {name}")

    # a checkpoint of the earlier format (every weight stored, no model_rounded) resumes to the same bits
    old_dir = tmp_path / "old"
    shutil.copytree(tmp_path / "cut", old_dir, ignore=shutil.ignore_patterns(".lock"))
    old_state = {**{k: v for k, v in saved.items() if k != ROUNDED_KEY}, "model": derived}
    torch.save(old_state, old_dir / "checkpoints" / ckpt.name)
    manifest_path = old_dir / "checkpoints" / "latest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["sha256"] = file_sha256(old_dir / "checkpoints" / ckpt.name)
    manifest_path.write_text(json.dumps(manifest))
    del saved, derived, old_state
    gc.collect()

    resumed = Trainer(load_config(TrainConfig, None, _offload_over(arithmetic_model_dir, tmp_path / "cut", 2,
                                                                   "run.resume=true")))
    resumed.resume_if_asked()
    gc.collect()
    assert not _mapped(ckpt), "the resumed state still maps the checkpoint file (its disk space would stay held)"
    _assert_same_training_state(resumed, cut)
    from_old, _ = _trained(_offload_over(arithmetic_model_dir, old_dir, 2, "run.resume=true"), 1)
    from_old.run_lock.release()
    _assert_same_training_state(from_old, cut)

    record = resumed.train_step(2)
    resumed.step = 2
    resumed.run_lock.release()
    _assert_same_training_state(resumed, full)
    volatile = ("time/", "tokens_per_s/", "memory/")
    assert {k: v for k, v in record.items() if not k.startswith(volatile)} == \
        {k: v for k, v in full_records[1].items() if not k.startswith(volatile)}


def test_weights_stored_only_as_masters_need_masters_on_load():
    layer = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    without = MasterWeights(layer, enabled=False)
    with pytest.raises(RLAlignError, match="only as its fp32 master, but this run has no master for it"):
        without.load_state_dict({"weight": torch.zeros(4, 4)}, {"weight": "bfloat16"})
    with_masters = MasterWeights(layer)
    with pytest.raises(RLAlignError, match="the bfloat16 rounding of its master, but the model holds float16"):
        MasterWeights(torch.nn.Linear(4, 4, bias=False).to(torch.float16)).load_state_dict(
            {"weight": torch.zeros(4, 4)}, {"weight": "bfloat16"})
    with pytest.raises(RLAlignError, match="holds no masters"):
        with_masters.load_state_dict(None, {"weight": "bfloat16"})
