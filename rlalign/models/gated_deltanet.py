"""Qwen3-Next's linear-attention layer (Gated-DeltaNet, ``linear_attn``), on rlalign's ops.

Per token x (Hugging Face's ``Qwen3NextGatedDeltaNet``; Hk key heads, Hv = r Hk value heads)::

    qkvz = in_proj_qkvz(x)  viewed [Hk, 2 Dk + 2 r Dv]: per key head q | k | v (r heads) | z (r heads)
    ba   = in_proj_ba(x)    viewed [Hk, 2 r]:            per key head b (r heads) | a (r heads)
    q|k|v = silu(causal depthwise conv1d(q|k|v))         kernel K over the token and the K-1 before it
    q, k = l2norm(q) Dk^-1/2, l2norm(k);  g = -exp(A_log) softplus(a + dt_bias);  beta = sigmoid(b)
    o    = gated delta rule(q, k, v, g, beta)            (q, k repeated to the Hv heads, key head h // r)
    out  = out_proj(RMSNorm(o) * norm.weight * silu(z))  per value head, over Dv

The rule runs in chunks of ``spec.GDN_CHUNK`` tokens at absolute positions (``ops.gated_delta.delta_chunks``): the
packed trainer forward and the engine's prefill chunks and decode steps cut every sequence at the same places and
compute each token from the state at its chunk's start plus its chunk's rows up to itself, so its bits do not
depend on how the engine cut the sequence. The engine's per-sequence state (conv inputs, the open chunk's rows,
the states at chunk boundaries) lives in the sequence's KV pages (:mod:`rlalign.models.linear_cache`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from rlalign.contract import spec
from rlalign.contract.errors import RLAlignError
from rlalign.models.attention_kinds import register_attention
from rlalign.models.linear_cache import LinearShape
from rlalign.models.modules import Linear
from rlalign.models.taps import layer_tap, tap
from rlalign.ops import gated_delta as gd


class _Conv(nn.Module):
    """Holds ``weight`` [conv_dim, 1, K] (``conv1d.weight``, nn.Conv1d's depthwise layout)."""

    def __init__(self, channels: int, kernel: int, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty((channels, 1, kernel), dtype=dtype, device=device))


@register_attention("linear", module_name="linear_attn")
class GatedDeltaNet(nn.Module):
    """The layer's weights under Hugging Face's names (module docstring); forward(x [T, hidden], cos, sin, attend):
    the attention kinds' call (rlalign.models.attention_kinds), the rope tables unused, ``attend.batch`` the batch."""

    def __init__(self, cfg, layer_index: int, dtype, device):
        super().__init__()
        s = self.shape = LinearShape.of(cfg)
        h = cfg.hidden_size
        self.layer_index = layer_index
        self.in_proj_qkvz = Linear(h, 2 * s.num_k_heads * s.k_head_dim + 2 * s.num_v_heads * s.v_head_dim, False,
                                   dtype, device)
        self.in_proj_ba = Linear(h, 2 * s.num_v_heads, False, dtype, device)
        self.conv1d = _Conv(s.conv_dim, s.conv_kernel, dtype, device)
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads, dtype=dtype, device=device))
        self.norm = _GatedNormWeight(s.v_head_dim, cfg.rms_norm_eps, dtype, device)
        self.out_proj = Linear(s.num_v_heads * s.v_head_dim, h, False, dtype, device)

    def split(self, x: torch.Tensor):
        """(mixed q|k|v [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]) from the projections, undoing the
        head-grouped interleaving of transformers' ``fix_query_key_value_ordering``."""
        s, t = self.shape, x.shape[0]
        r = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, s.num_k_heads, 2 * s.k_head_dim + 2 * r * s.v_head_dim)
        ba = self.in_proj_ba(x).view(t, s.num_k_heads, 2 * r)
        dk, dv = s.k_head_dim, r * s.v_head_dim
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v, z = qkvz[..., 2 * dk:2 * dk + dv], qkvz[..., 2 * dk + dv:]
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return (mixed, z.reshape(t, s.num_v_heads, s.v_head_dim), ba[..., :r].reshape(t, s.num_v_heads),
                ba[..., r:].reshape(t, s.num_v_heads))

    def delta_rows(self, conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """fp32 [T, input_width]: q_hat | k_hat | v | g | beta of each token (the head of linear_cache's ``rows``)."""
        s, t = self.shape, conv_out.shape[0]
        kd = s.num_k_heads * s.k_head_dim
        q = conv_out[:, :kd].view(t, s.num_k_heads, s.k_head_dim)
        k = conv_out[:, kd:2 * kd].view(t, s.num_k_heads, s.k_head_dim)
        q_hat, k_hat, g, beta = gd.delta_inputs(q, k, a, b, self.A_log, self.dt_bias)
        return torch.cat([q_hat.reshape(t, -1), k_hat.reshape(t, -1), conv_out[:, 2 * kd:], g, beta], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        batch = attend.batch
        mixed, z, b, a = self.split(x)
        plan = _Plan(batch, self.shape.conv_kernel)
        store = None if batch.kv_cache is None else batch.kv_cache.linear[self.layer_index]
        if store is None:
            taps = _gather_taps(mixed, plan.tap_rows)
        else:
            flat_conv = store.conv.view(-1, store.conv.shape[-1])
            flat_conv.index_copy_(0, plan.slots, mixed.detach())
            taps = _gather_taps(flat_conv, plan.tap_rows)
        rows = self.delta_rows(gd.short_conv(taps, self.conv1d.weight.squeeze(1)), b, a)
        state0 = plan.initial_states(store, self.shape, rows)
        if store is None:
            out, _, _, _ = gd.delta_chunks(*self._chunked(_gather(rows, plan.chunk_rows)), plan.valid, state0)
        else:
            out = self._paged(store, plan, rows, state0)
        o = out.permute(0, 1, 3, 2, 4).reshape(-1, self.shape.num_v_heads, self.shape.v_head_dim)[plan.out_rows]
        normed = gd.gated_rms_norm(o, z, self.norm.weight, self.norm.eps, x.dtype)
        return tap(layer_tap(self.layer_index, "o_proj"), self.out_proj(normed.reshape(x.shape[0], -1)))

    def _paged(self, store, plan: "_Plan", rows: torch.Tensor, state0: torch.Tensor) -> torch.Tensor:
        """The rule through the sequences' stores: the new tokens' inputs written to their slots, every chunk row
        read back from there with the earlier rows' Gamma and U (a decode step solves only its own row), the new
        tokens' Gamma and U and the closed chunks' states written back."""
        s, width = self.shape, self.shape.input_width
        flat = store.rows.view(-1, store.rows.shape[-1])
        flat[:, :width].index_copy_(0, plan.slots, rows.detach())   # the stores hold values, never a graph
        gathered = _gather(flat, plan.chunk_rows)                      # [J, B, C, row_width]
        j, bsz, c = gathered.shape[:3]
        extra = gathered[..., width:].reshape(j, bsz, c, s.num_v_heads, -1)   # per value head: Gamma | U
        gamma, u = extra[..., 0].permute(0, 1, 3, 2), extra[..., 1:].permute(0, 1, 3, 2, 4)
        out, states, gamma, u = gd.delta_chunks(*self._chunked(gathered[..., :width]), plan.valid, state0,
                                                known=(plan.known_rows, gamma, u))
        plan.store_states(store, states)
        done = torch.cat([gamma.permute(0, 1, 3, 2).unsqueeze(-1), u.permute(0, 1, 3, 2, 4)], dim=-1)
        flat[:, width:].index_copy_(0, plan.slots, done.reshape(j * bsz * c, -1)[plan.out_rows].detach())
        return out

    def _chunked(self, rows: torch.Tensor):
        """[J, B, C, input_width] -> q, k [J, B, Hv, C, Dk] (repeated to the value heads), v [J, B, Hv, C, Dv],
        g, beta [J, B, Hv, C]."""
        s = self.shape
        j, bsz, c = rows.shape[:3]
        r = s.num_v_heads // s.num_k_heads
        kd, vd = s.num_k_heads * s.k_head_dim, s.num_v_heads * s.v_head_dim

        def heads(x, n, d):
            return x.reshape(j, bsz, c, n, d).permute(0, 1, 3, 2, 4)

        q = heads(rows[..., :kd], s.num_k_heads, s.k_head_dim).repeat_interleave(r, dim=2)
        k = heads(rows[..., kd:2 * kd], s.num_k_heads, s.k_head_dim).repeat_interleave(r, dim=2)
        v = heads(rows[..., 2 * kd:2 * kd + vd], s.num_v_heads, s.v_head_dim)
        g = rows[..., 2 * kd + vd:2 * kd + vd + s.num_v_heads].permute(0, 1, 3, 2)
        beta = rows[..., 2 * kd + vd + s.num_v_heads:].permute(0, 1, 3, 2)
        return q, k, v, g, beta


class _GatedNormWeight(nn.Module):
    """Holds the gated RMSNorm's ``weight`` [Dv] (``norm.weight``; not zero-centred) and eps."""

    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device))
        self.eps = eps


def _gather(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """source rows at ``index`` (any shape, on any device; -1: a zero row), differentiable in ``source``. The
    backward adds the gradients of rows picked twice in an order CUDA does not fix (atomics): call it with indices
    that pick a row at most once, or only -1 twice (those gradients are exact zeros)."""
    flat = index.reshape(-1).to(source.device)
    picked = source.index_select(0, flat.clamp(min=0))
    picked = torch.where((flat >= 0).unsqueeze(-1), picked, torch.zeros((), dtype=source.dtype))
    return picked.view(*index.shape, source.shape[-1])


def _gather_taps(source: torch.Tensor, tap_rows: torch.Tensor) -> torch.Tensor:
    """[T, K, D]: the conv taps of every token, one gather per tap (a source row is tap t of at most one token), so
    the backward sums a row's K tap gradients in autograd's fixed order, not by atomics (deterministic on CUDA)."""
    return torch.stack([_gather(source, tap_rows[:, t]) for t in range(tap_rows.shape[1])], dim=1)


class _Plan:
    """Where each sequence's rows come from, on the host (integer bookkeeping, no bit depends on it).

    Sequence b's new tokens sit at absolute positions [start_b, end_b); they touch chunks start_b // C ..
    (end_b - 1) // C, the scan's items (j, b). Packed (no cache): sources are the batch's rows, start_b must be 0.
    Paged: sources are the store's slots (the new tokens' rows are written there first)."""

    def __init__(self, batch, kernel: int):
        c = spec.GDN_CHUNK
        cu = batch.cu_seqlens.cpu().numpy().astype(np.int64)
        counts = np.diff(cu)
        self.paged = batch.kv_cache is not None
        if self.paged:
            ends = batch.seq_lens.cpu().numpy().astype(np.int64)
            starts = ends - counts
            table = batch.block_table.cpu().numpy().astype(np.int64)
            self.page_size = batch.kv_cache.page_size
            self.table = table
            self.slots = batch.slot_mapping
        else:
            pos = batch.positions.cpu().numpy()
            if counts.size and np.any(pos[cu[:-1]] != 0):
                raise RLAlignError("Gated-DeltaNet layers: a packed batch must hold whole sequences (positions from 0)")
            starts, ends = np.zeros_like(counts), counts
        self.starts, self.ends, self.cu = starts, ends, cu
        first = starts // c
        self.first_chunk = first
        num_chunks = (ends - 1) // c - first + 1
        jmax, bsz = int(num_chunks.max()), len(counts)
        # absolute positions of every (j, b, row) of the scan, and where each comes from
        positions = (first[None, :, None] + np.arange(jmax)[:, None, None]) * c + np.arange(c)[None, None, :]
        valid = positions < ends[None, :, None]
        self.valid = torch.from_numpy(valid)
        self.chunk_rows = torch.from_numpy(np.where(valid, self._source(positions), -1))
        # the K conv taps of each new token: positions p-K+1 .. p (tap t = p - (K-1) + t)
        new_pos = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]) if bsz else np.zeros(0, np.int64)
        seq_of = np.repeat(np.arange(bsz), counts)
        tap_pos = new_pos[:, None] - (kernel - 1) + np.arange(kernel)[None, :]
        self.tap_rows = torch.from_numpy(np.where(tap_pos >= 0, self._source(tap_pos, seq_of[:, None]), -1))
        # each new token's output in the flattened [J, B, C] scan
        j_of = new_pos // c - first[seq_of]
        self.out_rows = torch.from_numpy((j_of * bsz + seq_of) * c + new_pos % c)
        self.num_chunks, self.jmax, self.bsz = num_chunks, jmax, bsz
        # rows of the (single) open chunk every sequence computed before: a decode step's Gamma and U come from there
        self.known_rows = int((starts - first * c).min()) if self.paged and jmax == 1 and bsz else 0

    def _source(self, positions: np.ndarray, seq: np.ndarray | None = None) -> np.ndarray:
        """Source row of absolute ``positions`` of sequence ``seq`` (default: broadcast over dim -2 = b)."""
        if seq is None:
            seq = np.arange(positions.shape[1])[None, :, None] + np.zeros_like(positions)
        p = np.maximum(positions, 0)
        if not self.paged:
            return np.where(positions < self.ends[seq], self.cu[seq] + p, -1)
        ps = self.page_size
        col = np.minimum(p // ps, self.table.shape[1] - 1)
        return self.table[seq, col] * ps + p % ps

    def initial_states(self, store, shape: LinearShape, like: torch.Tensor) -> torch.Tensor:
        """[B, Hv, Dk, Dv] fp32: each sequence's state at its first chunk's start (zeros at position 0)."""
        zeros = like.new_zeros((self.bsz, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim))
        if store is None or not np.any(self.first_chunk > 0):
            return zeros
        end = self.first_chunk * spec.GDN_CHUNK - 1            # the last token of the chunk before
        page, sub = self._state_slot(np.arange(self.bsz), end)
        saved = store.states[torch.from_numpy(page), torch.from_numpy(sub)]
        return torch.where(torch.from_numpy(self.first_chunk > 0).view(-1, 1, 1, 1).to(zeros.device), saved, zeros)

    def _state_slot(self, seq: np.ndarray, end: np.ndarray):
        ps = self.page_size
        e = np.maximum(end, 0)
        return self.table[seq, e // ps], (e % ps) // spec.GDN_CHUNK

    def store_states(self, store, states: torch.Tensor) -> None:
        """Write the state after every chunk the batch closed (all C rows present) to its end's page."""
        c = spec.GDN_CHUNK
        j, b = np.nonzero(self.valid[:, :, -1].numpy())
        if j.size == 0:
            return
        end = (self.first_chunk[b] + j) * c + c - 1
        if states.shape[2:] != store.states.shape[2:]:
            raise RLAlignError("Gated-DeltaNet cache: state shape mismatch")
        page, sub = self._state_slot(b, end)
        store.states[torch.from_numpy(page), torch.from_numpy(sub)] = states[torch.from_numpy(j), torch.from_numpy(b)]


__all__ = ["GatedDeltaNet"]
