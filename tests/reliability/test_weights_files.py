"""Model directories: flipped bytes (checksums.json) and integer-typed weights are refused with the file's name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlalign.models.checkpoint import CheckpointError, load_model
from tests.train.conftest import make_arithmetic_checkpoint


@pytest.fixture()
def model_dir(tmp_path):
    return make_arithmetic_checkpoint(tmp_path / "model")


def test_flipped_byte_in_tensor_data_is_refused(model_dir):
    f = model_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x10          # tensor data, not the header: safetensors alone cannot see it
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: sha256 does not match checksums.json"):
        load_model(model_dir)


def test_integer_weights_are_refused(model_dir):
    f = model_dir / "model.safetensors"
    tensors = load_file(str(f))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(f))
    (model_dir / "checksums.json").unlink()
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is stored as I32"):
        load_model(model_dir)


def test_checksums_written_and_loading_without_them_still_works(model_dir):
    assert set(json.loads((model_dir / "checksums.json").read_text())) == {"model.safetensors"}
    (model_dir / "checksums.json").unlink()
    load_model(model_dir)
