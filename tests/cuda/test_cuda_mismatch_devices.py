"""CUDA: the mismatch corrections and statistics accept the trainer's device. Every public function of
``rlalign.algos.mismatch`` on CUDA tensors whose engine and trainer log-probs differ gives the CPU's values (the
native profile's agreement check feeds it CUDA tensors every step; a constant built on the CPU inside one of them
once crashed that path). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from rlalign.algos import mismatch

pytestmark = pytest.mark.cuda


def _inputs(device: str):
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(64, generator=g, dtype=torch.float64) * 3
    rollout = trainer + torch.randn(64, generator=g, dtype=torch.float64) * 0.05
    mask = torch.rand(64, generator=g) > 0.2
    seq_ids = torch.arange(64) // 16
    return [t.to(device) for t in (trainer.float(), rollout.float(), mask, seq_ids)]


CALLS = {
    "token_tis": lambda t, r, m, s: mismatch.token_tis(t, r, m),
    "sequence_tis": lambda t, r, m, s: mismatch.sequence_tis(t, r, m, s, num_seqs=4),
    "token_mis": lambda t, r, m, s: mismatch.token_mis(t, r, m),
    "sequence_mis": lambda t, r, m, s: mismatch.sequence_mis(t, r, m, s, num_seqs=4),
    "behaviour_weights": lambda t, r, m, s: mismatch.behaviour_weights(t, r, m),
    "logprob_mismatch_stats": lambda t, r, m, s: mismatch.logprob_mismatch_stats(t, r, m),
    "logprob_diff_distribution": lambda t, r, m, s: mismatch.logprob_diff_distribution(t, r, m),
}


def _flatten(out) -> dict[str, torch.Tensor]:
    if isinstance(out, dict):
        return {k: torch.as_tensor(v).cpu() for k, v in out.items()}
    flat = {k: torch.as_tensor(v).cpu() for k, v in out.stats.items()}
    flat["weights"] = out.weights.cpu()
    if out.mask is not None:
        flat["mask"] = out.mask.cpu()
    return flat


@pytest.mark.parametrize("name", sorted(CALLS))
def test_cuda_inputs_give_the_cpu_values(name):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cpu = _flatten(CALLS[name](*_inputs("cpu")))
    gpu = _flatten(CALLS[name](*_inputs("cuda")))
    assert cpu.keys() == gpu.keys()
    for key in cpu:
        torch.testing.assert_close(gpu[key].to(cpu[key].dtype), cpu[key], rtol=1e-6, atol=1e-7, msg=f"{name}: {key}")
