"""The tap hook of models/: one table of boundary names, a recorder slot, and no import of parity."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlalign.models import ForwardBatch, taps
from rlalign.models.testing import tiny_model


class _Names:
    def __init__(self):
        self.names, self.batches = [], []

    def record(self, name, tensor):
        self.names.append(name)

    def begin_batch(self, batch):
        self.batches.append(batch)


def test_models_do_not_import_parity():
    code = ("import sys, rlalign.models, rlalign.models.testing; "
            "bad = sorted(m for m in sys.modules if m.startswith('rlalign.parity')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tap_is_identity_without_recorder():
    x = torch.randn(2, 3)
    assert taps.installed() is None and taps.tap("embed", x) is x


@pytest.mark.parametrize("family, layers", [("qwen3", 2), ("llama", 1), ("qwen2", 0)])
def test_forward_taps_every_boundary_of_the_table_in_order(family, layers):
    model = tiny_model(family, num_hidden_layers=layers)
    batch = ForwardBatch.packed([[3, 4, 5], [6]])
    recorder, outer = _Names(), _Names()
    previous = taps.install(outer)
    try:
        assert taps.install(recorder) is outer
        with torch.no_grad():
            model.forward_hidden(batch)
    finally:
        assert taps.install(previous) is recorder
    expected = [n for n in taps.all_names(layers) if n != taps.LOGPROB]
    # a layer taps q/k/v .. o_proj inside attention, then post_norm, mlp and the residual stream it returns
    assert sorted(recorder.names) == sorted(expected) and len(recorder.names) == len(expected)
    assert recorder.names[0] == taps.EMBED and recorder.names[-1] == taps.FINAL_NORM
    assert recorder.batches == [batch] and outer.names == []


def test_layer_tap_refuses_unknown_boundary():
    assert taps.layer_tap(3, "mlp") == "layers.3.mlp"
    with pytest.raises(ValueError, match="unknown layer boundary 'ffn'"):
        taps.layer_tap(0, "ffn")
