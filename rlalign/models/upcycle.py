"""Sparse upcycling: a Qwen3-MoE model made from a dense Qwen3 one (the CPU MoE demo's model)."""

from __future__ import annotations

import torch

from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM


def upcycle(dense, num_experts: int, top_k: int, *, seed: int = 0, router_std: float = 0.02):
    """A Qwen3-MoE copy of a dense Qwen3 ``CausalLM`` ("sparse upcycling"): every layer sparse, each expert a
    copy of the layer's dense MLP, a random router (N(0, router_std), seeded) and ``norm_topk_prob=True``. The
    routing weights of a token then sum to 1 over k identical experts, so the MoE computes the dense function
    up to the combine's rounding, and training lets the experts diverge."""
    cfg = dense.config
    if cfg.ffn_kind != "dense" or not cfg.qk_norm or cfg.qkv_bias:
        raise ValueError("upcycle takes a dense Qwen3-architecture model")
    hf = cfg.to_hf_dict()
    hf.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=num_experts,
              num_experts_per_tok=top_k, moe_intermediate_size=cfg.intermediate_size, norm_topk_prob=True,
              decoder_sparse_step=1, mlp_only_layers=[])
    moe = CausalLM(ModelConfig.from_hf_dict(hf), dtype=dense.dtype, device=dense.device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        params = dict(moe.named_parameters())
        for name, p in dense.named_parameters():
            if ".mlp." not in name:
                params[name].copy_(p)
        for i, layer in enumerate(moe.model.layers):
            mlp = dense.model.layers[i].mlp
            layer.mlp.gate.weight.copy_((torch.randn(layer.mlp.gate.weight.shape, generator=gen) * router_std)
                                        .to(moe.dtype))
            for proj in ("gate_proj", "up_proj", "down_proj"):   # every expert [e] a copy of the dense weight
                stacked = getattr(layer.mlp.experts, proj)
                stacked.copy_(getattr(mlp, proj).weight.expand_as(stacked))
    return moe.eval()


__all__ = ["upcycle"]
