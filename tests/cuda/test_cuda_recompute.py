"""Activation recomputation on the H200 (Triton backend, bf16 and fp32): the gradients keep their bits, the
saved bytes drop by exactly the rebuilt tensors, and the peak memory of a step drops with them.
(The CPU side, incl. the Triton kernels under the interpreter: tests/models/test_recompute.py.)"""

from __future__ import annotations

import pytest
import torch

from rlalign.models import recompute
from tests.models import test_recompute as rc
from tests.models.test_three_paths import FAMILIES

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradients_bitwise_equal_and_bytes_drop(triton_backend, family, dtype):
    model = rc.make_model(family, dtype, "cuda")
    batch, targets = rc.batch_of(model, (9, 66, 1, 23, 200))
    on_bytes, on_packs, on = rc.saved_bytes_and_grads(model, batch, targets, True)
    off_bytes, off_packs, off = rc.saved_bytes_and_grads(model, batch, targets, False)
    rc.assert_same_grads(on, off)
    assert off_packs == 0
    if family == "qwen3_moe":
        assert on_packs > rc.DENSE_PACKS and off_bytes > on_bytes
        return
    assert on_packs == rc.packs_per_layer(model) * model.config.num_layers
    assert off_bytes - on_bytes == model.config.num_layers * rc.rebuilt_bytes_per_dense_layer(model, 299)


def _peak_of_step(model, batch, targets, on: bool) -> int:
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with (recompute.disabled() if not on else torch.enable_grad()):
        _, loss = rc.forward_loss(model, batch, targets)
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_peak_memory_drops(triton_backend):
    """hidden 1024, intermediate 3072, 8 / 4 heads of 128, 4 layers, 4,096 tokens, bf16: the rebuilt tensors are
    4 x 4096 x (2 x 1024 + 3072 + 12 x 128) x 2 bytes = 208 MiB; the step's peak (end of the forward) drops by
    most of it (the backward holds one layer's rebuilt tensors at a time)."""
    model = rc.make_model("qwen3", torch.bfloat16, "cuda", hidden_size=1024, intermediate_size=3072,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=128)
    batch, targets = rc.batch_of(model, (1024, 512, 2048, 512))
    _peak_of_step(model, batch, targets, True)          # warm-up (kernels compiled, allocator primed)
    keep = _peak_of_step(model, batch, targets, False)
    rebuilt = _peak_of_step(model, batch, targets, True)
    expected = 4 * rc.rebuilt_bytes_per_dense_layer(model, 4096)
    print(f"peak kept {keep / 2**20:.1f} MiB, rebuilt {rebuilt / 2**20:.1f} MiB, drop {(keep - rebuilt) / 2**20:.1f} "
          f"MiB of {expected / 2**20:.1f} MiB rebuilt")
    assert keep - rebuilt >= expected // 2, (keep, rebuilt, expected)
