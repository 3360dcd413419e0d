"""scripts/gpu_tp.py --smoke: the multi-GPU TP script, run on CPU + gloo with a tiny Qwen3 shape, for a list
of degrees (TP=2 and TP=4 on ranks 0..t-1 of one 4-process job, each compared with TP=1); and its comparison,
which must see a one-bit difference in any gradient."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

# the CLI in a subprocess: one OpenMP thread, like the spawned ranks (and fast on a busy 2-core machine)
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_tp.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_tp_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_tp_script_smoke_with_a_list_of_degrees(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--tp", "2,4", "--steps", "1", "--warmup", "0",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_tp.json").read_text())
    errors = {k: v["error"] for k, v in doc.items() if isinstance(v, dict) and "error" in v}
    assert not errors
    assert doc["complete"] is True and doc["degrees"] == [1, 2, 4] and doc["processes"] == 4
    assert doc["tp1_vs_unsharded"]["lp"]["differ"] == 0 and doc["tp1_vs_unsharded"]["ent"]["differ"] == 0
    params = doc["tp2_vs_tp1"]["grads_compared"]
    assert params == 25   # 2 layers x 11 tensors + embedding, final norm, LM head: every gradient compared
    for t in (2, 4):
        m = doc[f"tp{t}_vs_tp1"]
        assert doc[f"tp{t}_equals_tp1_bitwise"] is True and m["grads_compared"] == params, t
        assert m["lp"]["differ"] == 0 and m["ent"]["differ"] == 0 and m["grads_differ_total"] == 0, t
    for t in (1, 2, 4):
        for profile in ("strict", "native"):
            assert doc["step_time_s"][str(t)][profile] > 0, (t, profile)
    assert doc["all_degrees_equal"] is True and json.loads(proc.stdout.splitlines()[0])["all_degrees_equal"] is True


def test_gpu_tp_script_refuses_a_degree_the_model_cannot_split_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--tp", "1,2,8", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert proc.returncode == 2 and "tp=8 does not divide the model's num_key_value_heads=4" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_the_comparison_sees_one_bit_in_any_gradient_and_the_sign_of_zero():
    gpu_tp = _load_script()
    gen = torch.Generator().manual_seed(0)
    ref = {"lp": torch.randn(7, generator=gen), "ent": torch.rand(7, generator=gen), "loss": torch.tensor(0.5),
           "grads": {"a": torch.randn(3, 4, generator=gen).bfloat16(), "b": torch.zeros(5)}}
    same = {k: (v.clone() if torch.is_tensor(v) else {n: g.clone() for n, g in v.items()}) for k, v in ref.items()}
    assert gpu_tp.bitwise_equal(gpu_tp.mismatches(same, ref))
    for name, index in (("a", 5), ("b", 0)):
        other = {**same, "grads": {n: g.clone() for n, g in same["grads"].items()}}
        flat = other["grads"][name].view(-1)
        if name == "a":   # one ulp: the last bit of a bf16 value
            flat.view(torch.int16)[index] += 1
        else:             # -0.0 == 0.0 numerically, not in bits
            flat[index] = -0.0
        m = gpu_tp.mismatches(other, ref)
        assert not gpu_tp.bitwise_equal(m), name
        assert m["grads_params_differing"] == [name] and m["grads"][name]["differ"] == 1
        assert m["grads"][name]["first"]["index"] == index
    missing = {**same, "grads": {"a": same["grads"]["a"]}}
    assert not gpu_tp.bitwise_equal(gpu_tp.mismatches(missing, ref))
    assert not gpu_tp.bitwise_equal(gpu_tp.mismatches({k: v for k, v in same.items() if k != "grads"}, ref))
