"""Batch descriptions for the one forward: packed varlen sequences, or new tokens against a paged KV cache.

A batch is T new tokens from S sequences, concatenated (sequence i owns rows
``cu_seqlens[i]:cu_seqlens[i+1]``), each with its absolute position. That is all the packed
(training) path needs. The paged path adds where the context lives: sequence i's token at
absolute position p sits in page ``block_table[i, p // page_size]`` at offset ``p % page_size``;
``seq_lens[i]`` is its context length including the new tokens, and ``slot_mapping`` tells
where each new token's K/V is written (``page * page_size + offset``). Prefill (start 0),
chunked prefill (start > 0) and decode (one token) are the same description.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from rlalign.models.latent_cache import LATENT, latent_caches
from rlalign.models.linear_cache import linear_caches


class KVCache:
    """Per-layer paged K/V storage: ``k[layer]``, ``v[layer]`` are [num_pages, page_size, Hkv, D].

    Zero-initialised, so pages never written hold finite values. A layer that keeps another per-token store instead
    (a linear-attention layer: ``linear[layer]``; a multi-head-latent-attention layer: ``latent[layer]``, its
    compressed latent rows, rlalign.models.latent_cache) has zero-width K/V.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.page_size = page_size
        self.num_pages = num_pages
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.linear = {}   # {layer: LinearLayerCache} of the linear-attention layers (rlalign.models.linear_cache)
        self.latent = {}   # {layer: [num_pages, page_size, width]} of the latent MLA layers (models.latent_cache)

    @classmethod
    def for_model(cls, config, num_pages: int, page_size: int, dtype: torch.dtype,
                  device: str | torch.device = "cpu", *, mla_cache: str = LATENT) -> "KVCache":
        """The cache of ``config``'s layers. ``mla_cache`` (multi-head latent attention only): ``"latent"`` (the
        default: a token's compressed latent per layer) or ``"expanded"`` (its per-head K and zero-padded V, 2 x
        heads x (qk_nope + qk_rope) values; no re-expansion per call) -- the same bits either way."""
        cache = cls(config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim, dtype, device)
        cache.linear = linear_caches(config, num_pages, page_size, dtype, device)
        cache.latent = latent_caches(config, num_pages, page_size, dtype, device, mla_cache)
        for i in (*cache.linear, *cache.latent):   # these layers keep no K/V: their own stores instead
            cache.k[i] = cache.k[i].new_zeros((num_pages, page_size, 0, config.head_dim))
            cache.v[i] = cache.v[i].new_zeros((num_pages, page_size, 0, config.head_dim))
        return cache

    def paged_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by page (dim 0): what a copy-on-write copies from page to page."""
        return [*self.k, *self.v, *self.latent.values(), *(t for c in self.linear.values() for t in c.paged_tensors())]

    def slot_values(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """[len(slots), values]: what layer ``layer`` keeps for the tokens at ``slots`` (page * page_size +
        offset) -- its K and V, or its latent row."""
        if layer in self.latent:
            store = self.latent[layer]
            return store.reshape(-1, store.shape[-1]).index_select(0, slots)
        k, v = self.k[layer], self.v[layer]
        shape = (k.shape[0] * k.shape[1], k.shape[2] * k.shape[3])   # explicit: a zero-width layer's too
        return torch.cat([k.reshape(shape).index_select(0, slots), v.reshape(shape).index_select(0, slots)], dim=1)

    @property
    def num_layers(self) -> int:
        return len(self.k)


@dataclasses.dataclass
class ForwardBatch:
    input_ids: torch.Tensor            # int64 [T]
    positions: torch.Tensor            # int64 [T], absolute position of each token in its sequence
    cu_seqlens: torch.Tensor           # int32 [S+1], new-token offsets per sequence
    kv_cache: KVCache | None = None
    block_table: torch.Tensor | None = None    # int32 [S, P]; unused entries are 0
    seq_lens: torch.Tensor | None = None       # int32 [S], context length incl. the new tokens
    slot_mapping: torch.Tensor | None = None   # int64 [T], page * page_size + offset of each new token

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def last_token_rows(self) -> torch.Tensor:
        """Row index of each sequence's last new token (int64 [S]): the rows to sample from."""
        return self.cu_seqlens[1:].long() - 1

    @classmethod
    def packed(cls, token_lists: Sequence[Sequence[int]], device: str | torch.device = "cpu") -> "ForwardBatch":
        """Whole sequences, concatenated; positions restart at 0 for each sequence."""
        _check_nonempty(token_lists)
        ids = torch.tensor([t for seq in token_lists for t in seq], dtype=torch.int64, device=device)
        positions = torch.cat([torch.arange(len(seq), dtype=torch.int64) for seq in token_lists]).to(device)
        return cls(ids, positions, _cu_seqlens([len(s) for s in token_lists], device))

    @classmethod
    def extend(cls, new_token_lists: Sequence[Sequence[int]], start_positions: Sequence[int], kv_cache: KVCache,
               block_tables: Sequence[Sequence[int]], device: str | torch.device | None = None) -> "ForwardBatch":
        """Append ``new_token_lists[i]`` to sequence i, whose first ``start_positions[i]`` tokens are
        already in ``kv_cache`` through the pages ``block_tables[i]`` (page ids, in position order)."""
        _check_nonempty(new_token_lists)
        if not (len(new_token_lists) == len(start_positions) == len(block_tables)):
            raise ValueError(f"got {len(new_token_lists)} token lists, {len(start_positions)} start positions "
                             f"and {len(block_tables)} block tables; they must match")
        device = kv_cache.k[0].device if device is None else device
        ps = kv_cache.page_size
        positions, slots = [], []
        for i, (new, start, pages) in enumerate(zip(new_token_lists, start_positions, block_tables)):
            end = start + len(new)
            _check_pages(i, pages, end, ps, kv_cache.num_pages)
            seq_pos = list(range(start, end))
            positions += seq_pos
            slots += [pages[p // ps] * ps + p % ps for p in seq_pos]
        width = max(len(p) for p in block_tables)
        table = [list(p) + [0] * (width - len(p)) for p in block_tables]
        return cls(
            input_ids=torch.tensor([t for seq in new_token_lists for t in seq], dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            cu_seqlens=_cu_seqlens([len(s) for s in new_token_lists], device),
            kv_cache=kv_cache,
            block_table=torch.tensor(table, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([s + len(n) for s, n in zip(start_positions, new_token_lists)],
                                  dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        )

    @classmethod
    def prefill(cls, token_lists: Sequence[Sequence[int]], kv_cache: KVCache,
                block_tables: Sequence[Sequence[int]], device=None) -> "ForwardBatch":
        """Whole prompts into empty sequences (positions from 0)."""
        return cls.extend(token_lists, [0] * len(token_lists), kv_cache, block_tables, device)

    @classmethod
    def decode(cls, tokens: Sequence[int], positions: Sequence[int], kv_cache: KVCache,
               block_tables: Sequence[Sequence[int]], device=None) -> "ForwardBatch":
        """One new token per sequence at ``positions[i]`` (= the number of tokens already cached)."""
        return cls.extend([[t] for t in tokens], positions, kv_cache, block_tables, device)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def contiguous_block_tables(capacities: Sequence[int], page_size: int, first_page: int = 0) -> list[list[int]]:
    """Give sequence i consecutive pages enough for ``capacities[i]`` tokens, sequences one after another."""
    tables, nxt = [], first_page
    for cap in capacities:
        n = pages_needed(cap, page_size)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    return tables


def next_token_targets(token_lists: Sequence[Sequence[int]], fill: int = 0) -> torch.Tensor:
    """int64 [T] targets for a packed batch: token t's target is token t+1 of the same sequence;
    a sequence's last token (no next token) gets ``fill``."""
    out = []
    for seq in token_lists:
        out += list(seq[1:]) + [fill]
    return torch.tensor(out, dtype=torch.int64)


def _cu_seqlens(lengths: Sequence[int], device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _check_nonempty(token_lists) -> None:
    if len(token_lists) == 0:
        raise ValueError("a batch needs at least one sequence")
    for i, seq in enumerate(token_lists):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} has no tokens")


def _check_pages(i: int, pages: Sequence[int], length: int, page_size: int, num_pages: int) -> None:
    if len(pages) < pages_needed(length, page_size):
        raise ValueError(f"sequence {i}: {len(pages)} pages hold {len(pages) * page_size} tokens, "
                         f"{length} needed (page_size={page_size})")
    bad = [p for p in pages if not 0 <= p < num_pages]
    if bad:
        raise ValueError(f"sequence {i}: page id {bad[0]} is outside the cache [0, {num_pages})")
