"""The triton backend's shard entries (rlalign/ops/triton_backend/shard.py) under the CPU interpreter.

As in tests/ops/test_triton_interpret.py: the interpreter checks indexing, masking, strides and
shard offsets against float64 references (fp32 only); bitwise properties are the GPU's and are
checked by scripts/gpu_tp.py. One exception holds in the interpreter too and is checked: the
vocab shards' statistics, merged, equal the full fused op's bits (the same 256-column tiles).
One subprocess (the interpreter must be on before triton is imported).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHECK = r'''
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
from tests.ops.test_triton_interpret import _patch_interpreter
_patch_interpreter()
import torch
from rlalign.ops.triton_backend import shard, logprob as tlp
from rlalign.distributed.collectives import tree_reduce

def rel(a, ref):
    a, ref = a.double(), ref.double()
    return float((a - ref).abs().max() / ref.abs().max())

g = torch.Generator().manual_seed(0)
out = {}
x, w = torch.randn(70, 128, generator=g), torch.randn(48, 128, generator=g)
ref = x.double() @ w.double().t()
for t in (2, 8):
    k = 128 // t
    parts = [shard.linear_partial(x[:, r * k:(r + 1) * k], w[:, r * k:(r + 1) * k], 8 // t) for r in range(t)]
    out[f"linear_partial_t{t}"] = rel(tree_reduce(parts), ref)
gy = torch.randn(70, 48, generator=g)
out["dx_transposed_view"] = rel(shard.linear_partial(gy, w.t(), 4), gy.double() @ w.double())
out["weight_grad"] = rel(shard.linear_weight_grad(gy, x, torch.float32), gy.double().t() @ x.double())
V, T, H, temp = 2600, 70, 64, 0.7
h, W = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g) * 0.3
tg = torch.randint(0, V, (T,), generator=g)
lp_full, ent_full, _, _ = tlp.forward_stats(h, W, tg, temp, True)
stats, zt = [], torch.zeros(T)
bounds = (0, 1024, 2048, V)
for a, b in zip(bounds, bounds[1:]):
    s, z = shard.logprob_shard_stats(h, W[a:b], tg, a, temp, True)
    stats.append(s)
    zt = torch.where((tg >= a) & (tg < b), z, zt)
lp, ent, lse, mu = shard.logprob_merge_stats(torch.cat(stats, 1).contiguous(), zt)
out["shards_equal_full_lp"] = bool(torch.equal(lp, lp_full))
out["shards_equal_full_ent"] = bool(torch.equal(ent, ent_full))
logp = torch.log_softmax(h.double() @ W.double().t() / temp, -1)
out["lp_vs_float64"] = rel(lp, logp.gather(1, tg.unsqueeze(1)).squeeze(1))
glp, gent = torch.randn(T, generator=g), torch.randn(T, generator=g)
dz = shard.logprob_shard_dlogits(h, W[1024:2048], tg, 1024, lse, mu, temp, glp, gent)
z = (h.double() @ W[1024:2048].double().t()) / temp
p = torch.exp(z - lse.double().unsqueeze(1))
ref = -(p * (glp.double().unsqueeze(1) + gent.double().unsqueeze(1) * (z - mu.double().unsqueeze(1))))
loc = tg - 1024
rows = ((loc >= 0) & (loc < 1024)).nonzero().squeeze(1)
ref[rows, loc[rows]] += glp.double()[rows]
out["dlogits"] = rel(dz, ref / temp)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def results():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=900, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", ["linear_partial_t2", "linear_partial_t8", "dx_transposed_view", "weight_grad",
                                   "lp_vs_float64", "dlogits"])
def test_triton_shard_entry_matches_float64(results, check):
    assert results[check] < 2e-5, results


def test_triton_vocab_shards_merge_to_the_full_op_bits(results):
    assert results["shards_equal_full_lp"] and results["shards_equal_full_ent"], results
