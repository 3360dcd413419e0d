"""benchmarks/gemm_census.py on the CPU: the census of benchmarks/train_step.py's strict step on the tiny shape (the step's
linear and fused log-prob on the Triton kernels under the interpreter, in a child process) records exactly the
GEMM launches the step makes -- every layer's q/k/v/o/gate/up/down forward, dX and dW, the LM head's statistics,
grad-logits, dX and dW -- with the shapes and layouts the autograd formulas imply and the launch the dispatcher
picks; and the census is off (and refuses to nest) outside ``collecting``. The timing is CUDA-only
(tests/cuda/test_cuda_gemm_census.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlalign.contract import spec
from rlalign.ops import gemm_census

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_gemm_census", ROOT / "benchmarks" / "gemm_census.py")
census_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(census_bench)

# the tiny shape (benchmarks/train_step.py SHAPES["tiny"]): hidden 64, 4 x 16 query / 2 x 16 kv heads, FFN 192, vocab 1000
H, Q, KV, FF, V = 64, 64, 32, 192, 1000
LAYERS, TOKENS = 2, 130
PROJ = {  # proj -> (in, out, k_segments of the forward)
    "self_attn.q_proj": (H, Q, 1), "self_attn.k_proj": (H, KV, 1), "self_attn.v_proj": (H, KV, 1),
    "self_attn.o_proj": (Q, H, spec.K_SEGMENTS), "mlp.gate_proj": (H, FF, 1), "mlp.up_proj": (H, FF, 1),
    "mlp.down_proj": (FF, H, spec.K_SEGMENTS)}


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)     # the bench switches it on itself, before triton is imported
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gemm_census.py"), "--quick", "--device", "cpu",
                          "--layers", str(LAYERS), "--tokens", str(TOKENS), "--mean-seq", "40", "--json"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _by_role(calls):
    got: dict[tuple[str, str], list[dict]] = {}
    for c in calls:
        got.setdefault((c["weight"], c["role"]), []).append(c)
    return got


def _shape(c):
    return c["m"], c["n"], c["k"], c["a_trans"], c["b_trans"], c["segments"], c["acc_in"]


def test_every_linear_of_every_layer_has_its_forward_dx_and_dw(result):
    got = _by_role(result["calls"])
    for layer in range(LAYERS):
        for proj, (k_in, n_out, segments) in PROJ.items():
            w = f"model.layers.{layer}.{proj}.weight"
            want = {"fwd": (TOKENS, n_out, k_in, False, True, segments, False),      # y = x W^T
                    "dX": (TOKENS, k_in, n_out, False, False, 1, False),             # dX = dY W
                    "dW": (n_out, k_in, TOKENS, True, False, 1, False)}              # dW = dY^T X
            for role, shape in want.items():
                calls = got.pop((w, role), [])
                assert [_shape(c) for c in calls] == [shape], (w, role, calls)
                assert calls[0]["entry"] == "gemm" and calls[0]["out_dtype"] == "float32"
    lm = "lm_head.weight"
    want = {"lm_stats": (TOKENS, V, H, False, True, 1, False),       # one token chunk (TOKENS <= TOKEN_CHUNK)
            "lm_grad_logits": (TOKENS, V, H, False, True, 1, False),  # one vocab chunk (V <= GRAD_CHUNK)
            "lm_dX": (TOKENS, H, V, False, False, 1, True),           # dh += dz Wc, fp32 accumulator in memory
            "lm_dW": (V, H, TOKENS, True, False, 1, False)}           # dW[chunk] = dz^T h
    for role, shape in want.items():
        calls = got.pop((lm, role), [])
        assert [_shape(c) for c in calls] == [shape], (role, calls)
    assert got == {}, f"launches the census should not have: {sorted(got)}"
    assert result["launches"] == len(result["calls"]) == LAYERS * len(PROJ) * 3 + 4


def test_calls_are_in_step_order_and_name_their_kernels(result):
    roles = [c["role"] for c in result["calls"]]
    first_back = roles.index("lm_grad_logits")
    assert set(roles[:first_back]) == {"fwd", "lm_stats"} and roles[first_back - 1] == "lm_stats"
    assert "fwd" not in roles[first_back:]
    entries = {c["role"]: (c["entry"], c["kernel"]) for c in result["calls"]}
    assert entries["lm_stats"] == ("lp_stats", "lp_stats_kernel")
    assert entries["lm_grad_logits"] == ("lp_grad_logits", "lp_grad_logits_kernel")
    # the fp32 dz written by the kernel is the acc_in dX's A operand: row stride padded to 64 columns
    dz = next(c for c in result["calls"] if c["role"] == "lm_dX")
    assert dz["a_strides"] == [-(-V // 64) * 64, 1] and dz["out_dtype"] == "float32"


_EXPECTED_LAUNCHES = """
import json, sys
from rlalign.ops.triton_backend._common import num_sms
from rlalign.ops.triton_backend.gemm import SPLIT_SEGMENTS_MAX_M, pick_config, segment_split_config
out = []
for c in json.load(sys.stdin):
    fp32 = c["dtype"] == "float32"
    if c["segments"] > 1 and c["m"] <= SPLIT_SEGMENTS_MAX_M:
        out.append(["segment_partials_kernel+merge_partials_kernel", repr(segment_split_config(c["m"], fp32))])
    else:
        mode = "acc_in" if c["acc_in"] else ("fp32" if c["out_dtype"] == "float32" else "bf16")
        out.append(["gemm_kernel", repr(pick_config(c["m"], c["n"], c["segments"], fp32, num_sms(0), mode))])
print(json.dumps(out))
"""


def test_recorded_launch_is_the_dispatchers_choice(result):
    """The kernel and config in the census are what gemm.gemm's dispatch picks for that call (asked of the
    dispatcher's own functions in a child under the interpreter: fp32 candidate lists, the split at
    M <= SPLIT_SEGMENTS_MAX_M on the K partition)."""
    calls = [c for c in result["calls"] if c["entry"] == "gemm"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _EXPECTED_LAUNCHES], input=json.dumps(calls), capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    want = json.loads(out.stdout.strip().splitlines()[-1])
    assert [[c["kernel"], c["config"]] for c in calls] == want


def test_rows_dedupe_by_launch_and_keep_counts(result):
    rows = result["rows"]
    assert sum(r["count"] for r in rows) == result["launches"]
    keys = [(r["kernel"], r["config"], r["m"], r["n"], r["k"], r["a_trans"], r["b_trans"], r["segments"],
             r["acc_in"]) for r in rows]
    assert len(keys) == len(set(keys))
    kv = next(r for r in rows if "self_attn.k_proj fwd" in r["roles"])
    assert kv["count"] == 2 * LAYERS and "self_attn.v_proj fwd" in kv["roles"] and "L0-1" in kv["roles"]
    assert all("ours_ms" not in r and r["skipped"].startswith("census only") for r in rows)   # no timing on a CPU
    assert result["step_gemm_ms"] is None


def test_finish_rows_derives_ms_lost_share_and_sorts_by_it():
    rows = [{"count": 2, "gflop_each": 10.0, "ours_ms": 1.0, "cublas_ms": 0.5},
            {"count": 1, "gflop_each": 30.0, "ours_ms": 3.0, "cublas_ms": 1.0},
            {"count": 4, "gflop_each": 1.0, "ours_ms": 0.1, "cublas_ms": 0.2},
            {"count": 1, "gflop_each": 99.0, "skipped": "past the budget"}]
    total = census_bench.finish_rows(rows)
    assert total == pytest.approx(2 * 1.0 + 3.0 + 4 * 0.1)
    assert [r.get("ms_lost") for r in rows] == pytest.approx([2.0, 1.0, -0.4, None])
    assert rows[0]["ratio"] == pytest.approx(1 / 3) and rows[0]["tflops"] == pytest.approx(10.0)
    assert rows[1]["share"] == pytest.approx(2.0 / total)
    assert "ratio" not in rows[-1]


def test_census_is_off_by_default_and_does_not_nest():
    assert gemm_census.ACTIVE is None
    with gemm_census.collecting({}) as census:
        assert gemm_census.ACTIVE is census
        with pytest.raises(RuntimeError, match="do not nest"):
            with gemm_census.collecting():
                pass
        assert gemm_census.ACTIVE is census
    assert gemm_census.ACTIVE is None
