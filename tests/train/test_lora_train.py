"""LoRA runs (``model.lora``): a CLI run with zero log-prob mismatches, adapters alone in the optimizer and the
masters, the base weights untouched, the PEFT adapter and the merged policy written and exported, a stopped run
resumed bit for bit, dropout refused in the strict profile and deterministic (resumable) in the native one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlalign.cli.main import main as cli_main
from rlalign.configlib import ConfigError, load_config
from rlalign.integrations.ray.compare import metric_differences, weight_differences
from rlalign.models.lora import LoRAError, read_adapter
from rlalign.train.config import TrainConfig
from rlalign.train.loop import Trainer, run_training
from rlalign.train.run.checkpoint_files import load_latest_checkpoint
from rlalign.train.run.metrics import read_metrics
from tests.train.conftest import tiny_overrides

ALL = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rlalign.cli.main", *args], capture_output=True, text=True,
                          timeout=600)


def _adapter_names(state_dict_names):
    return sorted(n for n in state_dict_names if n.endswith((".lora_A.weight", ".lora_B.weight")))


def test_cli_lora_run_zero_mismatches_adapters_only_and_exports(arithmetic_model_dir, tmp_path):
    run = tmp_path / "run"
    proc = _cli("train", *tiny_overrides(arithmetic_model_dir, run, steps=3, dense_reward=True), "model.lora.rank=8")
    assert proc.returncode == 0, proc.stderr
    steps = [r for r in read_metrics(run) if "mismatch/count" in r]
    assert len(steps) == 3 and all(r["mismatch/count"] == 0 and r["mismatch/tokens"] > 0 for r in steps)
    assert sum(r["grad_norm"] > 0 for r in steps) >= 2

    state = load_latest_checkpoint(run)
    adapters = _adapter_names(state["model"])
    assert len(adapters) == 2 * 4 * 2   # A and B of q/k/v/o in 2 layers
    assert len(state["optimizer"]["state"]) == len(state["optimizer"]["param_groups"][0]["params"]) == len(adapters)
    assert "master" not in state   # fp32: no masters at all
    base = load_file(str(arithmetic_model_dir / "model.safetensors"))
    for name, tensor in base.items():   # the frozen base weights, bit for bit
        assert torch.equal(state["model"][name], tensor), name
    assert any(state["model"][n].abs().sum() > 0 for n in adapters if "lora_B" in n), "B never trained"

    spec, tensors = read_adapter(run / "adapter")   # PEFT's format, next to the merged policy
    assert (spec.rank, spec.alpha) == (8, 16.0) and sorted(tensors) == adapters
    for name in adapters:
        assert torch.equal(tensors[name], state["model"][name]), name
    merged = load_file(str(run / "policy" / "model.safetensors"))
    assert sorted(merged) == sorted(base)   # a plain Hugging Face checkpoint
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])

    # the export command in this process (its argument parsing and error handling: rlalign.cli.main)
    assert cli_main(["export", str(run), str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == (run / "policy" / "model.safetensors").read_bytes()
    assert cli_main(["export", str(run), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (run / "adapter" / "adapter_model.safetensors").read_bytes()
    # an existing folder: refused without --overwrite; with it, replaced only when it holds nothing but an adapter's
    # files -- a user's file in it stops the export and stays
    assert cli_main(["export", str(run), str(tmp_path / "adapter"), "--adapter"]) == 2
    assert cli_main(["export", str(run), str(tmp_path / "adapter"), "--adapter", "--overwrite"]) == 0
    (tmp_path / "adapter" / "notes.txt").write_text("mine")
    assert cli_main(["export", str(run), str(tmp_path / "adapter"), "--adapter", "--overwrite"]) == 2
    assert (tmp_path / "adapter" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    # a new run starts from the adapter (model.lora.path): the policy holds its tensors; another rank is refused
    again = Trainer(load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / "again") + [
        "model.lora.rank=8", f"model.lora.path={run / 'adapter'}"]))
    try:
        held = dict(again.policy.named_parameters())
        for name in adapters:
            assert torch.equal(held[name].detach(), tensors[name]), name
    finally:
        again.close()
        again.run_lock.release()
    with pytest.raises(LoRAError, match="the adapter has rank 8, alpha 16.0"):
        Trainer(load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, tmp_path / "other") + [
            "model.lora.rank=4", f"model.lora.path={run / 'adapter'}"]))


def _over(model_dir, run_dir, steps, *extra):
    return tiny_overrides(model_dir, run_dir, steps=steps, dense_reward=True) + [
        "optim.warmup_steps=1", "model.lora.rank=2", f"model.lora.targets={ALL}", *extra]


@pytest.mark.parametrize("extra", [
    ["model.dtype=bfloat16", "optim.step_chunk_elements=100", "optim.activation_checkpointing=true"],
    ["run.profile=native", "model.lora.dropout=0.2"],
], ids=["bf16-strict", "native-dropout"])
def test_lora_run_stopped_and_resumed_equals_uninterrupted(arithmetic_model_dir, tmp_path, extra):
    """4 steps (the engine with its own copy) vs a run stopped after step 2 and resumed to 4 (sharing the policy's
    tensors): every metric value and every exported weight and adapter bit equal. With dropout (native) the
    masks come from torch's generator, which the checkpoint restores."""
    full = run_training(load_config(TrainConfig, None, _over(arithmetic_model_dir, tmp_path / "full", 4, *extra,
                                                             "rollout.share_weights=false")))
    cut = tmp_path / "cut"
    run_training(load_config(TrainConfig, None, _over(arithmetic_model_dir, cut, 4, *extra, "run.stop_at_step=2")))
    run_training(load_config(TrainConfig, None, _over(arithmetic_model_dir, cut, 4, *extra, "run.resume=true",
                                                      "run.stop_at_step=null")))
    assert [r["step"] for r in read_metrics(cut)] == [0, 1, 2, 3, 4]
    assert metric_differences(full, cut) == []
    assert weight_differences(full, cut) == []
    assert (full / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (cut / "adapter" / "adapter_model.safetensors").read_bytes()
    records = read_metrics(full)
    assert sum(r.get("grad_norm", 0) > 0 for r in records) >= 3
    if "run.profile=native" not in extra:
        assert all(r["mismatch/count"] == 0 for r in records if "mismatch/count" in r)


def test_bf16_masters_and_optimizer_state_hold_adapters_only(arithmetic_model_dir, tmp_path):
    trainer = Trainer(load_config(TrainConfig, None, _over(arithmetic_model_dir, tmp_path / "run", 2,
                                                           "model.dtype=bfloat16")))
    try:
        trainer.resume_if_asked()
        adapters = _adapter_names(n for n, _ in trainer.policy.named_parameters())
        assert sorted(n for n, _ in trainer.master.named) == adapters
        assert sum(m is not None for m in trainer.master.masters) == len(adapters)
        before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
        for step in (1, 2):
            record = trainer.train_step(step)
            assert record["mismatch/count"] == 0
        stepped = {id(p) for p in trainer.update.optimizer.state}
        assert stepped == {id(m) for m in trainer.master.masters}
        for name, p in trainer.policy.named_parameters():
            if name not in adapters:
                assert p.grad is None and torch.equal(p.detach(), before[name]), name
        assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.named_parameters()
                   if n in adapters)
    finally:
        trainer.close()
        trainer.run_lock.release()


def test_refusals_are_one_line(arithmetic_model_dir, tmp_path, capsys):
    code = cli_main(["train", *tiny_overrides(arithmetic_model_dir, tmp_path / "run"), "model.lora.rank=4",
                     "model.lora.dropout=0.1"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "model.lora.dropout=0.1" in lines[0] and "strict profile" in lines[0], err
    assert not (tmp_path / "run").exists()   # refused with the config, before anything was written
    assert cli_main(["export", str(tmp_path), str(tmp_path / "out"), "--adapter"]) == 2
    for extra, match in [(["parallel.tp=2"], "model.lora with parallel.tp is not supported"),
                         (["launcher=ray"], "model.lora with launcher=ray is not supported"),
                         (["rollout.engine=vllm"], "model.lora with rollout.engine=vllm is not supported"),
                         (["model.lora.dropout=0.1"], "model.lora.dropout=0.1: dropout makes the training forward")]:
        with pytest.raises(ConfigError, match=match):
            load_config(TrainConfig, None, ["model.lora.rank=4", *extra])
    load_config(TrainConfig, None, ["model.lora.rank=4", "model.lora.dropout=0.1", "run.profile=native"])
    load_config(TrainConfig, None, ["parallel.tp=2"])   # rank 0: no adapters, nothing refused
