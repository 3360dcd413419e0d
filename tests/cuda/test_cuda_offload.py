"""CUDA: optim.offload (fp32 masters + AdamW state in host memory, stepped by the CPU) against the same
masters and state on the GPU (stepped by CUDA kernels), same gradients, 20 AdamW steps (foreach=False,
as rlalign.train.loop builds it). Whether the two give the same bits is a property of torch's CPU and
CUDA elementwise kernels (FMA contraction in lerp/addcmul can differ): this test measures it for the
masters and for the bf16 weights the rollout engine receives, and reports the first difference."""

from __future__ import annotations

import pytest
import torch

from rlalign.train.master import MasterWeights
from tests.bitwise import assert_bitwise_equal

pytestmark = pytest.mark.cuda


def _trajectory(offload: bool, steps: int = 20):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(256, 256, generator=g) * 0.02
    grads = [torch.randn(256, 256, generator=g) * 1e-3 for _ in range(steps)]
    layer = torch.nn.Linear(256, 256, bias=False).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w0.to(torch.bfloat16))
    mw = MasterWeights(layer, enabled=True, offload=offload)
    opt = torch.optim.AdamW(mw.optim_params(), lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01, foreach=False)
    for grad in grads:
        layer.weight.grad = grad.to(device="cuda", dtype=torch.bfloat16)
        mw.grads_to_master()
        opt.step()
        mw.master_to_model()
    return mw.masters[0].detach().cpu(), layer.weight.detach().cpu()


def test_offloaded_adamw_gives_the_on_device_bits():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    master_dev, weight_dev = _trajectory(offload=False)
    master_host, weight_host = _trajectory(offload=True)
    assert_bitwise_equal(weight_host, weight_dev, "bf16 weights: offloaded vs on-device AdamW")
    assert_bitwise_equal(master_host, master_dev, "fp32 masters: offloaded vs on-device AdamW")
