"""Hugging Face checkpoint directories in and out: config.json + safetensors (single or sharded).

Loading checks every tensor: a missing, unexpected or wrongly shaped tensor, a corrupt file or a
missing config raises :class:`CheckpointError` with one line naming the tensor and the file.
Tolerated extras, as in transformers: ``lm_head.weight`` when embeddings are tied, the
``rotary_emb.inv_freq`` buffers some old checkpoints carry (rope tables are always recomputed), and the
multi-token-prediction layers of a config's ``num_nextn_predict_layers`` (DeepSeek-V3) or ``mtp_num_hidden_layers``
(Qwen3-Next's ``mtp.*`` tensors) -- not run, not saved.
Weights must be floating point (an integer-typed tensor is refused, not cast). :func:`save_model`
also writes ``checksums.json`` (sha256 of every safetensors file); when it is present, loading
verifies it first, so flipped bytes in tensor data (which the safetensors format cannot see) are
refused with the file's name; without it, loading says in one line that the tensor bytes are unverified
(safetensors still checks each file's header and that its size matches) and that ``rlalign checksum DIR``
records them. Directories are written with the user's umask, not ``mkdtemp``'s 0700.

:func:`save_model` replaces an existing folder only when it holds nothing but the files a saved model
holds (:func:`is_model_folder_file`): a folder with anything else in it, a file or a symbolic link is
refused (rlalign.models.ownership).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.models.atomic import atomic_write, default_file_mode
from rlalign.models.config import ModelConfig, ModelConfigError
from rlalign.models.decoder import CausalLM
from rlalign.models.layout import checkpoint_tensors
from rlalign.models.lora import has_lora
from rlalign.models.ownership import OutputRefused, check_output_folder, refuse_link
from rlalign.models.tokenizer import Tokenizer, load_tokenizer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHECKSUM_FILE = "checksums.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")
OTHER_MODEL_FILES = ("config.json", "pretrain.json")
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_LOG = logging.getLogger(__name__)
_UNVERIFIED_NOTED: set[str] = set()


class CheckpointError(RLAlignError, RuntimeError):
    """A checkpoint directory cannot be read or written as a model (message names tensor and file)."""


def is_model_folder_file(path: Path) -> bool:
    """Whether ``path`` is a file :func:`save_model` (with the tokenizer files and ``pretrain.json``) writes:
    the files a folder may hold for save_model to replace it."""
    name = Path(path).name
    known = name in (SINGLE_FILE, INDEX_FILE, CHECKSUM_FILE, *TOKENIZER_FILES, *OTHER_MODEL_FILES)
    return Path(path).is_file() and not Path(path).is_symlink() and (known or bool(_SHARD_NAME.fullmatch(name)))


def read_config_json(directory: str | os.PathLike) -> tuple[Path, dict]:
    """(the path of ``directory``'s config.json, its parsed object); a missing or unreadable file is one line."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing config.json (is {directory} a Hugging Face checkpoint directory?)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot parse config.json: {exc}") from None
    return path, raw


def load_model_config(directory: str | os.PathLike) -> ModelConfig:
    path, raw = read_config_json(directory)
    try:
        return ModelConfig.from_hf_dict(raw)
    except ModelConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    key = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(key, key)
    if key not in _DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r} (choose one of {', '.join(_DTYPES)})")
    return _DTYPES[key]


def load_model(directory: str | os.PathLike, dtype: str | torch.dtype | None = None,
               device: str | torch.device = "cpu") -> tuple[CausalLM, ModelConfig]:
    """Build the decoder from ``directory`` (config.json + safetensors). ``dtype`` None: the
    config's ``torch_dtype``; tensors are cast to it exactly as ``Tensor.to`` does."""
    config = load_model_config(directory)
    model = CausalLM(config, dtype=resolve_dtype(dtype or config.dtype), device=device)
    load_weights(model, directory, device)
    return model, config


def load_weights(model: torch.nn.Module, directory: str | os.PathLike, device: str | torch.device = "cpu") -> None:
    """Copy ``directory``'s safetensors into ``model`` (a :class:`CausalLM` or a model built on it, whose
    checkpoint tensors and ``config`` say what the files must hold), checked tensor by tensor; then ``eval()``."""
    config = model.config
    expected = dict(checkpoint_tensors(model))     # checkpoint name -> its place in the model (a view)
    seen: set[str] = set()
    files = _tensor_files(Path(directory))
    for file, names in files.items():
        _load_file(file, names, expected, seen, config, device)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    verify_checksums(Path(directory), files)   # after the structural checks, whose messages are more precise
    model.eval()


def _tensor_files(directory: Path) -> dict[Path, list[str] | None]:
    """{file: tensor names it must hold (from the index), or None (single file: whatever it holds)}."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        files: dict[Path, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(directory / fname, []).append(name)
        for file, names in files.items():
            if not file.is_file():
                raise CheckpointError(f"{file}: missing shard (listed in {INDEX_FILE} for tensor {names[0]!r})")
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        return {single: None}
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{directory}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file")
    return {f: None for f in found}


def _ignored(name: str, config: ModelConfig) -> bool:
    return (name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")
            or _prediction_layer(name, config))


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _prediction_layer(name: str, config: ModelConfig) -> bool:
    """A tensor of the multi-token-prediction layers: DeepSeek-V3's ``num_nextn_predict_layers`` stored after the
    last decoder layer, Qwen3-Next's ``mtp.*`` (``mtp_num_hidden_layers`` > 0): ignored, as transformers ignores them
    (the decoder does not run them)."""
    if config.extra.get("mtp_num_hidden_layers") and name.startswith("mtp."):
        return True
    extra = config.extra.get("num_nextn_predict_layers") or 0
    found = _LAYER.match(name) if extra else None
    return found is not None and config.num_layers <= int(found.group(1)) < config.num_layers + extra


def _indexed(device: str | torch.device) -> str:
    """The device for safetensors: a bare "cuda" made explicit as torch's current GPU. safetensors reads "cuda"
    as GPU 0, so every rank of a multi-GPU job (model.device=cuda, rank r's current device r) would otherwise
    stage its tensors on GPU 0."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _load_file(file: Path, names: list[str] | None, expected: dict, seen: set, config: ModelConfig, device,
               copy: bool = True) -> None:
    """Check ``file``'s tensors against ``expected`` (name, dtype, shape) and, with ``copy``, copy them in."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt", device=_indexed(device) if copy else "cpu") as f:
            present = set(f.keys())
            for name in names if names is not None else sorted(present):
                if name not in present:
                    raise CheckpointError(f"{file}: tensor {name!r} is listed in {INDEX_FILE} but not in the file")
                if _ignored(name, config):
                    continue
                if name not in expected:
                    raise CheckpointError(f"{file}: unexpected tensor {name!r} (not a parameter of this "
                                          f"{config.family} model)")
                if name in seen:
                    raise CheckpointError(f"{file}: tensor {name!r} appears in more than one file")
                shape = tuple(f.get_slice(name).get_shape())
                stored = f.get_slice(name).get_dtype()
                if stored not in _FLOAT_SAFETENSORS_DTYPES:
                    raise CheckpointError(f"{file}: tensor {name!r} is stored as {stored}; model weights must be "
                                          "floating point (F32, BF16, F16); is this a quantized checkpoint?")
                param = expected[name]
                if shape != tuple(param.shape):
                    raise CheckpointError(f"{file}: tensor {name!r} has shape {shape}, the config implies "
                                          f"{tuple(param.shape)}")
                if copy:
                    with torch.no_grad():
                        param.copy_(f.get_tensor(name).to(param.dtype))
                seen.add(name)
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt headers/data
        raise CheckpointError(f"{file}: cannot read safetensors file ({type(exc).__name__}: {exc})") from None


_FLOAT_SAFETENSORS_DTYPES = ("F64", "F32", "BF16", "F16")


def verify_checksums(directory: Path, files) -> None:
    """Check every tensor file against ``checksums.json`` when the directory has one; without it, say once
    (per directory and process) that the tensor bytes are unverified."""
    sidecar = directory / CHECKSUM_FILE
    if not sidecar.is_file():
        _note_unverified(directory)
        return
    recorded = _recorded_sums(sidecar, files)
    _check_sums(files, recorded, _sha256_files(list(files)))


def _recorded_sums(sidecar: Path, files) -> dict:
    """checksums.json's {file name: sha256}, which must list every one of ``files``."""
    try:
        sums = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{sidecar}: unreadable ({exc.__class__.__name__}); restore it or delete it") from None
    for file in files:
        if not isinstance(sums, dict) or sums.get(file.name) is None:
            raise CheckpointError(f"{file}: not listed in {sidecar}; the directory was changed after it was saved")
    return sums


def _check_sums(files, recorded: dict, actual) -> None:
    for file, got in zip(files, actual):
        if got != recorded[file.name]:
            raise CheckpointError(f"{file}: sha256 does not match {CHECKSUM_FILE} (the file is corrupt or was "
                                  "modified); restore it, or delete checksums.json to load it anyway")


def _note_unverified(directory: Path) -> None:
    key = str(Path(directory).resolve())
    if key in _UNVERIFIED_NOTED:
        return
    _UNVERIFIED_NOTED.add(key)
    _LOG.warning(f"note: {directory} has no {CHECKSUM_FILE}: its tensor bytes are unverified (safetensors checks "
                 f"only each file's header and size); record them with `rlalign checksum {directory}`")


def write_checksums(directory: str | os.PathLike, *, overwrite: bool = False) -> tuple[Path, dict[str, str], bool]:
    """Write ``checksums.json`` (sha256 of every safetensors file) for a model folder that loads: config.json
    parses and every tensor file's header, names, shapes and size are checked first (:func:`check_model_files`).
    An existing checksums.json that matches is kept; one that does not is refused unless ``overwrite``
    (which records the files as they are now). Only checksums.json is written; nothing else is touched.
    Returns (checksums.json, {file name: sha256}, whether it was written)."""
    directory = Path(directory)
    refuse_link(directory, "model folder")
    files = check_model_files(directory)
    sidecar = directory / CHECKSUM_FILE
    refuse_link(sidecar, "checksums file")
    hashes = _sha256_files(list(files))   # each file read once, whether the sidecar is checked or written
    sums = {f.name: h for f, h in zip(files, hashes)}
    if sidecar.exists() and not overwrite:
        try:
            _check_sums(files, _recorded_sums(sidecar, files), hashes)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}; if the files are right as they are now, record them with --overwrite") from None
        return sidecar, sums, False
    atomic_write(sidecar, (json.dumps(sums, indent=1, sort_keys=True) + "\n").encode())
    return sidecar, sums, True


def check_model_files(directory: Path) -> list[Path]:
    """The model's tensor files after every check that needs no sha256: config.json, each safetensors header
    (safetensors itself refuses a header that does not parse or a size that does not match it), each tensor's
    name, dtype and shape against the config. Reads headers only, no tensor data."""
    config = load_model_config(directory)
    model = CausalLM(config, dtype=resolve_dtype(config.dtype), device="meta")
    expected = dict(checkpoint_tensors(model))
    seen: set[str] = set()
    files = _tensor_files(Path(directory))
    for file, names in files.items():
        _load_file(file, names, expected, seen, config, "meta", copy=False)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return list(files)


def _sha256_files(files: list[Path]) -> list[str]:
    """The sha256 of each file, several files at once (hashlib releases the GIL while it hashes, so the shards
    of a large checkpoint hash in parallel: seconds instead of a minute for 16 GB)."""
    if len(files) <= 1:
        return [_sha256(f) for f in files]
    with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1, 16)) as pool:
        return list(pool.map(_sha256, files))


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_model(model: CausalLM, directory: str | os.PathLike, *, max_shard_bytes: int | None = None,
               tokenizer_from: str | os.PathLike | None = None, checksums: bool = True) -> Path:
    """Write config.json + safetensors (sharded with an index when larger than ``max_shard_bytes``)
    atomically: everything goes to a temporary sibling directory that is then renamed into place. An
    existing ``directory`` is replaced only when it is empty or holds only a saved model's files
    (:func:`is_model_folder_file`); anything else, a file or a link there is refused (nothing changed).
    ``tokenizer_from``: copy the tokenizer files found there. ``checksums``: write checksums.json (False for
    weights whose source nobody verified: a checksum would vouch for them)."""
    if has_lora(model):
        raise CheckpointError("save_model: the model holds LoRA adapters; save rlalign.models.lora.merged_copy(model) "
                              "(a Hugging Face checkpoint) or the adapters alone (rlalign.models.lora.save_adapter)")
    check_model_output(directory, overwrite=True, reads=[tokenizer_from] if tokenizer_from is not None else [])
    target = Path(directory).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_config(model, tmp)
        _write_tensors(model, tmp, max_shard_bytes)
        if checksums:
            written = sorted(tmp.glob("*.safetensors"))
            sums = {f.name: h for f, h in zip(written, _sha256_files(written))}
            (tmp / CHECKSUM_FILE).write_text(json.dumps(sums, indent=1, sort_keys=True) + "\n")
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_from) / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
        os.chmod(tmp, default_file_mode(directory=True))   # mkdtemp made it 0700 (safetensors' files 0600)
        for file in tmp.iterdir():
            os.chmod(file, default_file_mode())
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def check_model_output(directory: str | os.PathLike, *, overwrite: bool, reads=(), hint: str = "") -> None:
    """Refuse ``directory`` as the folder a model is saved to unless it is new, empty or (with ``overwrite``)
    a saved model's folder; it may not be or contain the current directory or ``reads``
    (rlalign.models.ownership). Raises CheckpointError; changes nothing."""
    try:
        check_output_folder(Path(directory), what="model folder", owns=is_model_folder_file, overwrite=overwrite,
                            reads=reads, hint=hint)
    except OutputRefused as exc:
        raise CheckpointError(str(exc)) from None


def _write_config(model: CausalLM, out: Path) -> None:
    hf = model.config.to_hf_dict()
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")


def _write_tensors(model: CausalLM, out: Path, max_shard_bytes: int | None) -> None:
    from safetensors.torch import save_file

    # a tensor of its own each: safetensors refuses tensors that share memory (the decoder's stacked projections)
    tensors = {name: _owned(t.detach().to("cpu").contiguous()) for name, t in checkpoint_tensors(model)}
    shards = _split_shards(tensors, max_shard_bytes)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy where ``t`` is a view into a larger storage."""
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def _split_shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    shards, size = [{}], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_bytes and shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _replace_dir(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.replace(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, old / "d")
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def weights_hash(model) -> str:
    """sha256 (hex) over every checkpoint tensor, in name order: name, dtype, shape, then raw bytes. ``model``:
    a module (its tensors under the checkpoint's names and shapes: rlalign.models.layout, e.g. stacked experts
    per expert), or (checkpoint name, tensor) pairs (an engine whose runtime layout differs from the
    checkpoint's hands its tensors under the checkpoint's names), so equal weights hash equal."""
    h = hashlib.sha256()
    pairs = checkpoint_tensors(model) if isinstance(model, torch.nn.Module) else model
    for name, p in sorted(pairs, key=lambda kv: kv[0]):
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


__all__ = ["CheckpointError", "load_model_config", "load_model", "load_weights", "save_model", "load_tokenizer", "weights_hash",
           "resolve_dtype", "Tokenizer", "is_model_folder_file", "check_model_output", "check_model_files",
           "write_checksums"]
