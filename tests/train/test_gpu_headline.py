"""scripts/gpu_headline.sh rehearsed on the CPU with a toy body (the same script, config and commands the GPU job
runs; MAKE_ARGS / TRAIN_ARGS shrink the model and the step): the headline mode leaves metrics, plots, config and
the budget under $OUT, and the RESUME mode's straight vs stopped-and-resumed runs compare equal."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOY = ("model.device=cpu rollout.prompts_per_step=2 rollout.samples_per_prompt=4 rollout.max_new_tokens=4 "
       "rollout.max_num_seqs=8 rollout.kv_cache_bytes=8388608 task.eval_size=2 run.eval_samples=1 "
       "optim.micro_batch_tokens=64 optim.step_chunk_elements=1000")


def _script(tmp_path, expect_rc=0, **env):
    full = {**os.environ, "OUT": str(tmp_path / "out"), "ROOT": str(tmp_path / "root"), "LAYERS": "2",
            "MAKE_ARGS": "--test-body --vocab 3000 --device cpu", "TRAIN_ARGS": TOY, **env}
    (tmp_path / "root").mkdir(exist_ok=True)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_headline.sh")], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return (tmp_path / "out" / "summary.txt").read_text()


@pytest.mark.parametrize("mode", ["headline", "resume", "span"])
def test_gpu_headline_script_rehearsed_on_the_cpu(tmp_path, mode):
    if mode == "headline":
        summary = _script(tmp_path, STEPS="2")
        out = tmp_path / "out" / "headline"
        for name in ("metrics.jsonl", "report.png", "report.md", "config.yaml", "budget.md", "train.log"):
            assert (out / name).is_file(), name
        assert "compared log-probs 64, mismatches 0" in summary and "engine's weight copy 0 MiB (0: shared)" in summary
        assert "run.save_checkpoints=false" in (out / "budget.md").read_text()
    elif mode == "span":   # two calls: the first starts the run detached and returns, the second waits and collects
        first = _script(tmp_path, STEPS="2", SPAN="2", FIRST_WAIT="0")
        assert "detached: pid" in first and "NEXT: call again at once with ATTACH=1" in first, first
        summary = _script(tmp_path, ATTACH="1")
        assert "attached to the detached run" in summary and "compared log-probs 64, mismatches 0" in summary, summary
        assert (tmp_path / "out" / "headline" / "report.png").is_file()
        assert "FAILED: no detached run" in _script(tmp_path, ATTACH="1", expect_rc=1)
    else:
        summary = _script(tmp_path, RESUME="1", RESUME_STEPS="2")
        assert "3 metric records, 0 differences (bitwise identical" in (tmp_path / "out" / "resume" / "verdict.txt").read_text()
        assert "cut: resumed in a new process, steps 2-2" in summary
    assert not any((tmp_path / "root").iterdir()), "the script leaves nothing in its scratch root"
