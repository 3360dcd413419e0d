"""`rlalign parity --tp`: the training side sharded over gloo processes, compared with TP=1 and the rollout."""

import json
import os
import subprocess
import sys

import pytest

from rlalign.models.testing import make_tiny_checkpoint

# the CLI in a subprocess: one OpenMP thread, like the spawned ranks (and fast on a busy 2-core machine)
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "ckpt", "llama", num_attention_heads=8,
                                num_key_value_heads=4, head_dim=16, vocab_size=2100, init_std=0.05)


def _parity(*args):
    return subprocess.run([sys.executable, "-m", "rlalign.cli.main", "parity", *args], capture_output=True,
                          text=True, timeout=600, env=ONE_THREAD)


def test_parity_tp_json(checkpoint):
    proc = _parity("--model", str(checkpoint), "--tp", "1,2,4", "--prompts", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ok"] is True
    assert set(out["tp"]) == {"1", "2", "4"}
    for degree, r in out["tp"].items():
        assert r["tokens_compared"] == out["tokens_compared"] > 0, degree
        assert r["mismatches"] == 0 and r["rollout_mismatches"] == 0, (degree, r)


@pytest.mark.parametrize("tp, message", [("3", "tp=3 is not supported"), ("8", "does not divide"),
                                         ("1,x", "expected comma-separated degrees")])
def test_parity_tp_bad_degree_is_one_line(checkpoint, tp, message):
    proc = _parity("--model", str(checkpoint), "--tp", tp)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
