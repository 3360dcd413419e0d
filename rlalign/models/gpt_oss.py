"""gpt-oss's mixture-of-experts FFN (``ffn_kind="gpt_oss_moe"``, every layer), on rlalign's ops.

Per token x (rows [T, hidden]; Hugging Face's ``GptOssMLP``)::

    logits     = router_logits(x, router.weight, router.bias)        fp32 [T, E] (the bias added in fp32)
    experts, w = moe_route_topk_softmax(logits, k)                   top-k of the logits, softmax over the k
    gu         = x @ gate_up_proj[e] + gate_up_proj_bias[e]          [2I]; gate = gu[0::2], up = gu[1::2]
    act        = clamped_swiglu(gate, up, alpha, limit)              (clamp(up) + 1) * g * sigmoid(alpha g)
    y[t, j]    = act @ down_proj[e] + down_proj_bias[e],  e = experts[t, j]
    out        = moe_combine(y, w, experts)                          fixed order by expert index, fp32

Weights under Hugging Face's names and layouts, as the checkpoint stores them (no layout map):
``mlp.router.weight`` [E, H], ``mlp.router.bias`` [E], ``mlp.experts.gate_up_proj`` [E, H, 2I] (gate and up
interleaved along the last dim), ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias``
[E, H]. Each expert's projections run as strict linears on its rows only (gate and up as two linears over the
de-interleaved columns: a column's bits do not depend on the others, contract), so a token's output does not
depend on how many tokens chose its experts: the rollout engine and the trainer route and compute alike.
The down projection uses the canonical K partition of ``MOE_K_SEGMENTS``, as the Qwen3-MoE experts do.

Not implemented here: tensor parallelism of these experts (no ``tp_plan`` entry: refused by the distributed
layer's plan check), the CUDA grouped-GEMM route (the experts run as a per-expert loop of strict linears).
"""

from __future__ import annotations

import torch
from torch import nn

from rlalign import ops
from rlalign.contract import spec
from rlalign.models.config import ModelConfig
from rlalign.models.ffn import register_ffn
from rlalign.models.modules import Linear
from rlalign.models.moe import current_routing_record
from rlalign.models.taps import layer_tap, tap


class GptOssExperts(nn.Module):
    """The E experts of a layer in Hugging Face's stacked layout (module docstring); ``experts(x, ids)`` ->
    y [T, k, hidden] (x's dtype)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, alpha: float, limit: float, dtype, device):
        super().__init__()

        def param(*shape):
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))

        self.gate_up_proj, self.gate_up_proj_bias = param(num_experts, hidden, 2 * inter), param(num_experts, 2 * inter)
        self.down_proj, self.down_proj_bias = param(num_experts, inter, hidden), param(num_experts, hidden)
        self.alpha, self.limit = alpha, limit

    def expert_rows(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s FFN on ``rows`` [n, hidden]: strict linears on the transposed (copied) weights."""
        w, b = self.gate_up_proj[e], self.gate_up_proj_bias[e]
        gate = ops.linear(rows, w[:, 0::2].t().contiguous(), b[0::2].contiguous())
        up = ops.linear(rows, w[:, 1::2].t().contiguous(), b[1::2].contiguous())
        act = ops.clamped_swiglu(gate, up, self.alpha, self.limit)
        return ops.linear(act, self.down_proj[e].t().contiguous(), self.down_proj_bias[e],
                          k_segments=spec.MOE_K_SEGMENTS)

    def forward(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        t, k = experts.shape
        flat = experts.reshape(-1)
        # (token, slot) pairs grouped by expert in stable order (integer bookkeeping: no bit depends on it)
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        pieces, start = [], 0
        for e, n in enumerate(counts):
            if n:
                pairs = order[start:start + n]
                pieces.append(self.expert_rows(e, x.index_select(0, pairs // k)))
                start += n
        if not pieces:
            return x.new_zeros((t, k, x.shape[1]))
        y_sorted = torch.cat(pieces)
        return y_sorted.index_select(0, torch.argsort(order)).view(t, k, x.shape[1])


class GptOssMoE(nn.Module):
    """``router`` (Linear with bias) and ``experts`` (:class:`GptOssExperts`); forward: the module docstring."""

    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, device):
        super().__init__()
        o = cfg.ffn_options
        self.layer_index, self.top_k = layer_index, int(o["num_experts_per_tok"])
        self.router = Linear(cfg.hidden_size, o["num_experts"], True, dtype, device)
        self.experts = GptOssExperts(o["num_experts"], cfg.hidden_size, cfg.intermediate_size,
                                     float(o["swiglu_alpha"]), float(o["swiglu_limit"]), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer_index
        logits = tap(layer_tap(layer, "router"), ops.router_logits(x, self.router.weight, self.router.bias))
        experts, weights = ops.moe_route_topk_softmax(logits, self.top_k)
        tap(layer_tap(layer, "routing"), experts)
        record = current_routing_record()
        if record is not None:
            record.add(layer, logits, experts)
        return ops.moe_combine(self.experts(x, experts), weights, experts)


@register_ffn("gpt_oss_moe")
def build_gpt_oss_ffn(cfg: ModelConfig, layer_index: int, dtype, device) -> nn.Module:
    """Every gpt-oss layer is sparse."""
    return GptOssMoE(cfg, layer_index, dtype, device)


__all__ = ["GptOssMoE", "GptOssExperts", "build_gpt_oss_ffn"]
