"""The decoder (Llama / Qwen2 / Qwen3 / Qwen3-MoE / gpt-oss / Qwen3-Next / DeepSeek-V3), written with ``rlalign.ops``.

The math of a layer lives in :mod:`rlalign.models.blocks` (shared with the transformers patch);
these modules hold the weights under Hugging Face's names and choose their parts from the
config's features (``qkv_bias``, ``qk_norm``, ``ffn_kind``), never from the family name. Rotary
tables: ``ops.rope_inv_freq`` (float64) -> ``ops.rope_cos_sin`` of absolute positions (stored fp32).
Then ``hidden = rms_norm(h, norm, eps, residual=r)[0]``; the only difference between training and
rollout is the attention call (packed varlen, or the paged KV cache); every op runs under the
profile of the current context (:func:`rlalign.contract.use_profile`). Each module declares its
tensor-parallel plan (``tp_plan``, :mod:`rlalign.contract.sharding`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from rlalign import ops
from rlalign.contract import spec
from rlalign.contract.errors import RLAlignError
from rlalign.contract import sharding
from rlalign.models.batch import ForwardBatch
from rlalign.models.blocks import (Attend, attention_block, batch_attend, decoder_layer_block, final_norm_block,
                                   rope_inv_freq)
from rlalign.models.attention_kinds import build_attention, register_attention
from rlalign.models.config import ModelConfig
from rlalign.models.ffn import build_ffn
from rlalign.models import moe as _moe  # noqa: F401  (registers the "moe" FFN kind)
from rlalign.models import gpt_oss as _gpt_oss  # noqa: F401  (registers the gpt_oss family and its FFN kind)
from rlalign.models import deepseek_v3 as _deepseek_v3  # noqa: F401  (registers the "mla" attention and its FFN kind)
from rlalign.models import gated_deltanet as _gated_deltanet  # noqa: F401  (registers the "linear" attention kind)
from rlalign.models.qwen3_next import ZeroCentredRMSNorm   # (also registers the qwen3_next family, "gated" attention)
from rlalign.models.layout import checkpoint_tensors
from rlalign.models.modules import Embedding, Linear, RMSNorm, stack_rows
from rlalign.models.taps import EMBED, note_batch, tap


@register_attention("mha")
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, device):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Linear(h, cfg.num_heads * d, cfg.qkv_bias, dtype, device)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, device)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, device)
        self.o_proj = Linear(cfg.num_heads * d, h, cfg.o_bias, dtype, device, k_segments=spec.K_SEGMENTS)
        self.window = cfg.attention_window(layer_index)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads, dtype=dtype, device=device)) if cfg.attention_sinks else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        self.stack_projections()

    def stack_projections(self) -> None:
        """q/k/v_proj's weights (and biases) back to back (modules.stack_rows): one GEMM without grad."""
        stack_rows(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        return attention_block(self, x, cos, sin, attend, layer=self.layer_index, num_heads=self.num_heads,
                               num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                               qk_norm=self.q_norm is not None, window=self.window)

    def tp_plan(self) -> dict[str, sharding.ShardSpec]:
        plan = {"q_proj": sharding.COLUMN, "k_proj": sharding.COLUMN, "v_proj": sharding.COLUMN,
                "o_proj": sharding.ROW}
        if self.q_norm is not None:
            plan.update(q_norm=sharding.head_grouped(self.num_heads), k_norm=sharding.head_grouped(self.num_kv_heads))
        return plan

    def tp_localize(self, tp: int) -> None:
        """Heads are split in contiguous groups: rank r holds query heads [r*H/tp, (r+1)*H/tp), kv heads likewise."""
        self.num_heads //= tp
        self.num_kv_heads //= tp


def norm_kind(cfg: ModelConfig) -> type[RMSNorm]:
    """The model's RMSNorm module (zero-centred weights: Qwen3-Next)."""
    return ZeroCentredRMSNorm if cfg.zero_centred_norms else RMSNorm


class DecoderLayer(nn.Module):
    """The token mixer is the layer's attention kind (rlalign.models.attention_kinds), under its checkpoint name:
    ``self_attn`` (:class:`Attention`, DeepSeek-V3's MLA, Qwen3-Next's gated attention) or, on a "linear_attention"
    layer, ``linear_attn`` (Qwen3-Next's Gated-DeltaNet)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, device):
        super().__init__()
        self.layer_index = layer_index
        norm = norm_kind(cfg)
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mixer_name, mixer = build_attention(cfg, layer_index, dtype, device)
        self.add_module(self.mixer_name, mixer)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = build_ffn(cfg, layer_index, dtype, device)

    def forward(self, h, residual, cos, sin, batch: ForwardBatch):
        """(h, residual) -> (FFN output, residual stream before the FFN); residual None on layer 0.
        (The batch is an argument so that hooks on the layer see each forward's rows.)"""
        mixer, attend = getattr(self, self.mixer_name), batch_attend(batch)
        return decoder_layer_block(self, h, residual, lambda x: mixer(x, cos, sin, attend), self.layer_index)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = norm_kind(cfg)(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


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
        self.inv_freq = rope_inv_freq(config)

    def _apply(self, fn, *args, **kwargs):
        """nn.Module's ``.to()`` / ``.cuda()`` / ``.float()`` give every parameter a tensor of its own; the
        projections are laid back to back again after it (``stack_projections`` of the modules that have one), and
        ``config.dtype`` names the parameters' dtype again (what save_model writes, so a model saved after
        ``.to(torch.bfloat16)`` reloads as bf16)."""
        out = super()._apply(fn, *args, **kwargs)
        for module in self.modules():
            if module is not self and hasattr(module, "stack_projections"):
                module.stack_projections()
        self.config = dataclasses.replace(self.config, dtype=str(self.dtype).removeprefix("torch."))
        return out

    def tp_plan(self) -> dict[str, sharding.ShardSpec]:
        """The LM head (``lm_head``, or the tied embedding) is vocab-parallel."""
        return {"lm_head": sharding.VOCAB}

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
        cos, sin = ops.rope_cos_sin(batch.positions, self._inv_freq_on(batch.positions.device),
                                    ops.rope_attention_scaling(self.config.rope_scaling))
        h, residual = tap(EMBED, self.model.embed_tokens(batch.input_ids)), None
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos, sin, batch)
        return final_norm_block(self.model.norm, h, residual)

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
    def init_random_(self, seed: int = 0, std: float = 0.02, norm_jitter: float = 0.0,
                     on_device: bool = False, lm_head_std: float | None = None) -> "CausalLM":
        """Deterministic random init (CPU generator, then cast): matrices ~ N(0, std), biases ~ N(0, std),
        norm weights 1 + N(0, norm_jitter); an untied ``lm_head.weight`` ~ N(0, lm_head_std) when given
        (0: zeros, the readout of muP / modded-nanogpt inits; the draw is made either way, so the other
        tensors keep their values). ``on_device``: the generator on the parameters' device (a GPU
        draws 8B normals in well under a second, the CPU generator takes minutes; other values than the CPU
        generator's, deterministic for a device type and torch version). One draw per checkpoint tensor in
        checkpoint order (stacked experts: per expert, rlalign.models.layout), so a seed gives the same
        weights whatever the storage layout."""
        if lm_head_std is not None and self.lm_head is None:
            raise ValueError("lm_head_std: this model ties its LM head to the embedding (tie_word_embeddings); "
                             "there is no separate head to initialise")
        where = self.device if on_device else torch.device("cpu")
        gen = torch.Generator(device=where).manual_seed(seed)
        for name, p in checkpoint_tensors(self):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=where)
            if name.endswith("norm.weight"):
                value = 1.0 + norm_jitter * noise
            elif name == "lm_head.weight" and lm_head_std is not None:
                value = lm_head_std * noise
            else:
                value = std * noise
            p.copy_(value.to(p.dtype))
        return self
