"""What an engine's device side is, decided once from its config, its model and the model's device.

* the KV cache's size in pages (:func:`num_pages`: ``num_pages``, else a byte budget over
  :func:`page_bytes`);
* the decode-graph mode (:func:`decode_graph_mode`: ``"graphs"``, ``"padded"`` or eager), and whether a
  native engine's graphs are keyed by block-table width too (:func:`native_gathers`);
* whether steps overlap (:func:`overlap_mode`);
* the MoE routing record (:func:`routing_store`).

Each refuses a setting that cannot hold on this model or device with a :class:`RolloutConfigError` (or
:class:`KVCacheTooSmallError`) that says what to set instead.
"""

from __future__ import annotations

import torch

from rlalign.models.latent_cache import latent_layers
from rlalign.models.linear_cache import linear_page_bytes
from rlalign.models.moe import StackedExperts, sparse_layer_indices
from rlalign.models.sizes import kv_bytes_per_token
from rlalign.ops.attention import native_paged_kernel_unavailable
from rlalign.ops.moe import native_grouped_unavailable
from rlalign.rollout.block_manager import pages_for
from rlalign.rollout.config import DEFAULT_CPU_KV_CACHE_BYTES, RolloutConfig
from rlalign.rollout.errors import KVCacheTooSmallError, RolloutConfigError
from rlalign.rollout.routing import RoutingStore


def page_bytes(model, page_size: int, mla_cache: str = "latent") -> int:
    """Bytes of one KV page of ``page_size`` tokens (K and V of every layer, in the model's dtype, or the latent rows
    of a multi-head-latent-attention model's ``mla_cache="latent"``; the linear-attention layers' stores,
    rlalign.models.linear_cache)."""
    elem = torch.empty((), dtype=model.dtype).element_size()
    return (page_size * kv_bytes_per_token(model.config, elem, mla_cache)
            + linear_page_bytes(model.config, page_size, elem))


def num_pages(config: RolloutConfig, model, max_model_len: int) -> int:
    """config.num_pages, else the byte budget (kv_cache_bytes; default 1 GiB on the CPU,
    gpu_memory_fraction of the free GPU memory) over the bytes of a page, capped at what max_num_seqs
    sequences of max_model_len tokens can use."""
    if config.num_pages is not None:
        return config.num_pages
    device = model.device
    if config.kv_cache_bytes is not None:
        budget = config.kv_cache_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_fraction)
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    per_page = page_bytes(model, config.page_size, config.mla_cache)
    pages = min(budget // per_page, config.max_num_seqs * pages_for(max_model_len, config.page_size))
    if pages < 1:
        raise KVCacheTooSmallError(f"a KV budget of {budget} bytes holds no page of {config.page_size} tokens "
                                   f"({per_page} bytes each); raise kv_cache_bytes")
    return int(pages)


def decode_graph_mode(config: RolloutConfig, model) -> str | None:
    """"graphs", "padded" or None (eager), from config.decode_graphs (see RolloutConfig). Both
    profiles replay decode graphs on a GPU: native is the baseline of the same machinery."""
    setting = config.decode_graphs
    device = model.device
    gpu = device.type == "cuda"
    if setting == "on" and not gpu:
        raise RolloutConfigError(f"decode_graphs='on' needs a CUDA model (got device {device}); "
                                 "use 'auto' or 'off'")
    if config.profile == "portable":   # the portable ops run eagerly (host reads, Python loops): no capture
        if setting in ("on", "padded"):
            raise RolloutConfigError(f"decode_graphs={setting!r}: the portable profile decodes eagerly; use 'auto' "
                                     "or 'off'")
        return None
    if setting == "padded":
        return "padded"
    if gpu and model.config.linear_attention:
        # a Gated-DeltaNet layer plans each step's chunks on the host (rlalign.models.gated_deltanet): not capturable
        if setting == "on":
            raise RolloutConfigError("decode_graphs='on' cannot capture a model with linear-attention "
                                     "(Gated-DeltaNet) layers: they plan each step on the host; use 'auto' or 'off'")
        return None
    if gpu and latent_layers(model.config, config.mla_cache):
        # the latent cache's re-expansion plans its scratch pages on the host per call (rlalign.models.latent_cache)
        if setting == "on":
            raise RolloutConfigError("decode_graphs='on' cannot capture multi-head latent attention with "
                                     "mla_cache='latent' (its scratch pages are planned on the host per step); use "
                                     "'auto', 'off' or mla_cache='expanded'")
        return None
    eager_experts = gpu and config.profile == "native" and native_experts_read_host(model)
    if eager_experts:
        # the native MoE experts fall back to the per-expert loop, which reads the experts' loads on the
        # host: not capturable (strict MoE is: its grouped GEMMs need no host read)
        if setting == "on":
            raise RolloutConfigError(f"decode_graphs='on' cannot capture the native profile's MoE experts here "
                                     f"({eager_experts}: a per-expert cuBLAS loop that reads expert loads on "
                                     "the host); use 'auto' (native MoE decodes eagerly) or the strict profile")
        return None
    return "graphs" if setting == "on" or (setting == "auto" and gpu) else None


def native_experts_read_host(model) -> str | None:
    """Why a MoE model's native experts would read their loads on the host (the per-expert loop), None when
    every sparse layer's experts run as grouped GEMMs (``ops.moe.native_grouped_unavailable``) or the model
    is dense."""
    if model.config.ffn_kind != "moe":
        return None
    stacked = [m for m in model.modules() if isinstance(m, StackedExperts)]
    if len(stacked) != len(sparse_layer_indices(model.config)):
        return "experts other than one stacked module per sparse layer (e.g. tensor-parallel shards)"
    for m in stacked:
        rows = torch.empty(0, m.gate_proj.shape[2], dtype=m.gate_proj.dtype, device=model.device)
        with torch.no_grad():
            reason = native_grouped_unavailable(rows, m.gate_proj, m.up_proj, m.down_proj)
        if reason is not None:
            return reason
    return None


def native_gathers(config: RolloutConfig, model) -> bool:
    """Whether this is a native engine whose paged attention gathers K/V for SDPA (CPU, or a dtype the paged
    kernel does not take): its static decode form attends over the whole block-table width, so its graphs
    are keyed by width buckets too. The paged kernel reads each sequence's own length on the device (as
    strict does): full-width graphs, all captured at the first decode step."""
    if config.profile != "native":
        return False
    probe = torch.empty(0, 1, 2, dtype=model.dtype, device=model.device)
    return native_paged_kernel_unavailable(probe) is not None


def overlap_mode(config: RolloutConfig, device: torch.device, sampling_graphs: bool, graph_mode: str | None) -> bool:
    """Whether steps overlap (config.overlap): it needs decode steps sampled inside the graphs
    (``sampling_graphs``)."""
    setting = config.overlap
    if setting == "on" and not sampling_graphs:
        raise RolloutConfigError(
            f"overlap='on' needs decode steps sampled inside the decode graphs (decode_graphs 'auto'/'on' "
            f"on CUDA, or 'padded'; not a native MoE model whose experts decode eagerly); this engine has profile "
            f"{config.profile!r}, decode_graphs {config.decode_graphs!r} on {device}: "
            "use overlap='auto' or 'off'")
    if setting == "auto":
        return sampling_graphs and graph_mode == "graphs"
    return setting == "on"


def routing_store(config: RolloutConfig, model, num_pages: int) -> RoutingStore | None:
    """The routing record (config.record_routing), refused for a model without sparse layers."""
    if not config.record_routing:
        return None
    mc = model.config
    layers = sparse_layer_indices(mc)
    if not layers:
        raise RolloutConfigError("RolloutConfig.record_routing=True needs a mixture-of-experts model, but this "
                                 f"model ({mc.family}, ffn_kind={mc.ffn_kind!r}) has no sparse layers; "
                                 "leave record_routing off")
    opts = mc.ffn_options
    return RoutingStore(num_pages, config.page_size, len(layers), int(opts["num_experts_per_tok"]),
                        int(opts["num_experts"]))
