"""The plugin on, four families (Qwen3-MoE included), one child process (tests/integrations/vllm/plugin_checks.py):
vLLM's sampled tokens and logprobs equal rlalign's engine's, and its logprobs equal rlalign's trainer's
and the patched transformers model's bit for bit; unsupported settings are refused with one clear line."""

import json
from pathlib import Path

import pytest

from tests.integrations.vllm.helpers import FAMILIES, VLLM_MARKS, run_child, tail

pytestmark = VLLM_MARKS


@pytest.fixture(scope="module")
def report(vllm_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_plugin") / "report.json"
    proc = run_child([str(Path(__file__).with_name("plugin_checks.py")), str(out), str(vllm_checkpoints)], timeout=600)
    assert proc.returncode == 0 and out.is_file(), tail(proc)
    data = json.loads(out.read_text())
    assert not data["errors"], "\n".join(data["errors"])
    return data


def test_plugin_is_off_by_default(report):
    assert report["entry_point"] == "rlalign.integrations.vllm:register"
    assert report["registry_before_enable"] == "vllm.model_executor.models.qwen3"
    assert report["registry_after_enable"] == "rlalign.integrations.vllm.model"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("train", ["rlalign", "transformers"])
def test_vllm_logprobs_equal_trainer(report, family, train):
    r = report["families"][family][train]
    assert r["note"] == "" and r["tokens_compared"] >= 100
    assert r["mismatches"] == 0, f"{family} vs {train}: first mismatch {r['first']}"


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_samples_equal_rlalign_engine(report, family):
    r = report["families"][family]
    assert r["weights_hash_equal"]
    assert r["tokens_equal_rlalign_engine"], f"{family}: first vLLM tokens {r['first_tokens']}"
    assert r["logprobs_equal_rlalign_engine"]


def test_vllm_sampler_goes_through_the_one_owner(report):
    """A wrong temperature rule planted in rlalign.ops.temperature moves vLLM's logprobs as it moves the engine's."""
    r = report["families"]["qwen3"]["planted_rule"]
    assert r["recorded_logprob_temperature"] == 1.0
    assert r["tokens_unchanged"] and r["logprobs_changed"], r
    assert r["equal_rlalign_engine"], r
    assert r["trainer_tokens_compared"] >= 100 and r["trainer_mismatches"] == 0, r


def test_prefix_cached_prompts_still_equal_rlalign_engine(report):
    r = report["prefix_cache"]
    seen = r["second_round_first_forward"]
    assert seen["computed"] < seen["context"] / 2, seen   # the prompts' full blocks came from the prefix cache
    assert r["first_equal"] and r["cached_equal"]


@pytest.mark.parametrize("setting, message", [
    ("tensor_parallel_size=2", "tensor_parallel_size=2 is not supported"),
    ("kv_cache_dtype=fp8", "kv_cache_dtype='fp8' is not supported"),
    ("dtype=float16", "dtype=float16 is not supported in the strict profile"),
    ("enable_lora=True", "LoRA adapters are not supported (serve the merged model"),
    ("logprobs=3", "logprobs=3 is not supported"),
    ("no seed", "pass SamplingParams(seed=...)"),
    ("repetition_penalty=1.3", "a request uses a logits transform"),
    ("prompt_logprobs=1", "prompt_logprobs is not supported"),
])
def test_unsupported_settings_are_refused(report, setting, message):
    got = report["refusals"][setting]
    assert got.startswith("rlalign vLLM plugin: ") and message in got, got
