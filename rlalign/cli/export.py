"""``rlalign export CHECKPOINT OUT_DIR``: a training checkpoint as a Hugging Face model directory.

The checkpoint is verified against its run's ``latest.json`` and OUT_DIR must be new or empty; an
existing model folder of rlalign's is replaced only with ``--overwrite`` (rlalign.train.export)."""

from __future__ import annotations

from rlalign.train.export import checkpoint_file, export_checkpoint


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a training checkpoint (any step) as a Hugging Face model directory")
    p.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_NNNNNN.pt, or a run directory (its latest checkpoint)")
    p.add_argument("out_dir", help="where to write config.json, safetensors and the tokenizer files")
    p.add_argument("--model-dir", default=None,
                   help="the run's base model directory, when it is no longer where model.path said")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR when it holds a model folder rlalign wrote (anything else there is refused)")
    p.add_argument("--unverified", action="store_true",
                   help="export a checkpoint whose sha256 no latest.json records (the export gets no checksums.json)")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run's checkpoint: write its adapters alone in PEFT's format (default: merged into a "
                        "full Hugging Face model)")
    p.set_defaults(func=run)


def run(args) -> int:
    out = export_checkpoint(args.checkpoint, args.out_dir, args.model_dir, overwrite=args.overwrite,
                            unverified=args.unverified, adapter=args.adapter)
    print(f"exported {checkpoint_file(args.checkpoint)} -> {out}")
    return 0
