"""``python -m rlalign.integrations.ray.compare``'s weight check reads a sharded export (over 5 GiB, e.g. an 8B
policy) as well as a single model.safetensors, and refuses a run without an exported policy."""

import pytest
import torch
from safetensors.torch import save_file

from rlalign.contract.errors import RLAlignError
from rlalign.integrations.ray.compare import weight_differences


def _export(run, shards):
    (run / "policy").mkdir(parents=True)
    for i, tensors in enumerate(shards, 1):
        save_file(tensors, run / "policy" / f"model-{i:05d}-of-{len(shards):05d}.safetensors")


def test_sharded_exports_are_compared_tensor_by_tensor(tmp_path):
    _export(tmp_path / "a", [{"x": torch.ones(3)}, {"y": torch.ones(2)}])
    _export(tmp_path / "b", [{"x": torch.ones(3)}, {"y": torch.tensor([1.0, 0.5])}])
    assert weight_differences(tmp_path / "a", tmp_path / "a") == []
    assert weight_differences(tmp_path / "a", tmp_path / "b") == ["policy y: first differing element 1: 1.0 vs 0.5"]
    with pytest.raises(RLAlignError, match="holds no \\*.safetensors"):
        weight_differences(tmp_path / "a", tmp_path / "missing")
