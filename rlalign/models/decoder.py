"""The dense decoder (Llama / Qwen2 / Qwen3), written only with ``rlalign.ops``.

Per layer, for the T rows of a :class:`ForwardBatch` (stream dtype = parameter dtype):

    x, r  = rms_norm(h, input_layernorm, eps, residual=r)        # r: residual stream, h + r rounded once
    q,k,v = linear(x, W_q, b_q), linear(x, W_k, b_k), linear(x, W_v, b_v)     # b_* only for qwen2
    q,k   = rms_norm(q, q_norm), rms_norm(k, k_norm)             # qwen3 only, over head_dim
    q,k   = rope(q, cos, sin), rope(k, cos, sin)                 # tables: float64 -> fp32, absolute positions
    a     = attention_varlen(q, k, v, cu_seqlens)                # packed batch, or:
            write_kv_cache(k, v, ...); attention_paged(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens)
    h     = linear(a, W_o, k_segments=K_SEGMENTS)                # canonical K partition (TP invariant)
    x, r  = rms_norm(h, post_attention_layernorm, eps, residual=r)
    h     = linear(silu_mul(linear(x, W_gate), linear(x, W_up)), W_down, k_segments=K_SEGMENTS)

then ``hidden = rms_norm(h, norm, eps, residual=r)[0]``; scale = head_dim ** -0.5. The only
difference between training and rollout is the attention call; every op runs under the
profile of the current context (:func:`rlalign.contract.use_profile`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from rlalign import ops
from rlalign.contract import spec
from rlalign.contract.errors import RLAlignError
from rlalign.models.batch import ForwardBatch
from rlalign.models.config import ModelConfig
# tap/note_batch are no-ops unless a parity capture is active; the only upward import of models/
# (capture is the parity layer's, the call sites must be the model's own boundaries).
from rlalign.parity.capture import note_batch, tap


def _param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class Linear(nn.Module):
    """Holds ``weight`` [out, in] (and ``bias`` [out]); computed through ``ops.linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device, k_segments: int | None = None):
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.k_segments = k_segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, k_segments=self.k_segments)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.weight = _param((size,), dtype, device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual=residual)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, dtype, device):
        super().__init__()
        self.weight = _param((num, dim), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(ids, self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, device):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.scale = d ** -0.5
        self.q_proj = Linear(h, cfg.num_heads * d, cfg.qkv_bias, dtype, device)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, device)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, device)
        self.o_proj = Linear(cfg.num_heads * d, h, False, dtype, device, k_segments=spec.K_SEGMENTS)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        i = self.layer_index
        tap(f"layers.{i}.q", q), tap(f"layers.{i}.k", k), tap(f"layers.{i}.v", v)
        if batch.kv_cache is None:
            out = ops.attention_varlen(q, k, v, batch.cu_seqlens, scale=self.scale)
        else:
            k_cache, v_cache = batch.kv_cache.k[self.layer_index], batch.kv_cache.v[self.layer_index]
            ops.write_kv_cache(k, v, k_cache, v_cache, batch.slot_mapping)
            out = ops.attention_paged(q, k_cache, v_cache, batch.block_table, batch.seq_lens, batch.cu_seqlens,
                                      scale=self.scale)
        out = tap(f"layers.{i}.attn", out.reshape(t, self.num_heads * self.head_dim))
        return tap(f"layers.{i}.o_proj", self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, False, dtype, device)
        self.up_proj = Linear(h, i, False, dtype, device)
        self.down_proj = Linear(i, h, False, dtype, device, k_segments=spec.K_SEGMENTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, layer_index, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(self, h, residual, cos, sin, batch: ForwardBatch):
        """(h, residual) -> (mlp output, residual stream before the MLP); residual None on layer 0."""
        i = self.self_attn.layer_index
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        tap(f"layers.{i}.input_norm", x)
        h = self.self_attn(x, cos, sin, batch)
        x, residual = self.post_attention_layernorm(h, residual)
        tap(f"layers.{i}.post_norm", x)
        h = tap(f"layers.{i}.mlp", self.mlp(x))
        # the residual stream after the attention add; the next norm adds h to it (fused residual)
        tap(f"layers.{i}.residual", residual)
        return h, residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class CausalLM(nn.Module):
    """Parameter names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``, ...);
    ``lm_head.weight`` is absent when embeddings are tied. Parameters start uninitialised
    (load a checkpoint, or call :meth:`init_random_`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        # config.dtype always names the parameters' dtype (it is what save_model writes).
        self.config = config = dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."))
        self.model = Backbone(config, dtype, device)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, False,
                                                                      dtype, device)
        # float64 inverse frequencies; cos/sin are derived per batch from absolute positions.
        self.inv_freq = ops.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states [T, H] (stream dtype) for every new token of ``batch``."""
        note_batch(batch)
        cos, sin = ops.rope_cos_sin(batch.positions, self._inv_freq_on(batch.positions.device))
        h, residual = tap("embed", self.model.embed_tokens(batch.input_ids)), None
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos, sin, batch)
        if residual is None:  # no layers
            return tap("final_norm", self.model.norm(h))
        return tap("final_norm", self.model.norm(h, residual)[0])

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.forward_hidden(batch)

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """inv_freq on the batch's device, copied once (a forward captured into a CUDA graph may not
        copy from host memory)."""
        src, copy = self.__dict__.get("_inv_freq_device", (None, None))
        if src is not self.inv_freq or copy.device != device:
            copy = self.inv_freq.to(device)
            self.__dict__["_inv_freq_device"] = (self.inv_freq, copy)
        return copy

    def logprobs(self, batch: ForwardBatch, targets: torch.Tensor, temperature: float = 1.0,
                 with_entropy: bool = False, token_chunk: int | None = None, vocab_chunk: int | None = None):
        """(logprob fp32 [T], entropy fp32 [T] | None): log softmax(lm_head(hidden) / temperature)[targets],
        fused (ops.logprob_entropy), differentiable."""
        hidden = self.forward_hidden(batch)
        return self.head_logprobs(hidden, targets, temperature=temperature, with_entropy=with_entropy,
                                  token_chunk=token_chunk, vocab_chunk=vocab_chunk)

    def head_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                      with_entropy: bool = False, token_chunk: int | None = None, vocab_chunk: int | None = None):
        """The fused LM head (ops.logprob_entropy) on final hidden rows; vocab-parallel (same forward
        bits) once rlalign.distributed.parallelize has installed ``parallel_head``."""
        head = self.__dict__.get("parallel_head")
        if head is not None:
            return head(hidden, targets, temperature=temperature, with_entropy=with_entropy)
        return ops.logprob_entropy(hidden, self.lm_head_weight, targets, temperature=temperature,
                                   token_chunk=token_chunk, vocab_chunk=vocab_chunk, with_entropy=with_entropy)

    def logits(self, hidden_rows: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """fp32 [S, V] logits / temperature of a few hidden rows (e.g. each sequence's last token)."""
        if self.__dict__.get("parallel_head") is not None:
            raise RLAlignError("CausalLM.logits: a tensor-parallel model has no full LM head; sample with an "
                               "unsharded copy of the weights (the rollout engine)")
        return ops.lm_logits(hidden_rows, self.lm_head_weight, temperature=temperature)

    @torch.no_grad()
    def init_random_(self, seed: int = 0, std: float = 0.02, norm_jitter: float = 0.0) -> "CausalLM":
        """Deterministic random init (CPU generator, then cast): matrices ~ N(0, std), biases ~ N(0, std),
        norm weights 1 + N(0, norm_jitter)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + norm_jitter * noise
            else:
                value = std * noise
            p.copy_(value.to(p.dtype))
        return self
