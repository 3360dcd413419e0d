"""The Qwen3-8B kit on the CPU: scripts/make_qwen3_8b.py with a toy body, its
full-vocabulary tokenizer (scripts/make_moe_model.py's scheme), configs/qwen3-8b-h200.yaml run for two steps on it (offload, activation
checkpointing, top-p, partial credit; every key of the file is accepted), configs/qwen3-8b-h200-device.yaml
(all state on the device) likewise, with and without checkpoints, and the memory budgets."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch

from rlalign.cli.main import main
from rlalign.models.config import ModelConfig
from rlalign.models.tokenizer import load_tokenizer
from rlalign.train import budget
from rlalign.train.run.config_file import resolve_train_config
from rlalign.train.run.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "qwen3-8b-h200.yaml"
DEVICE_CONFIG = REPO / "configs" / "qwen3-8b-h200-device.yaml"
H200_USABLE = 139 * 2**30
_spec = importlib.util.spec_from_file_location("make_qwen3_8b", REPO / "scripts" / "make_qwen3_8b.py")
kit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kit)


@pytest.fixture(scope="module")
def toy_8b(tmp_path_factory):
    out = tmp_path_factory.mktemp("q8b")
    assert kit.main([str(out), "--test-body", "--layers", "2", "--vocab", "3000", "--device", "cpu"]) == 0
    return out


def test_full_vocab_tokenizer_keeps_the_default_ids_and_decodes_every_id_to_digits(toy_8b):
    tok = load_tokenizer(toy_8b)
    default = load_tokenizer(kit.DEFAULT_MODEL_DIR)
    assert tok.vocab_size == 3000 == json.loads((toy_8b / "config.json").read_text())["vocab_size"]
    for text in ("12+34=", "907+5=", "0"):
        assert tok.encode(text) == default.encode(text)
    assert tok.eos_token_ids == default.eos_token_ids
    # id 15 + i is the number 10 + i
    assert tok.decode([15, 16, 104, 105, 2999]) == "10" + "11" + "99" + "100" + "2994"
    ids = list(range(15, 3000))
    assert set(tok.decode(ids)) <= set("0123456789")


def test_full_vocabulary_reaches_151936_with_unique_tokens():
    vocab = kit.full_vocab_tokenizer(151936)["model"]["vocab"]
    assert len(vocab) == 151936 and sorted(vocab.values()) == list(range(151936))
    with pytest.raises(SystemExit):
        kit.full_vocab_tokenizer(10)


def test_checkpoint_is_bf16_qwen3_8b_shaped_except_the_test_body(toy_8b):
    cfg = json.loads((toy_8b / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["num_hidden_layers"] == 2 and cfg["tie_word_embeddings"] is False
    full = kit.hf_config(36, 151936, test_body=False)
    assert (full["hidden_size"], full["num_attention_heads"], full["num_key_value_heads"], full["head_dim"],
            full["intermediate_size"], full["vocab_size"]) == (4096, 32, 8, 128, 12288, 151936)
    assert abs(budget.parameter_count(ModelConfig.from_hf_dict(full)) - 8.19e9) < 0.01e9


def test_hidden_widens_only_the_toy_body(tmp_path):
    assert kit.toy_body(64) == kit.TEST_BODY
    wide = kit.hf_config(2, 3000, test_body=True, hidden=256)
    assert (wide["hidden_size"], wide["intermediate_size"], wide["num_attention_heads"], wide["num_key_value_heads"],
            wide["head_dim"]) == (256, 768, 16, 8, 16)
    ModelConfig.from_hf_dict(wide)   # a valid model
    with pytest.raises(SystemExit):
        kit.toy_body(48)             # heads of 16, two query heads per kv head
    with pytest.raises(SystemExit):
        kit.main([str(tmp_path / "x"), "--hidden", "256", "--config-only"])   # a width for the 8B body: refused


def test_lm_head_std_changes_only_the_head(toy_8b, tmp_path):
    from safetensors.torch import load_file

    def tensors(d):
        out = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            out.update(load_file(f))
        return out

    zero = tmp_path / "zero"
    assert kit.main([str(zero), "--test-body", "--layers", "2", "--vocab", "3000", "--device", "cpu",
                     "--lm-head-std", "0"]) == 0
    small = tmp_path / "small"
    assert kit.main([str(small), "--test-body", "--layers", "2", "--vocab", "3000", "--device", "cpu",
                     "--lm-head-std", "0.002"]) == 0
    base, z, s = tensors(toy_8b), tensors(zero), tensors(small)
    assert base.keys() == z.keys() == s.keys()
    for name in base:
        if name != "lm_head.weight":
            assert torch.equal(base[name], z[name]) and torch.equal(base[name], s[name]), name
    assert not z["lm_head.weight"].any()
    # the same draw, scaled: std 0.002 / 0.02 of the default head (bf16 rounding apart)
    ratio = s["lm_head.weight"].float().std() / base["lm_head.weight"].float().std()
    assert abs(float(ratio) - 0.1) < 1e-3


def test_config_runs_two_strict_steps_on_the_toy_body(toy_8b, tmp_path):
    run = tmp_path / "run"
    args = ["train", str(CONFIG), f"model.path={toy_8b}", "model.device=cpu", f"run.dir={run}", "run.steps=2",
            "run.eval_every=2", "run.progress=false", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=4", "rollout.max_num_seqs=8", "rollout.kv_cache_bytes=8388608",
            "task.eval_size=2", "run.eval_samples=1", "optim.micro_batch_tokens=64"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args) == 0
    records = [r for r in read_metrics(run) if "mismatch/count" in r]
    assert len(records) == 2 and all(r["mismatch/count"] == 0 and r["mismatch/tokens"] > 0 for r in records)
    # the random-init model over the full-vocabulary scheme earns a varying reward: GRPO has a signal
    assert all(r["advantage/std"] > 0 for r in records)
    saved = resolve_train_config(str(CONFIG), [])
    assert saved.optim.offload and saved.optim.activation_checkpointing and saved.rollout.top_p < 1.0
    assert saved.rollout.max_new_tokens >= 64 and saved.model.dtype == "bfloat16"
    assert saved.run.checkpoint_every >= 1 and saved.run.max_minutes is None   # a user's run: checkpoints, no deadline


def _budget(overrides, layers=36, vocab=151936, config=CONFIG):
    cfg = resolve_train_config(str(config), overrides)
    model = ModelConfig.from_hf_dict(kit.hf_config(layers, vocab, test_body=False))
    return {r.component: r for r in budget.memory_budget(cfg, model)}, model


def test_budget_arithmetic_for_the_8b_config():
    rows, m = _budget([])
    p = budget.parameter_count(m)
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    assert p == 36 * layer + 2 * 151936 * 4096 + 4096
    assert rows["policy weights"].nbytes == rows["policy gradients"].nbytes == 2 * p
    for name, per_param in (("fp32 master weights", 4), ("AdamW m, v (fp32)", 8)):
        assert rows[name].nbytes == per_param * p and rows[name].place == "host"
    assert "fp32 master gradients" not in rows   # one widened gradient at a time (MasterWeights.step)
    largest = 151936 * 4096   # the embedding (and the untied LM head)
    assert max(budget.parameter_sizes(m)) == largest
    chunk = 64 * 2**20   # optim.step_chunk_elements' default: the step's working set is one chunk, not the embedding
    assert rows["optimizer step working set"].nbytes == 12 * chunk and rows["optimizer step working set"].place == "host"
    assert rows["rollout engine weights"].nbytes == 0   # shared with the policy
    assert rows["log-prob backward LM-head gradient"].nbytes == (4 + 2) * largest
    assert rows["KV cache (rollout)"].nbytes == 4 * 2**30
    assert budget.kv_bytes_per_token(m, 2) == 2 * 36 * 8 * 128 * 2
    per_token = 36 * 2 * 4096 * 2 + budget._layer_bytes_per_token(m, 2)
    assert rows["training activations"].nbytes == 8192 * per_token
    ckpt = 12 * p   # masters + m + v; the bf16 weights are derived from the masters on load
    assert rows["checkpoint save, host copy"].nbytes == 0 and rows["checkpoint files"].nbytes == 2 * ckpt
    totals = budget.totals(list(rows.values()))
    assert totals["host"] == 12 * p + 12 * chunk < 93 * 2**30   # 92.3 GiB: fits a 128 GiB host
    assert "reference model" not in rows and "value model" not in rows


def test_budget_follows_the_switches():
    on_device, _ = _budget(["optim.offload=false"])
    assert on_device["AdamW m, v (fp32)"].place == on_device["optimizer step working set"].place == "device"
    largest = 151936 * 4096
    assert on_device["checkpoint save, host copy"].nbytes == 4 * largest   # one fp32 master copied at a time
    no_master, m = _budget(["optim.master_weights=false", "optim.offload=false", "algo.kl_coef=0.01",
                            "run.keep_checkpoints=3", "optim.step_chunk_elements=1000000000"])
    p = budget.parameter_count(m)
    assert "fp32 master weights" not in no_master and no_master["AdamW m, v"].nbytes == 4 * p
    assert no_master["reference model"].nbytes == 2 * p
    # weights + bf16 m, v; keep=3: the oldest is deleted before the save, so 3 files at most
    assert no_master["checkpoint files"].nbytes == 3 * 6 * p
    assert no_master["checkpoint save, host copy"].nbytes == 2 * largest
    assert no_master["optimizer step working set"].nbytes == 2 * 2 * largest   # a chunk larger than any parameter
    copied, _ = _budget(["rollout.share_weights=false"])
    assert copied["rollout engine weights"].nbytes == 2 * p and "rollout.share_weights=false" in copied["rollout engine weights"].note
    tp, _ = _budget(["parallel.tp=1"])
    assert tp["rollout engine weights"].nbytes == 2 * p and "parallel.tp" in tp["rollout engine weights"].note
    no_ckpt, _ = _budget(["optim.activation_checkpointing=false"])
    assert no_ckpt["training activations"].nbytes == 8192 * 36 * budget._layer_bytes_per_token(m, 2)
    text = budget.format_budget(list(no_ckpt.values()))
    assert "total, device" in text and "total, host" in text and "GiB" in text


def test_budget_cli_names_a_missing_model_config(tmp_path, capsys):
    assert budget.main([str(CONFIG), f"model.path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--config-only" in err


def test_device_config_fits_one_h200_with_every_state_on_it():
    """configs/qwen3-8b-h200-device.yaml: masters, AdamW state, weights, gradients on the device, the engine
    sharing the weights, a chunked step; < 132 GiB in all, rows taken as live at once (9 GiB spare of 139); its
    checkpoints (one kept, plus the one being written) are 91.5 GiB each on disk and cost the device nothing."""
    rows, m = _budget([], config=DEVICE_CONFIG)
    p = budget.parameter_count(m)
    # every training state on the device; host memory only for a checkpoint being written, disk for the files
    assert {r.place for r in rows.values() if r.component != "exported policy"} == {"device", "disk", "host"}
    assert {r.component for r in rows.values() if r.place == "host"} == {"checkpoint save, host copy"}
    assert rows["fp32 master weights"].place == rows["AdamW m, v (fp32)"].place == "device"
    assert rows["rollout engine weights"].nbytes == 0
    assert rows["optimizer step working set"].nbytes == 12 * 32 * 2**20
    assert rows["checkpoint files"].place == "disk" and rows["checkpoint files"].nbytes == 2 * 12 * p   # masters, m, v
    no_ckpt, _ = _budget(["run.save_checkpoints=false"], config=DEVICE_CONFIG)
    assert no_ckpt["checkpoint files"].nbytes == 0 and "checkpoint save, host copy" not in no_ckpt
    need = budget.totals(list(rows.values()))["device"]
    assert 16 * p < need < 132 * 2**30
    fits, line = budget.fit_line(list(rows.values()), H200_USABLE)
    assert fits and "spare" in line
    cfg = resolve_train_config(str(DEVICE_CONFIG), [])
    r = cfg.rollout
    assert r.prompts_per_step * r.samples_per_prompt * r.max_new_tokens * cfg.run.steps >= 1_000_000
    assert r.top_p < 1.0 and r.max_new_tokens >= 64 and cfg.run.profile == "strict" and cfg.run.on_mismatch == "stop"
    # without sharing or chunking it would not fit: what the two changes buy
    unshared, _ = _budget(["rollout.share_weights=false", "optim.step_chunk_elements=1000000000"], config=DEVICE_CONFIG)
    assert not budget.fit_line(list(unshared.values()), H200_USABLE)[0]


def test_budget_cli_says_whether_it_fits(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(kit.hf_config(36, 151936, test_body=False)))
    for gib, status, verdict in (("139", 0, "fits the device"), ("100", 1, "does NOT fit the device")):
        assert budget.main([str(DEVICE_CONFIG), "--model-config", str(model), "--device-memory", gib]) == status
        assert verdict in capsys.readouterr().out


def test_device_config_runs_two_strict_steps_on_the_toy_body_without_checkpoints(toy_8b, tmp_path):
    run = tmp_path / "run"
    args = ["train", str(DEVICE_CONFIG), f"model.path={toy_8b}", "model.device=cpu", f"run.dir={run}", "run.steps=2",
            "run.eval_every=2", "run.progress=false", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=4", "rollout.max_num_seqs=8", "rollout.kv_cache_bytes=8388608",
            "task.eval_size=2", "run.eval_samples=1", "optim.micro_batch_tokens=64", "optim.step_chunk_elements=1000",
            "run.save_checkpoints=false"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args) == 0
    records = [r for r in read_metrics(run) if "mismatch/count" in r]
    assert len(records) == 2 and all(r["mismatch/count"] == 0 and r["memory/engine_weight_copy_mb"] == 0 for r in records)
    assert not (run / "checkpoints").exists() and (run / "policy" / "config.json").exists()
