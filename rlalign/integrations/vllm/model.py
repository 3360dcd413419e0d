"""The out-of-tree vLLM model class: rlalign's decoder (``rlalign.models.CausalLM``) run by vLLM.

vLLM schedules, batches and allocates KV blocks as usual; this class turns each step's vLLM
batch (input ids, positions and the attention metadata: query_start_loc, seq_lens, block_table,
slot_mapping) into rlalign's paged :class:`~rlalign.models.batch.ForwardBatch` and runs the same
``forward_hidden`` as the trainer and rlalign's rollout engine, so every op is an rlalign strict op.

KV cache: vLLM's ``Attention`` layers are declared only so that vLLM sizes, allocates and pages a
cache and builds the block tables; the K/V themselves live in a cache this class owns, laid out
as rlalign's ``KVCache`` ([num_pages, page_size, Hkv, D] per layer), addressed by vLLM's own
block ids and slot mapping. (vLLM's CPU cache interleaves K and V per head inside a block, a layout
rlalign's paged attention does not read; its allocation stays unused.)

``compute_logits`` returns strict fp32 logits (``ops.lm_logits``) and leaves the final hidden
rows and the positions of the tokens to sample for the sampler hook (:mod:`.sampler`), which
samples with ``ops.sample`` and reports ``ops.logprob_entropy`` of the sampled token.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

from rlalign import ops
from rlalign.contract.profiles import Profile, use_profile
from rlalign.integrations.vllm.checks import check_vllm_config
from rlalign.integrations.vllm.errors import UnsupportedVLLMConfigError
from rlalign.models.batch import ForwardBatch, KVCache
from rlalign.models.checkpoint import load_model_config
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.models.layout import checkpoint_entries, entry_view


@dataclasses.dataclass
class PendingSample:
    """What ``compute_logits`` leaves for the sampler: the logits object it returned (identity is the
    handshake), the final hidden rows behind them, the positions the sampled tokens will occupy (None
    when they are unknown: the rows are not one per sequence of the last forward) and the LM head weight.
    ``warmup``: logits of vLLM's dummy runs (no sequences), sampled by vLLM's own sampler and discarded."""

    logits: torch.Tensor
    hidden: torch.Tensor
    positions: torch.Tensor | None
    lm_head_weight: torch.Tensor
    profile: Profile
    warmup: bool = False


# The sampler hook reads this (vLLM runs one model per worker process).
PENDING: dict[str, PendingSample] = {}
# How many rlalign models this process built: once one exists, the sampler never falls back to vLLM's.
MODELS_BUILT: list[int] = [0]


class RLAlignForCausalLM(CausalLM):
    """vLLM model class for Qwen3 / Qwen2 / Llama checkpoints; parameter names are Hugging Face's."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        model_config = vllm_config.model_config
        config: ModelConfig = load_model_config(model_config.model)
        check_vllm_config(vllm_config, config)
        super().__init__(config, dtype=model_config.dtype, device=_device(vllm_config))
        self.profile = Profile.STRICT
        self.page_size = int(vllm_config.cache_config.block_size)
        self.vllm_attention = nn.ModuleList(
            _vllm_attention_layer(config, vllm_config, _join(prefix, f"model.layers.{i}.self_attn.attn"))
            for i in range(config.num_layers))
        self.kv_cache: KVCache | None = None
        self._next_positions: torch.Tensor | None = None
        MODELS_BUILT[0] += 1

    # ---- vLLM model interface ---------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        with use_profile(self.profile):
            return self.model.embed_tokens(input_ids)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise UnsupportedVLLMConfigError("inputs_embeds / pipeline-parallel intermediate tensors are not "
                                             "supported (pass token ids; pipeline_parallel_size=1)")
        meta = self._attention_metadata()
        out = torch.zeros((input_ids.shape[0], self.config.hidden_size), dtype=self.dtype, device=input_ids.device)
        if meta is None:   # vLLM's warm-up / profiling runs: no sequences, nothing to compute
            self._next_positions = None
            return out
        batch = self._batch(input_ids, positions, meta)
        with use_profile(self.profile):
            hidden = self.forward_hidden(batch)
        out[:batch.num_tokens] = hidden
        # the token sampled after each sequence's last row goes at that row's position + 1
        self._next_positions = batch.positions.index_select(0, batch.last_token_rows) + 1
        return out

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with use_profile(self.profile):
            logits = ops.lm_logits(hidden_states, self.lm_head_weight)
        positions = self._next_positions
        warmup = positions is None
        if positions is not None and positions.shape[0] != hidden_states.shape[0]:
            positions = None
        PENDING["sample"] = PendingSample(logits, hidden_states, positions, self.lm_head_weight, self.profile, warmup)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face named tensors into the parameters (cast as ``Tensor.to`` does, as
        rlalign's ``load_model``; a per-expert tensor into its slice of the stacked experts:
        rlalign.models.layout); returns the names of the parameters loaded."""
        entries = {e.checkpoint_name: e for e in checkpoint_entries(self)}
        owners = dict(self.named_parameters())
        params = {name: entry_view(owners[e.param_name], e) for name, e in entries.items()}
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                if name == "lm_head.weight" and self.lm_head is None or "rotary_emb" in name:
                    continue
                raise UnsupportedVLLMConfigError(f"checkpoint tensor {name!r} has no place in rlalign's "
                                                 f"{self.config.family} decoder")
            param = params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise UnsupportedVLLMConfigError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                                 f"expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(entries[name].param_name)
        return loaded

    # ---- batch description ------------------------------------------------------------------------

    def _attention_metadata(self):
        from vllm.forward_context import get_forward_context, is_forward_context_available  # lazy: optional, heavy
        if not is_forward_context_available():
            return None
        meta = get_forward_context().attn_metadata
        if meta is None:
            return None
        if isinstance(meta, list):
            raise UnsupportedVLLMConfigError("micro-batching (ubatching / dual-batch overlap) is not supported")
        return meta.get(self.vllm_attention[0].layer_name)

    def _batch(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> ForwardBatch:
        n = int(meta.num_actual_tokens)
        seq_lens = meta.seq_lens
        num_seqs = int(seq_lens.shape[0])
        cu = meta.query_start_loc[:num_seqs + 1].to(torch.int32)
        return ForwardBatch(
            input_ids=input_ids[:n].to(torch.int64), positions=positions[:n].to(torch.int64), cu_seqlens=cu,
            kv_cache=self._cache(), block_table=meta.block_table[:num_seqs].to(torch.int32),
            seq_lens=seq_lens.to(torch.int32), slot_mapping=meta.slot_mapping[:n].to(torch.int64))

    def _cache(self) -> KVCache:
        """The plugin's KV cache: as many pages of ``block_size`` tokens as vLLM allocated blocks."""
        if self.kv_cache is None:
            cfg = self.config
            vllm_kv = self.vllm_attention[0].kv_cache
            per_block = self.page_size * cfg.num_kv_heads * cfg.head_dim * 2
            num_pages = vllm_kv.numel() // per_block
            if num_pages < 1:
                raise UnsupportedVLLMConfigError("vLLM allocated no KV cache blocks for the rlalign model")
            self.kv_cache = KVCache.for_model(cfg, num_pages, self.page_size, self.dtype, self.device)
        return self.kv_cache


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _device(vllm_config) -> torch.device:
    device = getattr(vllm_config.device_config, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def _vllm_attention_layer(config: ModelConfig, vllm_config, name: str) -> nn.Module:
    """A vLLM Attention layer that only declares this layer's KV cache to vLLM (never called)."""
    from vllm.model_executor.layers.attention import Attention  # lazy: optional, heavy
    return Attention(config.num_heads, config.head_dim, config.head_dim ** -0.5, num_kv_heads=config.num_kv_heads,
                     cache_config=vllm_config.cache_config, prefix=name)
