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


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """Qwen3-MoE: layers 0 and 2 sparse (8 experts, top-2, moe_intermediate_size 64), layer 1 dense."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "moe", "qwen3_moe", num_attention_heads=8,
                                num_key_value_heads=4, head_dim=16, num_hidden_layers=3, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                                mlp_only_layers=[1], init_std=0.1, norm_jitter=0.1)


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
        assert r["routing_mismatches"] is None, degree     # a dense model routes nothing


def test_parity_tp_on_moe_has_zero_mismatches_and_the_same_routing(moe_checkpoint):
    proc = _parity("--model", str(moe_checkpoint), "--tp", "1,2,4", "--prompts", "3")
    assert proc.returncode == 0, proc.stderr
    for degree in (1, 2, 4):
        assert f"TP={degree}: " in proc.stdout and " 0 mismatches vs TP=1, 0 vs the rollout, 0 rows routed " \
            "differently from TP=1" in proc.stdout, proc.stdout
    assert "OK: every token's logprob is bitwise identical" in proc.stdout


@pytest.mark.parametrize("inter, tp, message", [
    (50, "4", "tp=4 does not divide the model's moe_intermediate_size=50"),
    (24, "2", "layers.0.mlp.experts.gate_proj: tp=2 leaves 12 output features per rank"),
])
def test_parity_tp_refuses_moe_shards_it_cannot_split(tmp_path, inter, tp, message):
    model = make_tiny_checkpoint(tmp_path / "m", "qwen3_moe", num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=16, num_hidden_layers=1, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=inter)
    proc = _parity("--model", str(model), "--tp", tp)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("tp, message", [("3", "tp=3 is not supported"), ("8", "does not divide"),
                                         ("1,x", "expected comma-separated degrees")])
def test_parity_tp_bad_degree_is_one_line(checkpoint, tp, message):
    proc = _parity("--model", str(checkpoint), "--tp", tp)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_closing_line_names_a_tensor_parallel_mismatch(capsys):
    """Rollout and TP=1 agree, a degree does not: the summary must not read 'MISMATCH: 0 of N'."""
    from types import SimpleNamespace

    from rlalign.cli.parity import _print
    tokens = SimpleNamespace(tokens_compared=5, mismatches=0, max_abs_diff=0.0, mean_abs_diff=0.0, not_comparable=None)
    details = {"environment": None, "rollout": "rlalign", "train": "rlalign", "profile": "strict", "model": "m",
               "sequences": 2, "prompts": 1, "first_divergence": None}
    tp = {"ok": False, "tp": {"2": {"tokens_compared": 5, "mismatches": 5, "rollout_mismatches": 5,
                                    "routing_mismatches": 1}}}
    _print(SimpleNamespace(details=lambda: details, tokens=tokens, localization=None, tp=tp, ok=False), None)
    out = capsys.readouterr().out
    assert "TP=2: 5 tokens, 5 mismatches vs TP=1, 5 vs the rollout, 1 rows routed differently from TP=1" in out
    assert "MISMATCH across tensor-parallel degrees" in out and "MISMATCH: 0 of" not in out
