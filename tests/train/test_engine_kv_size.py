"""The trainer's engine on a GPU sizes its KV cache to one step's sequences (``engines.step_kv_cache_bytes``) when
``rollout.kv_cache_bytes`` is unset, not to a fraction of the memory free when it is built: the gradients, AdamW
state and activations the trainer allocates afterwards need that memory (a Qwen3-0.6B multi-turn run on an 80 GB
card ran out of it in its second step). The dry-run budget reports the same bytes the engine gets."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign.models.config import ModelConfig
from rlalign.models.sizes import kv_bytes_per_token
from rlalign.models.testing import make_tiny_checkpoint, tiny_hf_config
from rlalign.train import budget
from rlalign.train.engines import PROMPT_TOKENS_ESTIMATE, _engine_config, step_kv_cache_bytes
from rlalign.train.run.config_file import resolve_train_config


def _policy_on(device: str, config: ModelConfig, elem: int):
    """What _engine_config reads of a policy: its config and a parameter's device and element size."""
    param = types.SimpleNamespace(device=torch.device(device), element_size=lambda: elem)
    return types.SimpleNamespace(config=config, parameters=lambda: iter([param]))


@settings(max_examples=40, deadline=None)
@given(prompts=st.integers(1, 64), samples=st.integers(2, 16), new=st.integers(1, 512), episode=st.integers(1, 512),
       multi_turn=st.booleans(), elem=st.sampled_from([2, 4]))
def test_a_gpu_engine_gets_the_steps_kv_and_the_budget_reports_it(prompts, samples, new, episode, multi_turn, elem):
    overrides = [f"rollout.prompts_per_step={prompts}", f"rollout.samples_per_prompt={samples}",
                 f"rollout.max_new_tokens={new}", f"task.max_episode_tokens={episode}"]
    if multi_turn:
        overrides.append("task.env=retry_arithmetic")
    cfg = resolve_train_config(None, overrides)
    model = ModelConfig.from_hf_dict(tiny_hf_config("qwen3"))
    continuation = episode if multi_turn else new
    expected = max(prompts * samples * (PROMPT_TOKENS_ESTIMATE + continuation), cfg.rollout.page_size) \
        * kv_bytes_per_token(model, elem)
    assert step_kv_cache_bytes(cfg, model, elem) == expected
    assert _engine_config(cfg, _policy_on("cuda", model, elem)).kv_cache_bytes == expected
    assert _engine_config(cfg, _policy_on("cpu", model, elem)).kv_cache_bytes is None   # the CPU engine's 1 GiB
    rows = {r.component: r for r in budget.memory_budget(cfg, model)}
    dtype_bytes = budget._DTYPE_BYTES.get(str(cfg.model.dtype or model.dtype).replace("torch.", ""), 4)
    assert rows["KV cache (rollout)"].nbytes == step_kv_cache_bytes(cfg, model, dtype_bytes)


def test_a_set_kv_cache_bytes_is_kept_on_every_device():
    cfg = resolve_train_config(None, ["rollout.kv_cache_bytes=12345678"])
    model = ModelConfig.from_hf_dict(tiny_hf_config("qwen3"))
    for device in ("cuda", "cpu"):
        assert _engine_config(cfg, _policy_on(device, model, 2)).kv_cache_bytes == 12345678


@pytest.mark.cuda
def test_the_trainers_gpu_engine_leaves_the_free_memory_to_training(tmp_path):
    from rlalign.train.loop import Trainer

    make_tiny_checkpoint(tmp_path / "m")
    cfg = resolve_train_config(None, [f"model.path={tmp_path / 'm'}", "model.device=cuda", f"run.dir={tmp_path / 'r'}",
                                      "run.progress=false"])
    free_before, total = torch.cuda.mem_get_info()
    trainer = Trainer(cfg, None)
    try:
        engine = trainer.engine
        assert engine.blocks.num_pages * engine.bytes_per_page <= step_kv_cache_bytes(
            cfg, trainer.policy.config, next(trainer.policy.parameters()).element_size())
        free_after, _ = torch.cuda.mem_get_info()
        assert free_before - free_after < 0.2 * total, (free_before, free_after, total)
    finally:
        trainer.close()
        trainer.run_lock.release()
