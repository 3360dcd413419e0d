"""The TRL recipe of docs/parity.md, run: TRL's GRPOTrainer (trl 1.16) for a few steps on a tiny local
model whose per-token logprobs come from the patched model through the recipe's override.

Checks that the override is the method TRL calls (an override of a name TRL no longer has does
nothing, silently: the bug this replaces), that it returns what TRL expects (logps, entropies,
aux loss), and that every logprob TRL trained on equals, bit for bit, a fresh computation: a new
patched model built from the weights of that moment (no state carried from earlier steps).
"""

import copy

import pytest
import torch

from tests.bitwise import assert_bitwise_equal

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from rlalign.integrations.transformers import patch, token_logprobs  # noqa: E402


def _recipe_trainer_class(calls):
    class RLAlignGRPOTrainer(trl.GRPOTrainer):
        # --- the recipe (docs/parity.md), verbatim except for the recording below ---
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **kwargs):
            # row s scores token s + 1: the completion's K tokens are scored by rows S-K-1 .. S-2
            out = token_logprobs(model, input_ids, attention_mask, temperature=self.temperature,
                                 with_entropy=compute_entropy)
            logps = out.logprobs[:, -logits_to_keep - 1:-1]
            entropies = out.entropy[:, -logits_to_keep - 1:-1] if compute_entropy else None
            # --- recording for the test ---
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            calls.append((input_ids.clone(), attention_mask.clone(), logits_to_keep, logps.detach().clone(), weights))
            return logps, entropies, None

    return RLAlignGRPOTrainer


# TRL's default optimizer is fused AdamW (``adamw_torch_fused``): it updates the parameters in place without
# bumping their version counters. Before 2026-12-01 the strict CPU linear cached weight-derived copies keyed on
# those counters, so the patched model scored with stale weights after the first optimizer step (16 of 16
# logprobs off, max |diff| 0.12); the caches are gone and both optimizers must match.


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_trl_grpo_trainer_with_the_recipe(tmp_path, optim):
    from rlalign.models.testing import make_tiny_checkpoint
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", family="qwen3", dtype="float32", norm_jitter=0.1,
                                tie_word_embeddings=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    policy = patch(copy.deepcopy(base))
    data = datasets.Dataset.from_dict({"prompt": ["ab", "bc", "cd", "de"] * 2})
    calls = []
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=4, max_steps=3, learning_rate=1e-2, logging_steps=1, report_to=[],
                          use_cpu=True, save_strategy="no", seed=0, temperature=1.0,
                          generation_kwargs={"use_cache": False}, optim=optim, disable_tqdm=True)
    trainer = _recipe_trainer_class(calls)(model=policy, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                                           args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()

    assert len(calls) >= 3, "TRL never called the recipe's override: the recipe would silently do nothing"
    moved = any(not torch.equal(calls[0][4][k], calls[-1][4][k]) for k in calls[0][4])
    assert moved, "the weights never changed: the test would not see stale state after an optimizer step"
    for input_ids, mask, keep, logps, weights in calls:
        fresh = copy.deepcopy(base)
        fresh.load_state_dict(weights)
        fresh = patch(fresh)
        with torch.no_grad():
            expected = token_logprobs(fresh, input_ids, mask, temperature=1.0).logprobs[:, -keep - 1:-1]
        assert_bitwise_equal(logps, expected, f"logprobs at a call with {keep} completion tokens")
