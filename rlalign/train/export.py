"""Export a training checkpoint (any step, not only the last) to a Hugging Face model directory.

The exported weights are the policy exactly as the trainer and the rollout engine used it at that
step: the checkpoint's ``model`` tensors and, for a model with fp32 master weights, the
round-to-nearest-even cast of each master (stored only as the master since 2026-12-01). The
architecture (config.json) and the tokenizer files come from the run's base model directory (the
checkpoint's ``model.path``, or ``model_dir`` when it has moved).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlalign.contract.errors import RLAlignError
from rlalign.models.checkpoint import load_model, save_model
from rlalign.models.layout import stack_checkpoint_names
from rlalign.train.master import checkpoint_model_weights
from rlalign.train.runio import load_state
from rlalign.train.setup import resolve_model_dir


class ExportError(RLAlignError):
    pass


def checkpoint_file(path: "str | Path") -> Path:
    """A ``step_*.pt`` file as given, or the latest checkpoint of a run directory / its checkpoints folder."""
    path = Path(path)
    if path.is_file():
        return path
    for folder in (path / "checkpoints", path):
        manifest = folder / "latest.json"
        if manifest.is_file():
            try:
                return folder / json.loads(manifest.read_text())["file"]
            except (ValueError, KeyError):
                raise ExportError(f"{manifest} is unreadable; give a checkpoint file (checkpoints/step_*.pt)") from None
    raise ExportError(f"{path} is neither a checkpoint file nor a run directory with checkpoints/latest.json")


def export_checkpoint(checkpoint: "str | Path", out_dir: "str | Path", model_dir: "str | Path | None" = None) -> Path:

    file = checkpoint_file(checkpoint)
    state = load_state(file)   # weights_only: no pickled code runs from disk
    if not isinstance(state, dict) or "model" not in state:
        raise ExportError(f"{file} holds no model weights: is it an rlalign training checkpoint?")
    base = Path(model_dir) if model_dir is not None else resolve_model_dir(state["config"]["model"]["path"])
    if not (base / "config.json").is_file():
        raise ExportError(f"the run's base model {base} is gone; pass its new location with --model-dir")
    weights = checkpoint_model_weights(state)   # the weights stored only as fp32 masters, rounded as in training
    dtype = next(iter(weights.values())).dtype
    model, _ = load_model(base, dtype=dtype)
    try:
        weights = stack_checkpoint_names(model, weights)    # MoE experts stored per expert (before 2026-12-01)
    except ValueError as exc:
        raise ExportError(f"{file} does not fit the model in {base} ({exc}); pass the run's base model with "
                          "--model-dir") from None
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise ExportError(f"{file} does not fit the model in {base} ({str(exc).splitlines()[0]}); "
                          "pass the run's base model with --model-dir") from None
    return save_model(model, out_dir, tokenizer_from=base)


__all__ = ["ExportError", "checkpoint_file", "export_checkpoint"]
