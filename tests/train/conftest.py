from pathlib import Path

import pytest

from rlalign.models.checkpoint import save_model
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.train.pretrain import PretrainConfig, hf_config, write_char_tokenizer


def make_arithmetic_checkpoint(path, seed=0, **sizes):
    cfg = PretrainConfig(**{"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                            "intermediate_size": 64, **sizes})
    model = CausalLM(ModelConfig.from_hf_dict(hf_config(cfg))).init_random_(seed=seed, std=0.1)
    save_model(model, path)
    write_char_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def arithmetic_model_dir(tmp_path_factory):
    return make_arithmetic_checkpoint(tmp_path_factory.mktemp("arith_model") / "model")


DENSE_REWARD = f"{Path(__file__).with_name('rewards.py')}:first_digit"


def tiny_overrides(model_dir, run_dir, steps=3, dense_reward=False):
    """Overrides for a few fast steps; ``dense_reward`` makes a random model's updates non-zero."""
    return ([f"task.reward={DENSE_REWARD}"] if dense_reward else []) + [f"model.path={model_dir}", f"run.dir={run_dir}", f"run.steps={steps}", "run.eval_every=2",
            "run.checkpoint_every=1", "run.progress=false", "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4", "task.eval_size=8",
            "optim.micro_batch_tokens=64", "optim.lr=1e-2"]
