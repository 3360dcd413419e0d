"""A strict CPU run has the same bits on another CPU: the embedded default run's first steps, rerun on other code
paths in a subprocess, equal the fingerprint recorded on the reference machine
(benchmarks/evidence/across-machines/default-3-steps.json; docs/cpu.md, "Across machines").

The other code paths are forced on this machine: torch's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``) and MKL's
Intel AVX2 branch -- MKL picks its branch by CPU vendor and features, so a small preloaded library answers its
"is this an Intel CPU" query with yes (on an AMD CPU MKL otherwise runs its generic branch, on an Intel one this
changes nothing), and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` caps it at AVX2. Without the pinned MKL branch the same
subprocess logs other bits from step 1 (advantage std, entropy, gradient norm), so the comparison can fail.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlalign import mklmode, reductions
from rlalign.algos import _segments
from rlalign.ops.torch_backend import logprob, norm, sample

from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import run_fingerprint  # noqa: E402

RECORDED = ROOT / "benchmarks" / "evidence" / "across-machines" / "default-3-steps.json"
INTEL_SHIM = "int mkl_serv_intel_cpu_true(void) { return 1; }\nint mkl_serv_intel_cpu(void) { return 1; }\n"


def _intel_shim(tmp_path: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or platform.machine() not in ("x86_64", "AMD64") or not torch.backends.mkl.is_available():
        pytest.skip("needs an x86-64 torch with MKL and a C compiler")
    src, lib = tmp_path / "intel_shim.c", tmp_path / "intel_shim.so"
    src.write_text(INTEL_SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    return lib


def test_default_run_first_steps_equal_the_recorded_fingerprint_on_other_code_paths(tmp_path):
    recorded = json.loads(RECORDED.read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "ATEN_", "OMP_"))}
    env.update(PYTHONPATH=str(ROOT), RLALIGN_CPU_CROSS_MACHINE="1", ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2",
               LD_PRELOAD=str(_intel_shim(tmp_path)), OMP_NUM_THREADS=str(recorded["threads"]))
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rlalign.cli.main", "train", f"run.dir={run_dir}",
                           f"run.stop_at_step={recorded['steps']}", "run.progress=false"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = run_fingerprint.fingerprint(run_dir, recorded["steps"])
    for key in ("metrics_records", "metrics_sha256", "weights_sha256"):
        assert got[key] == recorded[key], (f"{key} differs from the reference machine's ({recorded['recorded_on']}) "
                                           f"under torch AVX2 + MKL's Intel AVX2 branch: {got[key]} vs {recorded[key]}")


# ---- the fixed-order reductions: their order is the strict ops' tree, whatever the length ----------------

_floats = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=25, deadline=None)
@given(st.lists(_floats, min_size=1, max_size=300))
def test_tree_sum_is_the_strict_ops_tree(values):
    x = torch.tensor(values, dtype=torch.float32)
    got = reductions.tree_sum(x)
    level = [np.float32(v) for v in values]   # the stated order, one float32 add at a time
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)] + level[len(level) - len(level) % 2:]
    assert torch.equal(got.view(torch.int32), torch.tensor(level[0], dtype=torch.float32).view(torch.int32))
    # one tree: the strict ops' backends and the loss aggregation sum with this very function
    for module in (norm, logprob, sample, _segments):
        assert module.tree_sum is reductions.tree_sum, module.__name__
    assert torch.equal(reductions.fixed_sum(x.reshape(1, -1)).view(torch.int32), got.view(torch.int32))


def _pairwise(values: list[float]) -> float:
    """The same tree in fp32, written out with Python scalars (one rounding to fp32 per add)."""
    level = [torch.tensor(v, dtype=torch.float32) for v in values]
    while len(level) > 1:
        nxt = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    return float(level[0])


@settings(max_examples=25, deadline=None)
@given(st.lists(_floats, min_size=0, max_size=200))
def test_mean_std_and_norm_follow_their_stated_arithmetic(values):
    x = torch.tensor(values, dtype=torch.float32)
    n = len(values)
    mean, std = reductions.fixed_mean_std(x)
    if n == 0:
        assert (mean, std) == (0.0, 0.0) and float(reductions.global_norm([x])) == 0.0
        return
    want_mean = float(torch.tensor(_pairwise([float(v) for v in x]) / n, dtype=torch.float64).float())
    assert mean == want_mean
    if n == 1:
        assert std == 0.0
    else:
        centred = [float(torch.tensor(float(v), dtype=torch.float32) - torch.tensor(mean, dtype=torch.float32))
                   for v in x]
        sq = _pairwise([float(torch.tensor(c, dtype=torch.float32) * torch.tensor(c, dtype=torch.float32))
                        for c in centred])
        assert std == float(torch.tensor((sq / (n - 1)) ** 0.5, dtype=torch.float64).float())
    squares = _pairwise([float(torch.tensor(float(v), dtype=torch.float32) ** 2) for v in x])
    assert float(reductions.global_norm([x])) == float(torch.tensor(squares ** 0.5, dtype=torch.float64).float())


def test_global_norm_is_the_tree_of_per_tensor_sums_and_propagates_nonfinite():
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(n, generator=gen) for n in (1, 7, 1000, 33)]
    parts = [float(reductions.fixed_sum(t * t)) for t in ts]
    want = float(torch.tensor(_pairwise(parts) ** 0.5, dtype=torch.float64).float())
    assert float(reductions.global_norm(ts)) == want
    assert torch.isinf(reductions.global_norm(ts + [torch.tensor([float("inf")])]))
    assert torch.isnan(reductions.global_norm(ts + [torch.tensor([float("nan")])]))
    assert float(reductions.global_norm([])) == 0.0


# ---- the trainer takes them in the cross-machine mode only -------------------------------------------------

def test_gradient_norm_and_logged_statistics_follow_the_mode(monkeypatch):
    from rlalign.train import parallel, stepstats

    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=gen) for n in (5, 1000, 77)]
    adv, mask = torch.randn(300, generator=gen), torch.rand(300, generator=gen) > 0.3
    bits = lambda t: torch.as_tensor(t, dtype=torch.float32).view(torch.int32)   # noqa: E731
    monkeypatch.setenv("RLALIGN_CPU_CROSS_MACHINE", "0")
    assert torch.equal(bits(parallel.total_norm(grads)), bits(torch.nn.utils.get_total_norm(grads, foreach=False)))
    assert stepstats.token_stats(adv, mask, adv, None) == {"advantage/mean": float(adv[mask].mean()),
                                                            "advantage/std": float(adv[mask].std())}
    monkeypatch.setenv("RLALIGN_CPU_CROSS_MACHINE", "1")
    assert torch.equal(bits(parallel.total_norm(grads)), bits(reductions.global_norm(grads)))
    mean, std = reductions.fixed_mean_std(adv[mask])
    assert stepstats.token_stats(adv, mask, adv, None) == {"advantage/mean": mean, "advantage/std": std}
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = parallel.clip_params_(params, 0.5)
    assert torch.equal(bits(norm), bits(reductions.global_norm(grads)))
    scale = torch.clamp(0.5 / (norm + 1e-6), max=1.0)   # torch's clip coefficient, from the fixed-order norm
    assert all(torch.equal(p.grad, g * scale) for p, g in zip(params, grads))


def test_cross_machine_mode_refuses_a_process_whose_mkl_already_runs_its_own_branch(monkeypatch):
    """Fail closed: MKL started before the trainer could pin it (here: a GEMM first), so the run's bits would be
    this machine's only; one line says so and how to set the branch."""
    from rlalign.contract.errors import RLAlignError
    from rlalign.train.config import ModelSection
    from rlalign.train.setup import load_policy

    if not torch.backends.mkl.is_available():
        pytest.skip("torch without MKL: nothing to pin")
    torch.ones(64, 64) @ torch.ones(64, 64)   # MKL starts in its own branch
    monkeypatch.setenv("MKL_CBWR", "AUTO")   # set before this test: the pin keeps it (and none leaks to other tests)
    monkeypatch.setenv("RLALIGN_CPU_CROSS_MACHINE", "1")
    if mklmode.status()[0]:
        pytest.skip("this process's MKL already runs its COMPATIBLE branch")
    with pytest.raises(RLAlignError, match="RLALIGN_CPU_CROSS_MACHINE=1 but MKL's reproducibility mode is"):
        load_policy(ModelSection())
