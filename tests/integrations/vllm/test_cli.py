"""As a user runs it: ``rlalign parity --rollout vllm`` with the plugin off (stock vLLM: mismatches, the
first divergence localized to a layer and op), and ``rlalign train rollout.engine=vllm`` (GRPO with
weights pushed into the running vLLM engine every step: zero mismatches, and the very same run as with
rlalign's own engine)."""

import json
from pathlib import Path

import pytest

from tests.integrations.vllm.helpers import VLLM_MARKS, run_cli, tail

pytestmark = VLLM_MARKS

DENSE_REWARD = f"{Path(__file__).parents[2] / 'train' / 'rewards.py'}:first_digit"
TIMING = ("time/", "tokens_per_s/", "memory/")


def test_stock_vllm_mismatches_are_reported_and_localized(vllm_checkpoints):
    proc = run_cli(["parity", "--model", str(vllm_checkpoints / "llama"), "--rollout", "vllm", "--vllm-plugin", "off",
                    "--train", "rlalign", "--prompts", "3", "--samples", "2", "--max-new-tokens", "12", "--localize",
                    "--json"])
    assert proc.returncode == 1, tail(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["ok"] and result["mismatches"] > 0 and result["tokens_compared"] >= 30
    localized = result["first_divergence"]["localized"]
    assert localized["verdict"] == "localized", localized
    # stock vLLM's first differing boundary is inside the decoder stack (its own RMSNorm, linears, attention)
    assert localized["layer"] is not None or localized["boundary"] == "final_norm", localized
    assert localized["ulp"] >= 1


@pytest.fixture(scope="module")
def arithmetic_model(tmp_path_factory):
    """A random-init model with the character tokenizer of the addition task (varied samples, so the
    dense reward gives non-zero advantages); head_dim 32 for vLLM's CPU attention."""
    from tests.train.conftest import make_arithmetic_checkpoint
    return make_arithmetic_checkpoint(tmp_path_factory.mktemp("vllm_arith") / "model", head_dim=32)


def _train(model_dir: Path, run_dir: Path, engine: str) -> list[dict]:
    proc = run_cli(["train", f"model.path={model_dir}", f"rollout.engine={engine}", f"run.dir={run_dir}", "run.steps=3", "run.eval_every=3",
                    "run.checkpoint_every=3", "run.progress=false", "run.on_mismatch=stop",
                    "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "task.eval_size=8",
                    f"task.reward={DENSE_REWARD}", "optim.lr=1e-2"], timeout=400)
    assert proc.returncode == 0, tail(proc)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_with_vllm_rollouts_is_bitwise_the_rlalign_engine_run(arithmetic_model, tmp_path):
    vllm_run = _train(arithmetic_model, tmp_path / "vllm", "vllm")
    steps = [m for m in vllm_run if "mismatch/tokens" in m]
    assert len(steps) == 3 and all(m["mismatch/tokens"] > 0 for m in steps)
    assert [m["mismatch/count"] for m in steps] == [0, 0, 0]
    assert [m["weights_version"] for m in steps] == [1, 2, 3]
    assert any(m["grad_norm"] > 0 for m in steps)   # the weights really moved between rollouts
    rlalign_run = _train(arithmetic_model, tmp_path / "rlalign", "rlalign")
    for a, b in zip(vllm_run, rlalign_run, strict=True):
        same = {k: v for k, v in a.items() if not k.startswith(TIMING)}
        assert same == {k: v for k, v in b.items() if not k.startswith(TIMING)}, a.get("step")
