"""``rlalign pretrain``: rebuild the embedded default model (see rlalign/train/pretrain.py)."""

from __future__ import annotations

import dataclasses

from rlalign.train.pretrain import PretrainConfig, add_arguments, pretrain


def register(subparsers) -> None:
    p = subparsers.add_parser("pretrain", help="build the embedded default model (tiny Qwen3 + char tokenizer)")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    pretrain(PretrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PretrainConfig)}))
    return 0
