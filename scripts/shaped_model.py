"""Write a random-init checkpoint of a published model's shape (nothing is downloaded).

    python scripts/shaped_model.py qwen3-0.6b /tmp/m06                     # full shape, no tokenizer
    python scripts/shaped_model.py qwen3-0.6b /tmp/m06 --tokenizer default  # body of 0.6B, default vocab

``--tokenizer default`` copies the embedded default model's 15-token tokenizer and shrinks the
vocab to it, so that a random-init model produces text a reward function can score (the body —
layers, hidden size, heads — keeps the preset's shape). ``--layers N`` cuts the depth.
The weights are made on ``--device`` (fast on a GPU) and written in bf16 safetensors.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from rlalign.models.checkpoint import save_model
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.bench.rollout import PRESETS
from rlalign.train.setup import DEFAULT_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("out")
    p.add_argument("--tokenizer", choices=["none", "default"], default="none")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    hf = dict(PRESETS[args.preset])
    if args.layers:
        hf["num_hidden_layers"] = args.layers
    if args.tokenizer == "default":
        import json
        default = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
            hf[key] = default[key]
        hf["max_position_embeddings"] = 4096
    dtype = getattr(torch, args.dtype)
    model = CausalLM(ModelConfig.from_hf_dict(hf), dtype=dtype, device=args.device).init_random_(seed=args.seed)
    out = save_model(model, Path(args.out))
    if args.tokenizer == "default":
        for name in TOKENIZER_FILES:
            if (DEFAULT_MODEL_DIR / name).exists():
                shutil.copy(DEFAULT_MODEL_DIR / name, out / name)
    params = sum(t.numel() for t in model.parameters())
    print(f"{args.preset}: {params / 1e9:.3f}B parameters, {hf['num_hidden_layers']} layers, vocab {hf['vocab_size']} -> {out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
