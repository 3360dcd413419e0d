"""Write a Qwen3-MoE checkpoint (Hugging Face format): upcycled from a dense one, or random init of a published shape.

    python scripts/make_moe_model.py OUT_DIR [--dense default|DIR] [--experts 4] [--top-k 2] [--seed 0]
    python scripts/make_moe_model.py OUT_DIR --shape qwen3-30b-a3b [--layers 4] [--device cuda]

Upcycled (the default): every expert starts as a copy of its layer's dense MLP and the router is random
(rlalign.models.upcycle), so the MoE model starts with the dense model's skills; `configs/moe-cpu.yaml` trains
it with GRPO. The tokenizer files are copied from the dense checkpoint.

``--shape qwen3-30b-a3b``: Qwen3-30B-A3B's shape (hidden 2048, 32/4 heads of 128, 128 experts, top-8,
moe_intermediate 768, the full 151,936-token vocabulary), random init in bf16, ``--layers`` cutting the depth,
with a full-vocabulary tokenizer built here (:func:`full_vocab_tokenizer`). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import json

import torch

from rlalign.models import load_model, save_model
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.models.upcycle import upcycle

DEFAULT = Path(__file__).resolve().parents[1] / "rlalign" / "assets" / "default_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

SHAPES = {
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_hidden_layers=48,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, hidden_act="silu", attention_bias=False, router_aux_loss_coef=0.001,
        rope_scaling=None),
}


def full_vocab_tokenizer(default_dir: Path, vocab_size: int) -> dict:
    """The embedded default model's character-level tokenizer (<pad> <bos> <eos>, digits, +, =) grown to
    ``vocab_size`` entries: id 15 + i decodes to the decimal number 10 + i. Prompts still encode one
    character per token (the pre-tokenizer splits characters, and no number of two or more digits is one
    character), so the extra ids are reachable only by sampling; a random-init model's samples then decode
    to digit strings that a positional reward (configs/partial_credit.py) can score."""
    tok = json.loads((default_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    first = len(vocab)
    vocab.update({str(10 + i): first + i for i in range(vocab_size - first)})
    tok["model"]["vocab"] = vocab
    return tok


def random_shape(args) -> None:
    hf = dict(SHAPES[args.shape])
    if args.layers:
        hf["num_hidden_layers"] = args.layers
    default_cfg = json.loads((DEFAULT / "config.json").read_text())
    hf.update({k: default_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    model = CausalLM(ModelConfig.from_hf_dict(hf), dtype=torch.bfloat16, device=args.device).init_random_(seed=args.seed)
    out = save_model(model, args.out)
    (out / "tokenizer.json").write_text(json.dumps(full_vocab_tokenizer(DEFAULT, hf["vocab_size"])))
    for name in TOKENIZER_FILES[1:]:
        if (DEFAULT / name).exists():
            shutil.copy(DEFAULT / name, out / name)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {args.shape} shape, {hf['num_hidden_layers']} layers x {hf['num_experts']} experts "
          f"(top-{hf['num_experts_per_tok']}), vocab {hf['vocab_size']}, {n / 1e9:.2f} B parameters, random init")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--dense", default="default", help="a dense Qwen3 checkpoint dir, or 'default' (the embedded model)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", choices=sorted(SHAPES), help="random init of a published MoE shape (not upcycled)")
    ap.add_argument("--layers", type=int, help="with --shape: cut the depth to this many layers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="with --shape: where the weights are made (fast on a GPU)")
    args = ap.parse_args(argv)
    if args.shape:
        random_shape(args)
        return
    src = DEFAULT if args.dense == "default" else Path(args.dense)
    dense, _ = load_model(src)
    moe = upcycle(dense, args.experts, args.top_k, seed=args.seed)
    out = save_model(moe, args.out)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    n = sum(p.numel() for p in moe.parameters())
    print(f"wrote {out}: Qwen3-MoE, {moe.config.num_layers} layers x {args.experts} experts (top-{args.top_k}), "
          f"{n / 1e6:.2f} M parameters, upcycled from {src}")


if __name__ == "__main__":
    main()
