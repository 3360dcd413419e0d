"""Runs in ONE child process (vLLM engines are process-wide; one start-up shared by every check here):

    python plugin_checks.py OUT.json CKPT_ROOT

For each family (qwen3, qwen2, llama, qwen3_moe): a vLLM rollout with the plugin on, scored by rlalign's trainer
and by the patched transformers model (``compare_tokens``, the parity CLI's comparison), and compared
with rlalign's own rollout engine (tokens and logprobs). Then refusals on a running engine and on
engine configs. Writes a JSON report; the pytest module asserts on it.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

FAMILIES = ("qwen3", "qwen2", "llama", "qwen3_moe")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30]]
SAMPLING = dict(n=3, max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=11)


def switch_report() -> dict:
    """The entry point vLLM finds, and the Qwen3 model class before and after ``rlalign.enable()``."""
    from importlib.metadata import entry_points

    import rlalign
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins
    load_general_plugins()        # what vllm.LLM does first; the plugin must stay inert until enabled
    before = ModelRegistry.models["Qwen3ForCausalLM"].module_name
    rlalign.enable()
    after = ModelRegistry.models["Qwen3ForCausalLM"].module_name
    points = {p.name: p.value for p in entry_points(group="vllm.general_plugins")}
    return {"entry_point": points.get("rlalign"), "registry_before_enable": before, "registry_after_enable": after}


def family_report(directory: Path) -> dict:
    import rlalign.integrations  # noqa: F401  (registers the vllm rollout side and the transformers training side)
    from rlalign.models.checkpoint import load_model
    from rlalign.parity.run import ParityOptions, build_rollout, build_trainer, compare_tokens
    from rlalign.parity.sides import RLAlignRollout

    model, _ = load_model(directory)
    rollout = build_rollout(ParityOptions(model=str(directory), rollout="vllm"), model, directory)
    record = rollout.generate(PROMPTS, **SAMPLING)
    reference = RLAlignRollout(model).generate(PROMPTS, **SAMPLING)
    out = {"sequences": len(record.sequences), "weights_hash_equal": record.weights_hash == reference.weights_hash,
           "tokens_equal_rlalign_engine": [s.tokens for s in record.sequences] == [s.tokens for s in reference.sequences],
           "logprobs_equal_rlalign_engine": [s.logprobs for s in record.sequences] == [s.logprobs for s in reference.sequences],
           "first_tokens": record.sequences[0].tokens[:6]}
    for train in ("rlalign", "transformers"):
        trainer = build_trainer(ParityOptions(model=str(directory), train=train), model, directory)
        tokens = compare_tokens(record, trainer)
        out[train] = {"tokens_compared": tokens.tokens_compared, "mismatches": tokens.mismatches,
                      "first": None if tokens.first is None else str(tokens.first), "note": tokens.not_comparable}
    if directory.name == "qwen3":
        out["planted_rule"] = planted_rule_report(rollout, model, record)
    rollout.engine.close()   # before the next engine starts: vLLM's parallel state is process-wide
    return out


def planted_rule_report(rollout, model, honest) -> dict:
    """vLLM's sampler hook samples-and-scores through rlalign's one owner (ops.sample_and_score), which reads
    the temperature rule from rlalign.ops.temperature: with a wrong rule planted there (score every token at
    T = 1 whatever it was sampled at), vLLM's tokens stay, its logprobs move to the trainer's at T = 1, and it
    still equals rlalign's engine under the same plant. A hook with its own copy of the rule would not move."""
    from rlalign.ops import temperature as rule
    from rlalign.parity.run import compare_tokens
    from rlalign.parity.sides import RLAlignRollout, RLAlignTrainer

    honest_rule = rule.logprob_temperature
    rule.logprob_temperature = lambda t: 1.0
    try:
        planted = rollout.generate(PROMPTS, **SAMPLING)
        reference = RLAlignRollout(model).generate(PROMPTS, **SAMPLING)
    finally:
        rule.logprob_temperature = honest_rule
    scored = compare_tokens(planted, RLAlignTrainer(model))   # at the record's logprob temperature
    return {"recorded_logprob_temperature": planted.logprob_temperature,
            "tokens_unchanged": [s.tokens for s in planted.sequences] == [s.tokens for s in honest.sequences],
            "logprobs_changed": [s.logprobs for s in planted.sequences] != [s.logprobs for s in honest.sequences],
            "equal_rlalign_engine": [(s.tokens, s.logprobs) for s in planted.sequences]
            == [(s.tokens, s.logprobs) for s in reference.sequences],
            "trainer_tokens_compared": scored.tokens_compared, "trainer_mismatches": scored.mismatches}


def prefix_cache_report(directory: Path) -> dict:
    """The same prompts twice through one engine with 32-token blocks: the second round reads the prompts'
    full blocks from vLLM's prefix cache (the plugin's K/V written by the first round) and must still
    equal rlalign's engine."""
    from rlalign.integrations.vllm.engine import VLLMEngine, VLLMEngineConfig
    from rlalign.integrations.vllm.model import RLAlignForCausalLM
    from rlalign.models.checkpoint import load_model
    from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams

    long = list(range(3, 80))
    prompts, sampling = [long, long + [5], long[:40]], SamplingParams(n=3, max_new_tokens=8, seed=5, ignore_eos=True)
    engine = VLLMEngine(directory, VLLMEngineConfig(block_size=32))
    first = engine.generate(prompts, sampling)
    computed = []
    build = RLAlignForCausalLM._batch

    def counting(self, *args):
        batch = build(self, *args)
        computed.append((batch.num_tokens, int(batch.seq_lens.sum())))
        return batch
    RLAlignForCausalLM._batch = counting
    try:
        second = engine.generate(prompts, sampling)
    finally:
        RLAlignForCausalLM._batch = build
        engine.close()
    model, _ = load_model(directory)
    ref = RolloutEngine(model, RolloutConfig()).generate(prompts, sampling)

    def key(completions):
        return [(c.tokens, c.logprobs) for c in completions]
    return {"first_equal": key(first) == key(ref), "cached_equal": key(second) == key(ref),
            "second_round_first_forward": {"computed": computed[0][0], "context": computed[0][1]}}


def refusal(engine, **params) -> str:
    """The message a request with these vLLM SamplingParams is refused with ('' if it ran)."""
    import vllm
    from vllm.inputs import TokensPrompt
    try:
        engine.llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], vllm.SamplingParams(max_tokens=2, **params),
                            use_tqdm=False)
    except Exception as exc:  # noqa: BLE001 -- report whatever surfaced
        return _message(exc)
    return ""


def config_refusal(directory: Path, **engine_args) -> str:
    from vllm.engine.arg_utils import EngineArgs

    from rlalign.integrations.vllm.checks import check_vllm_config
    from rlalign.models.checkpoint import load_model_config
    vllm_config = EngineArgs(model=str(directory), skip_tokenizer_init=True, **engine_args).create_engine_config()
    try:
        check_vllm_config(vllm_config, load_model_config(directory))
    except Exception as exc:  # noqa: BLE001
        return _message(exc)
    return ""


def _message(exc: BaseException) -> str:
    from rlalign.integrations.vllm.engine import _our_error
    ours = _our_error(exc)
    return str(ours) if ours is not None else f"{type(exc).__name__}: {exc}"


def main(out_path: str, root: str) -> None:
    from rlalign.integrations.vllm.engine import VLLMEngine

    report: dict = {"families": {}, "refusals": {}, "errors": []}
    report.update(switch_report())
    for family in FAMILIES:
        try:
            report["families"][family] = family_report(Path(root) / family)
        except Exception:  # noqa: BLE001 -- the test prints it
            report["errors"].append(traceback.format_exc())
    ckpt = Path(root) / "qwen3"
    try:
        report["prefix_cache"] = prefix_cache_report(Path(root) / "llama")
    except Exception:  # noqa: BLE001
        report["errors"].append(traceback.format_exc())
    try:
        refusals = report["refusals"]
        refusals["tensor_parallel_size=2"] = config_refusal(ckpt, tensor_parallel_size=2)
        refusals["kv_cache_dtype=fp8"] = config_refusal(ckpt, kv_cache_dtype="fp8")
        refusals["dtype=float16"] = config_refusal(ckpt, dtype="float16")
        refusals["enable_lora=True"] = config_refusal(ckpt, enable_lora=True)
        # a refused request fails the engine step that runs it: one fresh engine per refused request
        for name, params in (("logprobs=3", dict(temperature=1.0, seed=1, logprobs=3)),
                             ("no seed", dict(temperature=1.0, logprobs=0)),
                             ("repetition_penalty=1.3", dict(temperature=1.0, seed=1, repetition_penalty=1.3)),
                             ("prompt_logprobs=1", dict(temperature=1.0, seed=1, logprobs=0, prompt_logprobs=1))):
            engine = VLLMEngine(ckpt)
            refusals[name] = refusal(engine, **params)
            engine.close()
    except Exception:  # noqa: BLE001
        report["errors"].append(traceback.format_exc())
    Path(out_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
