"""Tiny local checkpoints for tests: a random-init model plus a real tokenizer, nothing downloaded.

``make_tiny_checkpoint(dir, family="qwen3", **hf_config_overrides)`` (``family`` also a variant of :data:`VARIANTS`,
e.g. ``"qwen3_next_moe"``: Qwen3-Next with sparse layers) writes a Hugging Face
format directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a
ChatML chat template, generation_config.json) that ``load_model``/``load_tokenizer``, the CLI
and transformers all read. The tokenizer is a byte-level BPE trained here on a fixed synthetic
corpus (deterministic), so every string encodes.
"""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path

import torch

from rlalign.models import architectures
from rlalign.models.checkpoint import resolve_dtype, save_model
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")   # ids 0, 1, 2
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
TOKENIZER_VOCAB = 320
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_BASE = dict(vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
             max_position_embeddings=512, tie_word_embeddings=False, hidden_act="silu",
             bos_token_id=None, pad_token_id=0, eos_token_id=2)


# small family-specific keys (gpt_oss: 4 experts of 32, top-2; a sliding window of 8 on layer 0, full layer 1;
# YaRN rope over an original context of 64; qwen3_next, deepseek_v3: below)
_FAMILY_BASE = {"gpt_oss": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-5,
                                rope_theta=150000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                                   "beta_slow": 1.0, "truncate": False,
                                                                   "original_max_position_embeddings": 64}),
               # qwen3_next: a Gated-DeltaNet layer (2 key heads, 4 value heads of 8, conv 4) then a gated full-attention
               # layer (rope on half of each head); dense MLPs (no experts)
               "qwen3_next": dict(num_experts=0, layer_types=["linear_attention", "full_attention"],
                                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                  linear_value_head_dim=8, linear_conv_kernel_dim=4, partial_rotary_factor=0.5),
               # deepseek_v3: MLA with a low-rank q (24), latent 16, K heads 16 + 8 rotated, V heads 12; layer 0
               # dense, layer 1 routed (8 experts in 2 groups, 1 group kept, top-2) + one shared expert
               "deepseek_v3": dict(num_key_value_heads=4, head_dim=8, intermediate_size=96, moe_intermediate_size=32,
                                   n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                   first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                                   q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                   v_head_dim=12, rope_interleave=True)}


# variants: a family's tiny config with more keys (name -> (family, keys)). qwen3_next_moe: both layers sparse
# (8 experts of 32, top-2, renormalised) with a gated shared expert of 48
VARIANTS = {"qwen3_next_moe": ("qwen3_next", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=48, norm_topk_prob=True,
                                                  decoder_sparse_step=1, mlp_only_layers=[]))}


def tiny_hf_config(family: str = "qwen3", **overrides) -> dict:
    """A small config.json dict of ``family`` (hidden 64, 2 layers, 4 heads / 2 kv heads, head_dim 16,
    vocab 320) or of a variant (:data:`VARIANTS`); ``overrides`` use Hugging Face key names."""
    family, variant = VARIANTS.get(family, (family, {}))
    if family not in architectures.names():
        raise ValueError(f"unknown family {family!r} (choose one of {', '.join(architectures.names() + tuple(VARIANTS))})")
    cfg = dict(_BASE, model_type=family, architectures=[architectures.get(family).architecture])
    cfg.update(_FAMILY_BASE.get(family, {}))
    cfg.update(variant)
    cfg.update(overrides)
    return cfg


def tiny_model(family: str = "qwen3", *, seed: int = 0, dtype: str | torch.dtype = "float32", init_std: float = 0.02,
               norm_jitter: float = 0.0, device="cpu", **overrides) -> CausalLM:
    """An in-memory random-init model (same init as make_tiny_checkpoint)."""
    config = ModelConfig.from_hf_dict(tiny_hf_config(family, **overrides))
    model = CausalLM(config, dtype=resolve_dtype(dtype), device=device)
    return model.init_random_(seed=seed, std=init_std, norm_jitter=norm_jitter).eval()


def make_tiny_checkpoint(directory: str | os.PathLike, family: str = "qwen3", *, seed: int = 0,
                         dtype: str = "float32", init_std: float = 0.02, norm_jitter: float = 0.0,
                         max_shard_bytes: int | None = None, **config_overrides) -> Path:
    """Write a tiny random-init checkpoint + tokenizer to ``directory``; returns its path.

    ``config_overrides`` are config.json keys (``num_hidden_layers=1``, ``tie_word_embeddings=True``,
    ``rope_scaling={...}``, ...); vocab_size must be >= 320 (the tokenizer's size).
    """
    model = tiny_model(family, seed=seed, dtype=dtype, init_std=init_std, norm_jitter=norm_jitter,
                       **config_overrides)
    if model.config.vocab_size < TOKENIZER_VOCAB:
        raise ValueError(f"vocab_size={model.config.vocab_size} is smaller than the tiny tokenizer ({TOKENIZER_VOCAB})")
    path = save_model(model, directory, max_shard_bytes=max_shard_bytes)
    write_tiny_tokenizer(path)
    return path


def make_tiny_reward_model(directory: str | os.PathLike, family: str = "qwen3", *, seed: int = 0,
                           dtype: str = "float32", score_std: float = 0.5, **config_overrides) -> Path:
    """A tiny ``*ForSequenceClassification`` checkpoint (one label) + tokenizer: the decoder of
    :func:`tiny_model` and a random ``score`` head ~ N(0, score_std); config.json as transformers writes it."""
    from safetensors.torch import save_file

    model = tiny_model(family, seed=seed, dtype=dtype, **config_overrides)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed + 1)
    score = (score_std * torch.randn((1, model.config.hidden_size), generator=gen)).to(model.dtype)
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters() if n.startswith("model.")}
    save_file({**tensors, "score.weight": score}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_hf_dict()
    config.update(architectures=[architectures.get(config["model_type"]).architecture.removesuffix("ForCausalLM")
                                 + "ForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tiny_tokenizer(path)
    return path


def write_tiny_tokenizer(directory: str | os.PathLike) -> None:
    d = Path(directory)
    (d / "tokenizer.json").write_text(_tiny_tokenizer_json())
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS_TOKEN,
                  "pad_token": PAD_TOKEN, "unk_token": None, "model_max_length": 512, "chat_template": CHAT_TEMPLATE,
                  "add_bos_token": False, "clean_up_tokenization_spaces": False}
    (d / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    gen = {"eos_token_id": [SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(PAD_TOKEN)],
           "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN)}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def synthetic_corpus(lines: int = 400, seed: int = 0) -> list[str]:
    """Deterministic English-ish sentences and small arithmetic, to train the tiny tokenizer on."""
    rng = random.Random(seed)
    words = ("the a model token reward policy value learn train sample answer question what is of to and "
             "in it you we they number sum plus minus equal yes no good bad hello world think step first then "
             "count letter word list sort reverse add result final").split()
    out = []
    for _ in range(lines):
        if rng.random() < 0.3:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            out.append(f"What is {a} + {b}? The answer is {a + b}.")
        else:
            n = rng.randint(4, 12)
            out.append(" ".join(rng.choice(words) for _ in range(n)).capitalize() + rng.choice(".?!"))
    return out


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    return tok.to_str(pretty=True)


__all__ = ["make_tiny_checkpoint", "make_tiny_reward_model", "tiny_model", "tiny_hf_config", "VARIANTS", "write_tiny_tokenizer", "synthetic_corpus",
           "SPECIAL_TOKENS", "EOS_TOKEN", "PAD_TOKEN", "CHAT_TEMPLATE"]
