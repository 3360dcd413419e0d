"""The rollout cache of a multi-head-latent-attention layer (DeepSeek-V3): per token its compressed latent, paged like
the K/V of the other attention layers, re-expanded to per-head K and V at every attention call.

A token's cached row is ``[c_kv | k_rot]``, ``kv_lora_rank + qk_rope_head_dim`` values in the model dtype: the
latent after ``kv_a_layernorm`` (what ``kv_b_proj`` reads) and the roped shared rotary key -- the exact tensors the
expanded form computes from them (rlalign.models.deepseek_v3), so the cache loses nothing. At a paged attention call
(a prefill chunk or a decode step) the layer

1. lays its sequences' earlier tokens' rows (positions below each sequence's chunk start; zeros elsewhere: the
   stale rows past a context never reach an op) on scratch pages of its own, one per page of each sequence's
   context, in position order, and re-expands them there with the expanded form's ops (``kv_b_proj`` is the strict
   linear, whose row bits do not depend on how many rows share the call: docs/contract.md, "linear") -- the
   expansion, viewed as pages, is the scratch K/V;
2. writes the new tokens' K and V (computed in the call, as the expanded form does) into their scratch slots with
   ``ops.write_kv_cache``, the expanded form's write and its strict key check (an earlier token's key was checked
   when it was new: its re-expansion has the same bits);
3. copies the new tokens' rows into the cache (an exact copy, at ``slot_mapping``; after the key check, so a refused
   token is not cached);
4. runs ``ops.attention_paged`` over the scratch pages.

Every key and value the attention reads then has the expanded cache's bits, on the same absolute positions (the
attention contract: paged storage changes where keys live, not the order they are visited), so packed training,
chunked prefill and decode keep agreeing bit for bit. The cost: step 1 recomputes ``kv_b_proj`` over the whole
earlier context at every call (measured: docs/models.md, benchmarks/mla_cache_cpu.py). The page bookkeeping
(copy-on-write of forked samples, preemption, the prefix cache) covers the latent pages unchanged: a page's rows
are a function of the token prefix, as the expanded K/V were.
"""

from __future__ import annotations

import dataclasses

import torch

MLA = "mla"
LATENT, EXPANDED = "latent", "expanded"
MLA_CACHE_FORMS = (LATENT, EXPANDED)


def latent_width(config) -> int:
    """Values one token's cached latent row holds: kv_lora_rank + qk_rope_head_dim."""
    a = config.attention_options
    return int(a["kv_lora_rank"]) + int(a["qk_rope_head_dim"])


def latent_layers(config, form: str = LATENT) -> tuple[int, ...]:
    """Indices of the layers whose cache is the latent (every layer of an MLA model in the latent form)."""
    check_form(form)
    if config.attention_kind != MLA or form != LATENT:
        return ()
    return tuple(range(config.num_layers))


def check_form(form: str) -> None:
    if form not in MLA_CACHE_FORMS:
        raise ValueError(f"mla_cache={form!r}: choose one of {', '.join(MLA_CACHE_FORMS)}")


def latent_caches(config, num_pages: int, page_size: int, dtype: torch.dtype, device,
                  form: str = LATENT) -> dict[int, torch.Tensor]:
    """{layer: zero-initialised [num_pages, page_size, kv_lora_rank + qk_rope_head_dim]} of the latent layers."""
    layers = latent_layers(config, form)
    if not layers:
        return {}
    width = latent_width(config)
    return {i: torch.zeros((num_pages, page_size, width), dtype=dtype, device=device) for i in layers}


def write_latent(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place: row t of ``rows`` [T, width] to slot ``slot_mapping[t]`` (page * page_size + offset) of ``cache``;
    an exact copy (the dtypes must match) of the values (the cache never holds an autograd graph)."""
    if rows.dtype != cache.dtype or rows.shape[-1] != cache.shape[-1]:
        raise ValueError(f"latent rows {tuple(rows.shape)} {rows.dtype} do not fit the latent cache "
                         f"{tuple(cache.shape)} {cache.dtype}")
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping.to(device=cache.device, dtype=torch.int64),
                                                rows.detach())


@dataclasses.dataclass(frozen=True)
class ContextPlan:
    """Where a paged batch's tokens sit in the scratch pages of one attention call (the same for every layer).

    ``num_pages``: scratch pages (sum over sequences of ceil(seq_len / page_size)); ``block_table`` [S, P] int32:
    sequence i's scratch pages in position order (unused entries 0); ``cached_slots`` [N] int64: the cache slots of
    the sequences' earlier tokens (positions below their chunk starts), ``cached_local`` [N] int64: their scratch
    slots; ``new_local`` [T] int64: the new tokens' scratch slots (the batch's row order)."""

    num_pages: int
    block_table: torch.Tensor
    cached_slots: torch.Tensor
    cached_local: torch.Tensor
    new_local: torch.Tensor


def context_plan(batch) -> ContextPlan:
    """The :class:`ContextPlan` of a paged ForwardBatch, built once per forward and kept on the batch (a batch
    describes one forward: the engine and the decode graphs' padded runs build a new one per step)."""
    plan = batch.__dict__.get("latent_context_plan")
    if plan is None:
        plan = _build_plan(batch)
        batch.__dict__["latent_context_plan"] = plan   # layer-independent: every MLA layer of the forward reuses it
    return plan


def _build_plan(batch) -> ContextPlan:
    ps = batch.kv_cache.page_size
    dev = batch.block_table.device
    seq_lens = batch.seq_lens.to(torch.int64)
    counts = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).to(torch.int64)
    starts = seq_lens - counts                                   # tokens of each sequence already in the cache
    pages = (seq_lens + ps - 1) // ps
    first_page = torch.cumsum(pages, 0) - pages                  # each sequence's first scratch page
    cols = torch.arange(int(pages.max()), device=dev)
    table = torch.where(cols[None, :] < pages[:, None], first_page[:, None] + cols[None, :], 0).to(torch.int32)
    seqs = torch.arange(len(seq_lens), device=dev)
    # earlier tokens: sequence s's positions 0 .. starts[s]-1, in sequence order; position p of sequence s sits at
    # scratch slot first_page[s] * ps + p (its pages are consecutive there)
    owner = torch.repeat_interleave(seqs, starts)
    first_row = torch.cumsum(starts, 0) - starts
    pos = torch.arange(int(starts.sum()), device=dev) - torch.repeat_interleave(first_row, starts)
    cached = batch.block_table.to(torch.int64)[owner, pos // ps] * ps + pos % ps
    new_local = first_page[torch.repeat_interleave(seqs, counts)] * ps + batch.positions.to(torch.int64)
    return ContextPlan(int(pages.sum()), table, cached, first_page[owner] * ps + pos, new_local)


def scratch_rows(cache: torch.Tensor, plan: ContextPlan) -> torch.Tensor:
    """[num_pages * page_size, width]: the cached rows of the batch's earlier tokens at their scratch slots, zeros
    elsewhere (the new tokens' slots and past each context's end: stale cache rows are never read)."""
    rows = cache.view(-1, cache.shape[-1])
    out = rows.new_zeros((plan.num_pages * cache.shape[1], rows.shape[1]))
    return out.index_copy_(0, plan.cached_local, rows.index_select(0, plan.cached_slots))


__all__ = ["MLA", "LATENT", "EXPANDED", "MLA_CACHE_FORMS", "ContextPlan", "check_form", "context_plan",
           "scratch_rows", "latent_caches", "latent_layers", "latent_width", "write_latent"]
