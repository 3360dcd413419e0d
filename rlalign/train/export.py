"""Export a training checkpoint (any step, not only the last) to a Hugging Face model directory.

The exported weights are the policy exactly as the trainer and the rollout engine used it at that
step: the checkpoint's ``model`` tensors and, for a model with fp32 master weights, the
round-to-nearest-even cast of each master (stored only as the master since 2026-12-01). The
architecture (config.json) and the tokenizer files come from the run's base model directory (the
checkpoint's ``model.path``, or ``model_dir`` when it has moved).

What it checks before it writes anything:

- **The checkpoint** is read from a run's ``checkpoints/`` folder (or named directly) never through a
  symbolic link, and its sha256 must equal the one that folder's ``latest.json`` records for it (every
  kept checkpoint has one); a mismatch is refused. A checkpoint with no recorded sha256 (copied out of
  its run, or kept from a run of an older rlalign) is refused unless ``unverified``, and then the
  export has no ``checksums.json`` (loading it says its bytes are unverified).
- **The output folder** (rlalign.models.ownership): new, or empty; an existing non-empty one only
  with ``overwrite`` and only when it holds nothing but a saved model's files. It may not be, or
  contain, the current directory, the checkpoint or its run directory, or the base model.
"""

from __future__ import annotations

from pathlib import Path

from rlalign.contract.errors import RLAlignError
from rlalign.models.checkpoint import check_model_output, load_model, save_model
from rlalign.models.layout import stack_checkpoint_names
from rlalign.models.lora import LoRASpec, apply_lora, save_adapter
from rlalign.train.adapters import exportable, save_run_adapter
from rlalign.train.master import checkpoint_model_weights
from rlalign.train.run.checkpoint_files import (CheckpointCorrupt, MANIFEST_FILE, file_sha256, load_state,
                                                read_manifest, recorded_checkpoint_sha256)
from rlalign.train.setup import resolve_model_dir


EXPORT_SHARD_BYTES = 5 * 2**30


class ExportError(RLAlignError):
    pass


def save_run_policy(policy, lora, run_dir: Path, model_dir: Path) -> Path:
    """The run's trained (unsharded) ``policy`` as ``run_dir/policy``; a LoRA run's merged, with its adapters alone
    (PEFT's format) in ``run_dir/adapter``."""
    if lora is not None:
        save_run_adapter(policy, lora, run_dir / "adapter", base_model=str(model_dir))
        policy = exportable(policy)
    # shards of at most 5 GiB (hashed in parallel): an 8B export is 4 files, a small model's one model.safetensors
    # policy/ is replaced whole (tokenizer files included) and only when it holds a saved model's files alone
    return save_model(policy, run_dir / "policy", max_shard_bytes=EXPORT_SHARD_BYTES, tokenizer_from=model_dir)


def checkpoint_file(path: "str | Path") -> Path:
    """A ``step_*.pt`` file as given, or the latest checkpoint of a run directory / its checkpoints folder
    (``latest.json`` may name only a file of its own folder, never a link)."""
    path = Path(path)
    if path.is_symlink():
        raise ExportError(f"{path} is a symbolic link (to {path.readlink()}); give the checkpoint file itself")
    if path.is_file():
        return path
    for folder in (path / "checkpoints", path):
        manifest_path = folder / MANIFEST_FILE
        if manifest_path.is_file() or manifest_path.is_symlink():
            try:
                file = folder / read_manifest(manifest_path)["file"]
            except CheckpointCorrupt as exc:
                raise ExportError(f"{exc}; or give a checkpoint file (checkpoints/step_*.pt)") from None
            if file.is_symlink():
                raise ExportError(f"{manifest_path} names {file.name}, which is a symbolic link; give a checkpoint file")
            return file
    raise ExportError(f"{path} is neither a checkpoint file nor a run directory with checkpoints/latest.json")


def verify_checkpoint(file: Path, unverified: bool = False) -> bool:
    """Check ``file`` against the sha256 its folder's ``latest.json`` records; True when verified. No
    recorded sha256: refused, unless ``unverified`` (then False). A mismatch is always refused."""
    try:
        recorded = recorded_checkpoint_sha256(file)
    except CheckpointCorrupt as exc:
        raise ExportError(f"{exc}; the checkpoint cannot be verified") from None
    if recorded is None:
        if unverified:
            return False
        raise ExportError(f"{file}: no sha256 is recorded for it ({file.parent / MANIFEST_FILE} does not list it: a "
                          "checkpoint copied out of its run, or kept by an older rlalign); export it from its run's "
                          "checkpoints/ folder, or pass --unverified (the export then has no checksums.json)")
    if file_sha256(file) != recorded:
        raise ExportError(f"checkpoint {file} is corrupt (sha256 does not match {file.parent / MANIFEST_FILE}); "
                          "restore it, or export another step (nothing was written)")
    return True


def export_checkpoint(checkpoint: "str | Path", out_dir: "str | Path", model_dir: "str | Path | None" = None, *,
                      overwrite: bool = False, unverified: bool = False, adapter: bool = False) -> Path:
    """Write the checkpoint's policy to ``out_dir`` as a Hugging Face model folder (module doc: what is
    checked first). ``overwrite``: replace an existing model folder of rlalign's; ``unverified``: allow a
    checkpoint without a recorded sha256 (the export then has no checksums.json). A LoRA run's checkpoint
    (``model.lora``) is exported merged (rlalign.models.lora.merged_copy), or with ``adapter`` as the adapters
    alone in PEFT's format."""
    file = checkpoint_file(checkpoint)
    run_dir = file.parent.parent if file.parent.name == "checkpoints" else file.parent
    reads = [file, run_dir] + ([Path(model_dir)] if model_dir is not None else [])
    hint = ", or pass --overwrite to replace a model folder rlalign wrote"
    if not adapter:
        check_model_output(out_dir, overwrite=overwrite, reads=reads, hint=hint)   # before any work
    verified = verify_checkpoint(file, unverified)
    state = load_state(file)   # weights_only: no pickled code runs from disk
    if not isinstance(state, dict) or "model" not in state:
        raise ExportError(f"{file} holds no model weights: is it an rlalign training checkpoint?")
    spec = _checkpoint_lora(state)
    if adapter and spec is None:
        raise ExportError(f"--adapter: {file} is not a LoRA run's checkpoint (model.lora.rank is 0); export the model")
    base = Path(model_dir) if model_dir is not None else resolve_model_dir(state["config"]["model"]["path"])
    if not (base / "config.json").is_file():
        raise ExportError(f"the run's base model {base} is gone; pass its new location with --model-dir")
    if not adapter:
        check_model_output(out_dir, overwrite=overwrite, reads=reads + [base], hint=hint)
    weights = checkpoint_model_weights(state)   # the weights stored only as fp32 masters, rounded as in training
    dtype = next(iter(weights.values())).dtype
    model, _ = load_model(base, dtype=dtype)
    if spec is not None:
        apply_lora(model, spec)   # the adapters' structure; their values come from the checkpoint below
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
    if adapter:
        return save_adapter(model, spec, out_dir, base_model=str(base), overwrite=overwrite, reads=reads + [base])
    model = exportable(model)   # a LoRA run's adapters merged into the weights
    return save_model(model, out_dir, tokenizer_from=base, checksums=verified)   # unverified: no checksums.json


def _checkpoint_lora(state: dict) -> "LoRASpec | None":
    """The LoRA spec of the run that wrote ``state`` (its stored config's ``model.lora``); None without adapters
    (or for a checkpoint written before ``model.lora`` existed)."""
    lora = ((state.get("config") or {}).get("model") or {}).get("lora") or {}
    if not lora.get("rank"):
        return None
    return LoRASpec(rank=int(lora["rank"]), alpha=float(lora["alpha"]), dropout=float(lora.get("dropout", 0.0)),
                    targets=tuple(lora["targets"]))


__all__ = ["EXPORT_SHARD_BYTES", "ExportError", "checkpoint_file", "export_checkpoint", "save_run_policy",
           "verify_checkpoint"]
