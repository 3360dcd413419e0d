"""``rlalign export CHECKPOINT OUT_DIR``: a training checkpoint as a Hugging Face model directory."""

from __future__ import annotations

from rlalign.train.export import checkpoint_file, export_checkpoint

def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a training checkpoint (any step) as a Hugging Face model directory")
    p.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_NNNNNN.pt, or a run directory (its latest checkpoint)")
    p.add_argument("out_dir", help="where to write config.json, safetensors and the tokenizer files")
    p.add_argument("--model-dir", default=None,
                   help="the run's base model directory, when it is no longer where model.path said")
    p.set_defaults(func=run)


def run(args) -> int:

    out = export_checkpoint(args.checkpoint, args.out_dir, args.model_dir)
    print(f"exported {checkpoint_file(args.checkpoint)} -> {out}")
    return 0
