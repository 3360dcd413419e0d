"""The portable profile end to end on the embedded default model: the rollout engine's logprobs equal the trainer's
bit for bit (``rlalign parity --profile portable``), a recorded portable rollout replays bitwise, and what the
profile does not cover refuses in one line. CPU vs CUDA: tests/cuda/test_cuda_portable.py."""

from __future__ import annotations

import struct

import pytest

from rlalign.configlib import ConfigError, load_config
from rlalign.parity.run import ParityError, ParityOptions, run_parity
from rlalign.rollout.config import RolloutConfig
from rlalign.rollout.errors import RolloutConfigError
from rlalign.train.config import TrainConfig


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9),
                                      dict(temperature=0.0)])
def test_rollout_equals_trainer_bitwise_on_the_default_model(sampling):
    result = run_parity(ParityOptions(model="default", profile="portable", prompts=3, samples=2, max_new_tokens=10,
                                      seed=3, **sampling))
    assert result.ok and result.tokens.mismatches == 0 and result.tokens.tokens_compared > 0


def test_portable_logprobs_are_close_to_strict_ones():
    """The portable profile really runs (its bits differ from strict's) and computes the same distribution."""
    runs = {p: run_parity(ParityOptions(model="default", profile=p, prompts=2, samples=1, max_new_tokens=8,
                                        temperature=0.0)) for p in ("strict", "portable")}
    strict, portable = (runs[p].record.sequences for p in ("strict", "portable"))
    pairs = [(a, b) for s, p in zip(strict, portable) for a, b in zip(s.logprobs, p.logprobs)]
    assert [s.tokens for s in strict] == [p.tokens for p in portable]   # greedy: the same tokens
    assert max(abs(a - b) for a, b in pairs) < 1e-4
    assert any(a != b for a, b in pairs)


def test_a_recorded_portable_rollout_replays_bitwise_and_only_in_portable(tmp_path):
    path = tmp_path / "rollout.jsonl"
    first = run_parity(ParityOptions(model="default", profile="portable", prompts=2, samples=2, max_new_tokens=6,
                                     temperature=0.8, record=str(path)))
    again = run_parity(ParityOptions(model="default", profile="portable", replay=str(path)))
    assert first.ok and again.ok and again.tokens.tokens_compared == first.tokens.tokens_compared
    with pytest.raises(ParityError, match="recorded in the portable profile: score it with --profile portable"):
        run_parity(ParityOptions(model="default", profile="strict", replay=str(path)))


def test_what_the_profile_does_not_cover_refuses():
    with pytest.raises(ParityError, match="--profile portable runs rlalign's own sides only"):
        run_parity(ParityOptions(model="default", profile="portable", train="transformers"))
    with pytest.raises(ConfigError, match="run.profile=portable does not train with model.lora"):
        load_config(TrainConfig, None, ["run.profile=portable", "model.lora.rank=4"])
    from rlalign.models import load_model
    from rlalign.parity.run import resolve_model_dir
    from rlalign.rollout import RolloutEngine
    model, _ = load_model(resolve_model_dir("default"))
    with pytest.raises(RolloutConfigError, match="the portable profile decodes eagerly"):
        RolloutEngine(model, RolloutConfig(profile="portable", decode_graphs="padded"))


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3-bf16"])
def test_rollout_equals_trainer_bitwise_across_dense_families(checkpoints, family):
    result = run_parity(ParityOptions(model=str(checkpoints[family]), profile="portable", prompts=2, samples=2,
                                      max_new_tokens=6, temperature=0.9, top_p=0.9))
    assert result.ok and result.tokens.mismatches == 0 and result.tokens.tokens_compared > 0


def test_a_mixture_of_experts_model_refuses(checkpoints):
    from rlalign.contract.errors import ContractError
    with pytest.raises(ContractError, match="not implemented in the portable profile"):
        run_parity(ParityOptions(model=str(checkpoints["qwen3_moe"]), profile="portable", prompts=1, samples=1,
                                 max_new_tokens=2))


@pytest.mark.parametrize("scaling", [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_llama3_rope(tmp_path, scaling):
    from rlalign.models.testing import make_tiny_checkpoint
    model = make_tiny_checkpoint(tmp_path / "m", family="llama", num_hidden_layers=2, rope_scaling=scaling)
    result = run_parity(ParityOptions(model=str(model), profile="portable", prompts=2, samples=1, max_new_tokens=6))
    assert result.ok and result.tokens.mismatches == 0


def test_the_command(capsys, tmp_path):
    """``rlalign parity --model default --profile portable``: exit 0, zero mismatches; a replay in another profile:
    one line, exit 2."""
    import json
    from rlalign.cli.main import main
    record = tmp_path / "r.jsonl"
    assert main(["parity", "--model", "default", "--profile", "portable", "--json", "--record", str(record)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ok"] and summary["mismatches"] == 0 and summary["tokens_compared"] > 0
    assert main(["parity", "--model", "default", "--replay", str(record)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "recorded in the portable profile" in err[0]


def test_lora_adapters_rollout_equals_trainer():
    """Unmerged LoRA runs on ops.linear and elementwise ops: its forward is portable too (B made non-zero)."""
    import torch
    from rlalign.models.lora import LoRASpec, apply_lora
    from rlalign.models.testing import tiny_model
    from rlalign.parity.sides import RLAlignRollout, RLAlignTrainer
    model = tiny_model("qwen3", seed=1, num_hidden_layers=2)
    apply_lora(model, LoRASpec(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "down_proj")), seed=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    record = RLAlignRollout(model, "portable").generate([[5, 6, 7], [8, 9]], n=2, max_new_tokens=5, temperature=0.9)
    scored = RLAlignTrainer(model, "portable").score(record)
    bits = [[struct.pack("<f", v) for v in s] for s in scored]
    assert bits == [[struct.pack("<f", v) for v in s.logprobs] for s in record.sequences]


def test_a_whole_rollout_and_its_scoring_use_only_portable_arithmetic():
    """The census of tests/ops/test_portable_ops.py over the engine and the trainer end to end (every aten op the
    model, the engine's bookkeeping, the sampler and the scorer call): nothing outside the ops leaks library math."""
    from rlalign.models.testing import tiny_model
    from rlalign.parity.sides import RLAlignRollout, RLAlignTrainer
    from tests.ops.test_portable_ops import _Census
    model = tiny_model("qwen3", seed=1, num_hidden_layers=2)
    census = _Census()
    with census:
        record = RLAlignRollout(model, "portable").generate([[5, 6, 7], [8, 9]], n=2, max_new_tokens=5,
                                                            temperature=0.9, top_k=5, top_p=0.9)
        RLAlignTrainer(model, "portable").score(record)
    assert not census.bad, f"library math or reductions in a portable rollout: {dict(census.bad)}"


@pytest.mark.parametrize("engine", [dict(page_size=1), dict(page_size=3, max_prefill_chunk=2),
                                    dict(page_size=16, max_num_seqs=1), dict(page_size=5, enable_prefix_caching=False)])
def test_engine_layouts_change_no_bit(engine):
    """Page size, chunked prefill, how many sequences share a step, prefix caching: the same tokens and logprob bits
    as the trainer's packed forward, and as the default engine."""
    from rlalign.models.testing import tiny_model
    from rlalign.parity.sides import RLAlignRollout, RLAlignTrainer
    model = tiny_model("qwen3", seed=4, num_hidden_layers=2)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 12], [13]]
    kwargs = dict(n=2, max_new_tokens=7, temperature=0.8, top_p=0.95, seed=5)
    record = RLAlignRollout(model, "portable", engine).generate(prompts, **kwargs)
    default = RLAlignRollout(model, "portable").generate(prompts, **kwargs)

    def bits(seqs):
        return [(s.tokens, [struct.pack("<f", v) for v in s.logprobs]) for s in seqs]

    assert bits(record.sequences) == bits(default.sequences)
    scored = RLAlignTrainer(model, "portable").score(record)
    assert [[struct.pack("<f", v) for v in s] for s in scored] == [b for _, b in bits(record.sequences)]


def test_a_linear_attention_model_refuses():
    """Qwen3-Next's Gated-DeltaNet layers have no portable implementation: one line, no strict fallback."""
    from rlalign.contract.errors import ContractError
    from rlalign.models.testing import tiny_model
    from rlalign.parity.sides import RLAlignRollout
    model = tiny_model("qwen3_next", seed=2)
    with pytest.raises(ContractError, match="not implemented in the portable profile"):
        RLAlignRollout(model, "portable").generate([[5, 6, 7]], n=1, max_new_tokens=2)
