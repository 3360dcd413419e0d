"""Write a small Qwen3-MoE checkpoint (Hugging Face format) upcycled from a dense Qwen3 checkpoint.

    python scripts/make_moe_model.py OUT_DIR [--dense default|DIR] [--experts 4] [--top-k 2] [--seed 0]

Every expert starts as a copy of its layer's dense MLP and the router is random (rlalign.models.moe.upcycle),
so the MoE model starts with the dense model's skills; `configs/moe-cpu.yaml` trains it with GRPO. The
tokenizer files are copied from the dense checkpoint. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from rlalign.models import load_model, save_model
from rlalign.models.upcycle import upcycle

DEFAULT = Path(__file__).resolve().parents[1] / "rlalign" / "assets" / "default_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--dense", default="default", help="a dense Qwen3 checkpoint dir, or 'default' (the embedded model)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
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
