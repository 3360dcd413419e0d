"""float64 references shared by the accuracy tiers (CPU ops, the Triton interpreter, CUDA)."""

from __future__ import annotations

import torch


def causal_attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens, scale: float,
                             window: "int | None" = None, sinks: "torch.Tensor | None" = None) -> torch.Tensor:
    """Causal softmax attention of packed sequences of ``lens`` tokens, in float64 (GQA: kv heads
    repeated); q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] float64. ``window``: a query at position t sees the
    keys at positions > t - window; ``sinks`` [Hq]: one more logit per head in the softmax, whose probability is
    dropped (it has no value)."""
    outs, start, g = [], 0, q.shape[1] // k.shape[1]
    for n in lens:
        qs = q[start:start + n].double()
        ks = k[start:start + n].double().repeat_interleave(g, 1)
        vs = v[start:start + n].double().repeat_interleave(g, 1)
        s = torch.einsum("thd,uhd->htu", qs, ks) * scale
        seen = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if window is not None:
            pos = torch.arange(n, device=q.device)
            seen &= pos[None, :] > pos[:, None] - window
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double().to(q.device).view(-1, 1, 1).expand(-1, n, 1)], -1)
        outs.append(torch.einsum("htu,uhd->thd", s.softmax(-1)[..., :n], vs))
        start += n
    return torch.cat(outs)
