"""Training in the portable profile (docs/portable.md): the aten census over whole GRPO steps (rollout, the agreement
check, advantages, forward, backward, loss terms, gradient norm and clip, AdamW, logged statistics) admits only the
profile's arithmetic; zero mismatches; the refusals. The CPU == CUDA run comparison is
tests/cuda/test_cuda_portable_train.py (and ``benchmarks/portable_check.py --train-steps N``)."""

from __future__ import annotations

import pytest
import torch

from rlalign.configlib import load_config
from rlalign.train.config import TrainConfig
from rlalign.train.loop import run_training
from rlalign.train.run.metrics import read_metrics
from tests.ops.test_portable_ops import _Census
from tests.train.conftest import tiny_overrides

# exact beyond the op census's list: min / max reductions and scatters, integer counts, boolean logic, masked copies
EXACT_IN_A_STEP = {"amin", "scatter_reduce", "bincount", "masked_fill_", "logical_and_", "split_with_sizes"}
# not arithmetic: loading a checkpoint's storages, the optimizer's profiler markers
NOT_ARITHMETIC = {"set_", "_record_function_enter_new", "_record_function_exit"}


class _StepCensus(_Census):
    """The op census, plus what a training step may run besides the ops: exact ops, an ``index_add`` whose index
    has no repeated entry (each output row gets one add onto zero: exact, whatever the order; the backward of the
    packed rows' gather), a division by a power of two (exact: torch.maximum's backward halves a tied gradient).
    The model's float64 ``inv_freq`` (rope_inv_freq, computed at load on the host, an assumption of the profile:
    docs/portable.md) is left out."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in EXACT_IN_A_STEP | NOT_ARITHMETIC:
            if name == "scatter_reduce" and args[4] not in ("amin", "amax") and args[0].is_floating_point():
                self.bad[f"{name}.{args[4]}"] += 1   # a float sum / mean / prod scatter would be a reduction
            return func(*args, **(kwargs or {}))
        if name == "index_add" and args[2].unique().numel() == args[2].numel():
            return func(*args, **(kwargs or {}))
        if name in ("div", "div_") and not isinstance(args[1], torch.Tensor) and _power_of_two(float(args[1])):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _power_of_two(x: float) -> bool:
    m, _ = __import__("math").frexp(abs(x))
    return m == 0.5


def _portable(model_dir, run_dir, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, None, tiny_overrides(model_dir, run_dir, steps=2, dense_reward=True)
                       + ["run.profile=portable", *extra])


def test_whole_portable_steps_use_only_portable_arithmetic(arithmetic_model_dir, tmp_path, monkeypatch):
    """Two steps with a KL loss (a reference model) and an entropy bonus, under the census; rope_inv_freq's float64
    host computation at model load is the only code left out."""
    import rlalign.ops as ops
    inv_freq = ops.rope_inv_freq

    def outside_census(*args, **kwargs):
        with census.paused():
            return inv_freq(*args, **kwargs)

    census = _Paused()
    monkeypatch.setattr(ops, "rope_inv_freq", outside_census)
    cfg = _portable(arithmetic_model_dir, tmp_path / "run", "algo.kl_coef=0.01", "algo.entropy_coef=0.01")
    with census:
        run_dir = run_training(cfg)
    assert not census.bad, f"library math or reductions in a portable training step: {dict(census.bad)}"
    steps = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["mismatch/count"] == 0 and r["mismatch/tokens"] > 0 for r in steps)
    assert all(r["grad_norm"] > 0 for r in steps)


class _Paused(_StepCensus):
    """The step census, with a way to leave a call out (``paused()``)."""

    def __init__(self):
        super().__init__()
        self.off = 0

    def paused(self):
        import contextlib

        @contextlib.contextmanager
        def scope():
            self.off += 1
            try:
                yield
            finally:
                self.off -= 1
        return scope()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.off:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_portable_runs_repeat_bit_for_bit_and_differ_from_strict(arithmetic_model_dir, tmp_path):
    """The same config twice: the same metrics and weights; its grad norms close to strict's (other arithmetic)."""
    from benchmarks.run_fingerprint import fingerprint
    a = run_training(_portable(arithmetic_model_dir, tmp_path / "a"))
    b = run_training(_portable(arithmetic_model_dir, tmp_path / "b"))
    assert fingerprint(a, 2) == fingerprint(b, 2)
    strict = run_training(load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / "s", steps=2,
                                                                        dense_reward=True)))
    got = [r["grad_norm"] for r in read_metrics(a) if "grad_norm" in r]
    want = [r["grad_norm"] for r in read_metrics(strict) if "grad_norm" in r]
    assert got == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("override, named", [
    ("model.lora.rank=2", "model.lora"), ("parallel.dp=2", "parallel.dp"), ("optim.offload=true", "optim.offload"),
    ("optim.activation_checkpointing=true", "activation_checkpointing"), ("algo.advantage=gae", "gae"),
    ("rollout.async_steps=1", "async_steps")])
def test_unsupported_combinations_refuse_in_one_line(tmp_path, override, named):
    from rlalign.configlib import ConfigError
    with pytest.raises(ConfigError, match=f"run.profile=portable does not train with .*{named}") as err:
        load_config(TrainConfig, None, [f"run.dir={tmp_path}", "run.profile=portable", override])
    assert "\n" not in str(err.value)


def test_scalar_and_vector_cpu_kernels_give_the_same_portable_run(arithmetic_model_dir, tmp_path):
    """The CPU's stand-in for another device: torch's scalar kernels (``ATEN_CPU_CAPABILITY=default``, no SIMD, so
    no vector FMA contraction or reordering) in a subprocess, MKL's instructions pinned to AVX2, one thread, vs this
    process's own kernels: the same metrics and weights (strict's may not: tests/train/test_across_machines.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    from benchmarks.run_fingerprint import fingerprint
    root = Path(__file__).resolve().parents[2]
    here = run_training(_portable(arithmetic_model_dir, tmp_path / "here"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "ATEN_", "OMP_"))}
    env.update(PYTHONPATH=str(root), ATEN_CPU_CAPABILITY="default", MKL_ENABLE_INSTRUCTIONS="AVX2", OMP_NUM_THREADS="1")
    overrides = tiny_overrides(arithmetic_model_dir, tmp_path / "scalar", steps=2, dense_reward=True)
    done = subprocess.run([sys.executable, "-m", "rlalign.cli.main", "train", *overrides, "run.profile=portable"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert fingerprint(tmp_path / "scalar", 2) == fingerprint(here, 2)
