"""Write a random-init Qwen3-8B-shaped checkpoint with a full-vocabulary tokenizer (nothing is downloaded).

    python scripts/make_qwen3_8b.py /tmp/q8b                  # 36 layers, 151,936 tokens, bf16 (~16.4 GB)
    python scripts/make_qwen3_8b.py /dev/shm/q8b --lm-head-std 0   # in memory, zero LM head (configs/qwen3-8b-h200-device.yaml)
    python scripts/make_qwen3_8b.py /tmp/q8b --layers 6       # the depth cut (bench shapes)
    python scripts/make_qwen3_8b.py /tmp/q8b --config-only    # config.json + tokenizer, no weights (budgets)
    python scripts/make_qwen3_8b.py /tmp/t --test-body --vocab 2000   # tests: toy body, same tokenizer scheme
    python scripts/make_qwen3_8b.py /tmp/t --test-body --hidden 256   # a wider toy body (lr-vs-width studies)

The body is Qwen3-8B's (hidden 4096, 32 q / 8 kv heads, head_dim 128, intermediate 12288, untied
LM head, rope theta 1e6); weights N(0, 0.02) (the LM head N(0, --lm-head-std) when given), norms 1
(CausalLM.init_random_), written in bf16
safetensors shards of ``--shard-gib`` (checksummed in parallel, here and when the trainer loads them).
On a GPU the normals are drawn there (``init_random_(on_device=True)``: under a second for 8.2B, where the
CPU generator takes minutes; other values than a CPU-made checkpoint, the same on every run of a GPU
type and torch version); ``--device cpu`` draws them with the CPU generator. The time of each phase is
printed. The tokenizer is built locally (scripts/make_moe_model.py's full_vocab_tokenizer, the
MoE kit's): ids 0..14 are the embedded default model's (<pad>, <bos>, <eos>, the digits, '+', '='),
and id 15 + i decodes to the number 10 + i, up to the vocabulary size. Text is split into single
characters before lookup, so prompts encode exactly as with the default model's tokenizer (the
arithmetic task and configs/partial_credit.py work unchanged), while a sampled id of the full
vocabulary decodes to digits the partial-credit reward can score: a random-init model over 151,936 ids earns a varying, non-zero reward from the
first step (a vocabulary of unused placeholders would give every completion the same zero reward).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from rlalign.bench.rollout import PRESETS
from rlalign.models.checkpoint import save_model
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.train.setup import DEFAULT_MODEL_DIR

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_moe_model as _moe_kit  # noqa: E402  (the full-vocabulary tokenizer's one owner)

TEST_BODY = dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def full_vocab_tokenizer(vocab_size: int) -> dict:
    """The default model's tokenizer grown to ``vocab_size`` ids that decode to numbers (one owner:
    scripts/make_moe_model.py's :func:`full_vocab_tokenizer`, shared with the MoE kit)."""
    base = len(json.loads((DEFAULT_MODEL_DIR / "tokenizer.json").read_text())["model"]["vocab"])
    if vocab_size < base:
        raise SystemExit(f"--vocab {vocab_size} is smaller than the default tokenizer's {base} tokens")
    return _moe_kit.full_vocab_tokenizer(DEFAULT_MODEL_DIR, vocab_size)


def toy_body(hidden: int) -> dict:
    """The toy body at ``hidden`` (64: TEST_BODY): intermediate 3 x hidden, heads of 16 (hidden / 16 query,
    hidden / 32 key-value), the 8B's ratios of neither but its layer structure, for width-scaling studies."""
    if hidden % 32:
        raise SystemExit(f"--hidden {hidden}: must be a multiple of 32 (heads of 16, 2 query heads per kv head)")
    return dict(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=hidden // 16,
                num_key_value_heads=hidden // 32, head_dim=16)


def hf_config(layers: int, vocab: int, test_body: bool, hidden: int = TEST_BODY["hidden_size"]) -> dict:
    default = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    cfg = dict(PRESETS["qwen3-8b"], num_hidden_layers=layers, vocab_size=vocab, torch_dtype="bfloat16")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg[key] = default[key]
    if test_body:
        cfg.update(toy_body(hidden), max_position_embeddings=4096)
    return cfg


def write_tokenizer(out: Path, vocab: int) -> None:
    (out / "tokenizer.json").write_text(json.dumps(full_vocab_tokenizer(vocab), ensure_ascii=False))
    config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    config["model_max_length"] = 40960
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    if (DEFAULT_MODEL_DIR / "generation_config.json").exists():
        (out / "generation_config.json").write_text((DEFAULT_MODEL_DIR / "generation_config.json").read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the weights are made before writing (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gib", type=float, default=2.0, help="safetensors shard size (default 2 GiB)")
    p.add_argument("--config-only", action="store_true", help="config.json and the tokenizer, no weights")
    p.add_argument("--test-body", action="store_true", help="a toy body (hidden 64) for tests; same tokenizer")
    p.add_argument("--lm-head-std", type=float, default=None,
                   help="std of the LM head's init (default: the body's 0.02, HF's initializer_range; 0: zeros)."
                        " At hidden 4096 a 0.02 head lets the body reach ~82-nat logit gaps by aligning the final"
                        " hidden state with one row (docs/gpu.md, 'Qwen3-8B on one H200')")
    p.add_argument("--hidden", type=int, default=TEST_BODY["hidden_size"],
                   help="with --test-body: the toy body's width (default 64; see toy_body)")
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error("--layers must be >= 1")
    if args.hidden != TEST_BODY["hidden_size"] and not args.test_body:
        p.error("--hidden sets the toy body's width: use it with --test-body")
    out = Path(args.out)
    cfg = hf_config(args.layers, args.vocab, args.test_body, args.hidden)
    if args.config_only:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg, indent=1))
    else:
        started = time.perf_counter()
        model = CausalLM(ModelConfig.from_hf_dict(cfg), dtype=torch.bfloat16, device=args.device)
        model.init_random_(seed=args.seed, on_device=model.device.type != "cpu", lm_head_std=args.lm_head_std)
        made = time.perf_counter()
        out = save_model(model, out, max_shard_bytes=int(args.shard_gib * 2**30))
        del model
        print(f"init {made - started:.1f} s on {args.device}, write {time.perf_counter() - made:.1f} s", file=sys.stderr)
    write_tokenizer(out, args.vocab)
    params = sum(t.numel() for t in CausalLM(ModelConfig.from_hf_dict(cfg), device="meta").parameters())
    print(f"qwen3-8b shape: {params / 1e9:.3f}B parameters, {args.layers} layers, vocab {args.vocab}"
          f"{' (config only)' if args.config_only else ''} -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
