"""Qwen3-Next on CUDA, strict (the Triton gated-delta kernels, rlalign/ops/triton_backend/gated_delta.py, with the
gated attention, the zero-centred norms and the gated shared expert on the triton backend): packed == one-shot prefill
== random prefill pieces and decode steps, bit for bit, fp32 and bf16, dense and sparse; the backward deterministic
run to run and close to the CPU's (its GRPO run: tests/cuda/test_cuda_family_grpo.py). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from rlalign.contract import use_profile
from rlalign.models import ForwardBatch
from rlalign.models.testing import tiny_model
from tests.bitwise import assert_bitwise_equal
from tests.models.test_qwen3_next import C, VOCAB, check_random_pieces

pytestmark = pytest.mark.cuda

LAYERS = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], num_hidden_layers=3)
SPARSE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
_MODELS = {}


def _model(sparse: bool, dtype: str, device: str = "cuda"):
    key = (sparse, dtype, device)
    if key not in _MODELS:
        _MODELS[key] = tiny_model("qwen3_next", seed=2, init_std=0.2, dtype=dtype, device=device, vocab_size=VOCAB,
                                  **LAYERS, **(SPARSE if sparse else {}))
    return _MODELS[key]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "moe"])
def test_packed_equals_prefill_and_decode_on_cuda(triton_backend, sparse, dtype):
    model = _model(sparse, dtype)
    cases = [([1, C - 1, C, C + 1], 0, 16), ([2 * C + 5], 1, 1), ([C, 3, 2 * C], 2, 64), ([70, 1], 3, 5),
             ([129, 64, 17], 4, 128)]
    for lengths, seed, page_size in cases:
        check_random_pieces(model, lengths, seed, page_size)


def _on_cuda(fn):
    """A kernel wrapper taking and returning CPU tensors, run on the GPU (the interpreter checks' drivers reused)."""
    def run(*args, **kwargs):
        out = fn(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)
        return tuple(None if r is None else r.cpu() for r in out)
    return run


def test_rule_paths_and_accuracy_on_cuda(triton_backend):
    """The kernels alone, driven as tests/ops/gated_delta_worker.py drives them under the interpreter: packed ==
    alone == prefill cut anywhere == decode beside other sequences, bit for bit; the forward within 2e-4 and the
    gradients within 2e-3 of the float64 recurrent rule (bf16x3 products), the backward bitwise the same twice."""
    from rlalign.ops.triton_backend.gated_delta import delta_chunks_backward, delta_chunks_forward
    from tests.ops import gated_delta_worker as worker
    forward = _on_cuda(delta_chunks_forward)
    cases = [((130, 1), (1, 63, 64, 65, 128)), ((64, 63), (63,)), ((1,), ()), ((200, 70, 3), (5, 100, 190))]
    for i, (lengths, cuts) in enumerate(cases):
        worker.check_paths(forward, lengths, cuts, seed=i, tol=2e-4)
    worker.check_gradients(forward, _on_cuda(delta_chunks_backward), tol=2e-3)


def _packed_grads(model, seqs):
    model.zero_grad(set_to_none=True)
    with use_profile("strict"):
        hidden = model.forward_hidden(ForwardBatch.packed(seqs, model.device))
    w = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1)).to(hidden.device, hidden.dtype)
    (hidden.float() * w.float()).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_backward_is_deterministic_and_close_to_the_cpu(triton_backend):
    """fp32, dense: every parameter's gradient twice on the GPU (bitwise the same) and on the CPU (the CPU's chunk
    formula; within 2e-3 x the largest gradient: the GPU's products are bf16x3)."""
    seqs = [list(range(3, 3 + 2 * C + 7)), [5, 9, 11], list(range(40, 40 + C))]
    gpu = _model(False, "float32")
    first, second = _packed_grads(gpu, seqs), _packed_grads(gpu, seqs)
    cpu = _model(False, "float32", "cpu")
    cpu.load_state_dict({k: v.cpu() for k, v in gpu.state_dict().items()})
    ref = _packed_grads(cpu, seqs)
    assert any("linear_attn" in n for n in first)
    for name, g in first.items():
        assert_bitwise_equal(second[name], g, f"{name}: second backward")
        r = ref[name]
        err = float((g.cpu().double() - r.double()).abs().max())
        assert err <= 2e-3 * float(r.abs().max()) + 1e-12, f"{name}: {err:.3e} from the CPU's gradient"


def test_engine_decodes_linear_attention_eagerly_on_cuda(triton_backend):
    """Gated-DeltaNet layers plan each step on the host: no decode graphs ('auto'), 'on' refused in one line."""
    from rlalign.rollout.config import RolloutConfig
    from rlalign.rollout.device_setup import decode_graph_mode
    from rlalign.rollout.errors import RolloutConfigError
    model = _model(False, "bfloat16")
    assert decode_graph_mode(RolloutConfig(decode_graphs="auto"), model) is None
    with pytest.raises(RolloutConfigError, match="cannot capture a model with linear-attention"):
        decode_graph_mode(RolloutConfig(decode_graphs="on"), model)
