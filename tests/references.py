"""float64 references shared by the accuracy tiers (CPU ops, the Triton interpreter, CUDA)."""

from __future__ import annotations

import torch


def causal_attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens, scale: float) -> torch.Tensor:
    """Causal softmax attention of packed sequences of ``lens`` tokens, in float64 (GQA: kv heads
    repeated); q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] float64."""
    outs, start, g = [], 0, q.shape[1] // k.shape[1]
    for n in lens:
        qs = q[start:start + n].double()
        ks = k[start:start + n].double().repeat_interleave(g, 1)
        vs = v[start:start + n].double().repeat_interleave(g, 1)
        s = torch.einsum("thd,uhd->htu", qs, ks) * scale
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        outs.append(torch.einsum("htu,uhd->thd", s.masked_fill(~causal, float("-inf")).softmax(-1), vs))
        start += n
    return torch.cat(outs)
