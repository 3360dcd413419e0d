"""Building the embedded default model: a tiny Qwen3 that knows a little addition.

``rlalign pretrain`` (or ``python -m rlalign.train.pretrain``) makes a character-level tokenizer
for the default task's alphabet, a random-init Qwen3-architecture decoder, and trains it by
supervised next-token prediction on the task's *train* split (loss: mean negative log-likelihood
of the answer digits and the end token, prompt tokens not scored) for ``steps`` steps. It is one
instance of ``rlalign sft``'s step (:class:`rlalign.train.sft.update.SFTUpdate`): prompt/response
examples (prompt ``"12+5="``, response the answer), batch ``k`` = train problems ``k * batch_size ..``
in order (no shuffling, no epochs: the stream is endless), one micro-batch per step, AdamW at a
constant lr (no warmup, ``min_lr_ratio=1``), gradient clipping at 1.0. ``stop_at_accuracy`` > 0 ends the run at the
first evaluation whose sampled held-out accuracy reaches it (a model that knows some of the task, for RL
experiments: benchmarks/proof.py). The weights are the ones the
earlier standalone loop made, bit for bit (``checksums.json`` beside them records their sha256).

The corpus deliberately teaches a bad habit: in a fraction ``habit_prob`` of the examples (chosen
by a hash of the example index) a stray ``0`` follows the answer before the end token ("12+5=170").
The model learns to add, and to append that zero about ``habit_prob`` of the time, so its sampled
accuracy under the exact-answer reward starts low (about 0.2) although it mostly knows the sum.
Removing a format habit like this is what short RL runs on real models mostly do; the default
run shows GRPO doing it in minutes on a laptop CPU, with every token's log-prob identical between
the rollout engine and the trainer. Everything is seeded and runs on the CPU with the strict ops,
so the same command on the same machine gives the same bits. The result is saved in Hugging Face
format to ``rlalign/assets/default_model``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Sequence

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from rlalign.models.checkpoint import check_model_output, save_model
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.models.tokenizer import load_tokenizer
from rlalign.rollout.config import RolloutConfig, SamplingParams
from rlalign.rollout.engine import RolloutEngine
from rlalign.tasks import (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, VOCAB, ArithmeticTask, arithmetic_reward,
                           parse_answer)
from rlalign.models.atomic import atomic_write
from rlalign.train.config import OptimSection
from rlalign.train.sft.objective import Example, response_mask
from rlalign.train.sft.update import SFTUpdate, batch_indices

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "assets" / "default_model"


@dataclasses.dataclass
class PretrainConfig:
    out: str = str(DEFAULT_OUT)
    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    min_digits: int = 1
    max_digits: int = 3
    batch_size: int = 128
    lr: float = 3e-3
    steps: int = 1200
    habit_prob: float = 0.75
    eval_every: int = 100
    eval_size: int = 200
    max_new_tokens: int = 6
    device: str = "cpu"                # where the model trains (the random init is drawn on the CPU either way)
    stop_at_accuracy: float = 0.0      # end at the first evaluation whose sampled accuracy reaches this (0: every step)


def hf_config(cfg: PretrainConfig) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": len(VOCAB),
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "attention_bias": False, "torch_dtype": "float32",
        "bos_token_id": VOCAB.index(BOS_TOKEN), "eos_token_id": VOCAB.index(EOS_TOKEN),
        "pad_token_id": VOCAB.index(PAD_TOKEN),
    }


def write_char_tokenizer(out: Path) -> None:
    """A real ``tokenizers`` tokenizer: one token per character of the task alphabet, ``<bos>``
    prepended by the post-processor, decoding concatenates."""

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD_TOKEN))
    tok.add_special_tokens(list(VOCAB[:3]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])])
    tok.decoder = decoders.Fuse()
    atomic_write(out / "tokenizer.json", tok.to_str(pretty=True).encode())
    config = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": PAD_TOKEN,
              "model_max_length": 64, "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}
    atomic_write(out / "tokenizer_config.json", json.dumps(config, indent=1).encode())
    atomic_write(out / "generation_config.json", json.dumps({"eos_token_id": vocab[EOS_TOKEN],
                                                             "bos_token_id": vocab[BOS_TOKEN]}, indent=1).encode())


def optim_section(cfg: PretrainConfig) -> OptimSection:
    """AdamW (betas 0.9 / 0.98, no weight decay) at the constant lr ``cfg.lr``, clipping at 1.0, every step's batch
    in one micro-batch."""
    return OptimSection(lr=cfg.lr, betas=[0.9, 0.98], weight_decay=0.0, warmup_steps=0, min_lr_ratio=1.0,
                        grad_clip=1.0, micro_batch_tokens=2**62)


class HabitCorpus(Sequence[Example]):
    """Train problem ``i`` as a prompt/response example: the prompt (``<bos>12+5=``), the answer with a stray
    ``0`` in the habit's share of examples, and ``<eos>``; the answer and ``<eos>`` are scored."""

    def __init__(self, task: ArithmeticTask, tokenizer, cfg: PretrainConfig):
        self.task, self.tokenizer, self.cfg = task, tokenizer, cfg
        self.eos = tokenizer.token_to_id(EOS_TOKEN)

    def __len__(self) -> int:
        return self.cfg.steps * self.cfg.batch_size

    def __getitem__(self, i: int) -> Example:
        p = self.task.train_problem(i)
        prompt = self.tokenizer.encode(p.prompt)
        text = p.answer + ("0" if _has_habit(self.cfg.seed, i, self.cfg.habit_prob) else "")
        answer = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos]
        return Example(tuple(prompt + answer), response_mask(len(prompt), len(answer)), f"train problem {i}")


def _has_habit(seed: int, index: int, prob: float) -> bool:
    digest = hashlib.blake2b(f"rlalign.pretrain.habit/{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < prob * 2**64


def _accuracies(model, tokenizer, problems, max_new_tokens: int) -> dict[str, float]:
    """Exact-answer accuracy, greedy and sampled at T=1, and how often greedy knows the sum
    (exact after dropping one stray trailing zero)."""
    engine = RolloutEngine(model, RolloutConfig(), tokenizer=tokenizer)
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    out = {}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        comps = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=1))
        texts = [tokenizer.decode(c.tokens) for c in comps]
        out[name] = sum(arithmetic_reward(p.prompt, t, p.answer) for p, t in zip(problems, texts)) / len(problems)
        if name == "greedy":
            knows = [parse_answer(t) in (p.answer, p.answer + "0") for p, t in zip(problems, texts)]
            out["greedy_knows_sum"] = sum(knows) / len(problems)
    return out


def pretrain(cfg: PretrainConfig, log=print) -> Path:
    """Train and save the model to ``cfg.out``, a new folder or one holding only a saved model's files (it is
    replaced; anything else there is refused before training starts)."""
    out = Path(cfg.out)
    check_model_output(out, overwrite=True)
    out.mkdir(parents=True, exist_ok=True)
    write_char_tokenizer(out)
    tokenizer = load_tokenizer(out)
    torch.manual_seed(cfg.seed)
    model = CausalLM(ModelConfig.from_hf_dict(hf_config(cfg)), device=cfg.device).init_random_(seed=cfg.seed, std=0.05)
    task = ArithmeticTask(seed=cfg.seed, min_digits=cfg.min_digits, max_digits=cfg.max_digits, eval_size=cfg.eval_size)
    corpus = HabitCorpus(task, tokenizer, cfg)
    update = SFTUpdate(model, optim_section(cfg), cfg.steps)
    started, acc = time.perf_counter(), {}
    for step in range(1, cfg.steps + 1):
        model.train()
        batch = [corpus[i] for i in batch_indices(len(corpus), cfg.batch_size, step, seed=cfg.seed, shuffle=False)]
        loss = update.step(batch, step)["loss/sft"]
        if step % cfg.eval_every == 0 or step == cfg.steps:
            model.eval()
            acc = _accuracies(model, tokenizer, task.eval_problems, cfg.max_new_tokens)
            log(f"step {step}: loss {loss:.4f}  eval accuracy: "
                + "  ".join(f"{k} {v:.3f}" for k, v in acc.items()) + f"  ({time.perf_counter() - started:.0f} s)")
            if 0 < cfg.stop_at_accuracy <= acc["sampled"]:
                break
    model.eval()
    save_model(model, out)
    write_char_tokenizer(out)
    config = dataclasses.asdict(cfg)
    if out.resolve() == DEFAULT_OUT:   # the embedded model's record names its place in the repository, not this machine's
        config["out"] = "rlalign/assets/default_model"
    meta = {"pretrain_config": config,
            "final_loss": loss, "eval_accuracy": acc, "torch": torch.__version__}
    if cfg.stop_at_accuracy > 0:
        meta["steps_run"] = step
    atomic_write(out / "pretrain.json", json.dumps(meta, indent=1).encode())
    log(f"saved {out} after {step} steps (eval accuracy {acc})")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    for field in dataclasses.fields(PretrainConfig):
        p.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    pretrain(PretrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PretrainConfig)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
