"""Strict fused LM head + token log-prob + entropy on the torch backend (CPU and CUDA).

Exact numerics, per token (all fp32; ``VB = spec.VOCAB_BLOCK`` = 1024, rows in ``spec.ROW_BLOCK`` = 64):

    logits = tile_mm(h_chunk.float(), W_block.float())        one token chunk x one vocab block (one GEMM
                                                              per block, whatever the vocab chunk)
    z      = logits / fp32(temperature)                       the temperature rule (ops/temperature.py):
                                                              IEEE fp32 division by a 0-dim tensor
                                                              on the same device; SKIPPED when
                                                              temperature == 1.0 (z is the logits)
    vocab blocks [k*VB, (k+1)*VB) at absolute offsets (the last one shorter when VB does not divide V):
        m_b = max_j z_j
        e_j = exp(z_j - m_b)
        s_b = tree_sum(e)            w_b = tree_sum(e * z)      (balanced pairwise tree, rlalign.reductions.tree_sum)
    blocks folded strictly left to right, the state starting as block 0's (m_0, s_0, w_0):
        m' = max(m, m_b);  a = exp(m - m');  c = exp(m_b - m')
        s  = s * a + s_b * c;   w = w * a + w_b * c;   m = m'
    lse      = m + log(s)
    logprob  = z[target] - lse
    entropy  = lse - w / s

Token chunks are multiples of 64 rows and vocab chunks multiples of VB entries starting at multiples
of VB, so every block is the same absolute slice of the vocab whatever the chunking; given the
doctor-checked assumptions (fixed-shape GEMM rows and columns are position/N invariant, exp/log are
position invariant), a token's outputs depend only on its own hidden row, W, target and temperature.

Backward (``_LogprobEntropy``, recomputes the logits chunk by chunk, never [T, V]):

    p        = exp(z - lse)                       mu = w / s  (E_p[z], saved by the forward)
    q        = g_lp + g_ent * (z - mu)            (g_ent term dropped when there is no entropy grad)
    dz       = where(j == target, g_lp - p * q, -(p * q))
             = g_lp * (onehot - p) + g_ent * (-p * (z - mu))
    dlogits  = dz / fp32(temperature)             (skipped when temperature == 1.0)
    dh[t]    = sum over vocab blocks in increasing order, from zero, of tile_mm(dlogits[t, block], W_block^T)
               -> a token's input gradient is invariant like its forward outputs
    dW[v]    = sum over token chunks in increasing order, from zero, of the fp32 GEMM dlogits[:, v]^T @ h_chunk
               -> deterministic run to run for a given T and token_chunk (it is a sum over tokens)
    No atomics, no scatter-add; results cast once to the input dtypes.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from rlalign.contract import spec
from rlalign.ops._registry import register
from rlalign.ops.temperature import divide_by_temperature, temperature_divisor
from rlalign.ops.torch_backend.primitives import tile_mm
from rlalign.reductions import tree_sum

VB = spec.VOCAB_BLOCK


# ---- forward pieces ----------------------------------------------------------------------------

def scaled_logits(h_chunk: torch.Tensor, w_chunk_f32: torch.Tensor, tau: torch.Tensor | None) -> torch.Tensor:
    """z of one chunk (whose first column is a multiple of VB); ``tau`` from :func:`temperature_divisor` (the
    temperature rule, ops/temperature.py). One GEMM per vocab block: the library's column bits can depend on
    a GEMM's width N when N is narrow (measured: K = 1000, V = 1025), so every column is computed in a GEMM
    as wide as its block (VB, or the vocab's short last block) whatever the chunk size."""
    h = h_chunk.float().contiguous()
    if w_chunk_f32.shape[0] <= VB:
        z = tile_mm(h, w_chunk_f32)
    else:
        z = torch.empty((h.shape[0], w_chunk_f32.shape[0]), dtype=torch.float32, device=h.device)
        for block in index_chunks(w_chunk_f32.shape[0], VB):
            z[:, block] = tile_mm(h, w_chunk_f32[block])
    return divide_by_temperature(z, tau, in_place=True)


def _stats_of_blocks(zb: torch.Tensor, with_entropy: bool):
    """zb [rows, blocks, L] -> (m_b, s_b, w_b or None), each [rows, blocks]."""
    m_b = zb.amax(dim=-1)
    e = torch.sub(zb, m_b.unsqueeze(-1)).exp_()
    s_b = tree_sum(e)   # a new tensor even for a one-entry block: e is reused in place below
    w_b = tree_sum(e.mul_(zb)) if with_entropy else None
    return m_b, s_b, w_b


def block_stats(z: torch.Tensor, with_entropy: bool):
    """Per-vocab-block statistics of a chunk z [rows, n] whose column 0 is a multiple of VB.

    Returns a list of (m_b, s_b, w_b) per block, in vocab order, each a [rows] tensor.
    """
    rows, n = z.shape
    full = n - n % VB
    groups = []
    if full:
        groups.append(_stats_of_blocks(z[:, :full].view(rows, full // VB, VB), with_entropy))
    if n % VB:
        groups.append(_stats_of_blocks(z[:, full:].unsqueeze(1), with_entropy))
    blocks = []
    for m_b, s_b, w_b in groups:
        for k in range(m_b.shape[1]):
            blocks.append((m_b[:, k], s_b[:, k], None if w_b is None else w_b[:, k]))
    return blocks


class FoldState:
    """Running (m, s, w) of the left-to-right block fold and z[target], for T tokens."""

    def __init__(self, tokens: int, device: torch.device, with_entropy: bool):
        self.m = torch.empty(tokens, dtype=torch.float32, device=device)
        self.s = torch.empty_like(self.m)
        self.w = torch.empty_like(self.m) if with_entropy else None
        self.z_target = torch.empty_like(self.m)

    def fold(self, rows: slice, first: bool, m_b, s_b, w_b) -> None:
        if first:
            self.m[rows], self.s[rows] = m_b, s_b
            if self.w is not None:
                self.w[rows] = w_b
            return
        m = self.m[rows]
        m_new = torch.maximum(m, m_b)
        a = torch.exp(m - m_new)
        c = torch.exp(m_b - m_new)
        self.s[rows] = self.s[rows] * a + s_b * c
        if self.w is not None:
            self.w[rows] = self.w[rows] * a + w_b * c
        self.m[rows] = m_new

    def take_targets(self, rows: slice, z: torch.Tensor, targets: torch.Tensor, v0: int) -> None:
        """Copy z[t, target - v0] for the tokens whose target falls in this vocab chunk (exact)."""
        width = z.shape[1]
        local = targets - v0
        inside = (local >= 0) & (local < width)
        picked = z.gather(1, local.clamp(0, width - 1).unsqueeze(1)).squeeze(1)
        self.z_target[rows] = torch.where(inside, picked, self.z_target[rows])

    def fold_chunk(self, rows: slice, z: torch.Tensor, targets: torch.Tensor, v0: int) -> None:
        self.take_targets(rows, z, targets, v0)
        for k, (m_b, s_b, w_b) in enumerate(block_stats(z, self.w is not None)):
            self.fold(rows, v0 == 0 and k == 0, m_b, s_b, w_b)

    def finish(self):
        """-> (logprob, entropy or None, lse, mu or None)."""
        lse = self.m + torch.log(self.s)
        logprob = self.z_target - lse
        if self.w is None:
            return logprob, None, lse, None
        mu = self.w / self.s
        return logprob, lse - mu, lse, mu


def index_chunks(total: int, size: int):
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))


def forward_stats(hidden, weight, targets, temperature, token_chunk, vocab_chunk, with_entropy):
    """Vocab chunks outer (each W chunk upcast once), token chunks inner; every token's blocks are
    still folded in vocab order. -> (logprob, entropy or None, lse, mu or None)."""
    tokens = hidden.shape[0]
    tau = temperature_divisor(temperature, hidden.device)
    state = FoldState(tokens, hidden.device, with_entropy)
    for cols in index_chunks(weight.shape[0], vocab_chunk):
        w_f32 = weight[cols].float()
        for rows in index_chunks(tokens, token_chunk):
            z = scaled_logits(hidden[rows], w_f32, tau)
            state.fold_chunk(rows, z, targets[rows], cols.start)
    return state.finish()


def logprob_from_logits(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True):
    """The same block fold applied to already materialised scaled logits z [S, V] fp32 (e.g. from
    :func:`lm_logits`): gives the bits logprob_entropy gives for those rows. -> (logprob, entropy|None)."""
    state = FoldState(z.shape[0], z.device, with_entropy)
    state.fold_chunk(slice(0, z.shape[0]), z, targets.long(), 0)
    logprob, entropy, _, _ = state.finish()
    return logprob, entropy


# ---- backward pieces ---------------------------------------------------------------------------

def grad_scaled_logits(z, local_targets, lse, mu, g_lp, g_ent, tau):
    """dL/dlogits for one chunk (see the module docstring)."""
    p = torch.exp(z - lse.unsqueeze(1))
    if g_ent is None:
        q = g_lp.unsqueeze(1).expand_as(z)
    else:
        q = g_lp.unsqueeze(1) + g_ent.unsqueeze(1) * (z - mu.unsqueeze(1))
    pq = p.mul_(q)
    cols = torch.arange(z.shape[1], device=z.device)
    is_target = cols.unsqueeze(0) == local_targets.unsqueeze(1)
    dz = torch.where(is_target, g_lp.unsqueeze(1) - pq, -pq)
    return divide_by_temperature(dz, tau, in_place=True)


def add_grad_hidden(dh_rows: torch.Tensor, dlogits: torch.Tensor, w_f32: torch.Tensor) -> None:
    """dh_rows += dlogits @ W_chunk, one vocab block at a time in vocab order (vocab_chunk invariant)."""
    for block in index_chunks(dlogits.shape[1], VB):
        dh_rows.add_(tile_mm(dlogits[:, block].contiguous(), w_f32[block].t()))


def add_grad_weight(dw_chunk: torch.Tensor, dlogits: torch.Tensor, h_f32: torch.Tensor, first: bool) -> None:
    """dw_chunk (=|+=) dlogits^T @ h, one vocab block per GEMM (a row's bits depend on its block's width only,
    never on vocab_chunk; token chunks still add in increasing order). The block's dlogits^T is copied to its own
    contiguous [width, T] matrix: sliced from the chunk it has the chunk's row stride, and MKL on AVX-512 takes a
    different path (other bits) for another stride of the same shape (measured 2026-12-03: the one-column tail
    block at vocab_chunk 1,024 vs 2,048); a fresh contiguous operand makes the call depend on the shape only."""
    for block in index_chunks(dlogits.shape[1], VB):
        part = torch.mm(dlogits[:, block].t().contiguous(), h_f32)
        if first:
            dw_chunk[block] = part
        else:
            dw_chunk[block].add_(part)


def backward_grads(saved, g_lp, g_ent, need_dh, need_dw):
    hidden, weight, targets, lse, mu, temperature, token_chunk, vocab_chunk = saved
    tokens, vocab = hidden.shape[0], weight.shape[0]
    tau = temperature_divisor(temperature, hidden.device)
    g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float()
    g_ent = None if g_ent is None else g_ent.float()
    dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_dh else None
    dw = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
    for cols in index_chunks(vocab, vocab_chunk):
        w_f32 = weight[cols].float()
        for rows in index_chunks(tokens, token_chunk):
            h_f32 = hidden[rows].float().contiguous()
            z = scaled_logits(h_f32, w_f32, tau)
            dlogits = grad_scaled_logits(z, targets[rows] - cols.start, lse[rows], None if mu is None else mu[rows],
                                          g_lp[rows], None if g_ent is None else g_ent[rows], tau)
            if need_dh:
                add_grad_hidden(dh[rows], dlogits, w_f32)
            if need_dw:
                add_grad_weight(dw[cols], dlogits, h_f32, first=rows.start == 0)
    return (None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype))


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, token_chunk, vocab_chunk, with_entropy):
        logprob, entropy, lse, mu = forward_stats(hidden, weight, targets, temperature, token_chunk,
                                                  vocab_chunk, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, lse, mu)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, its term is skipped
        ctx.config = (temperature, token_chunk, vocab_chunk)
        ctx.with_entropy = with_entropy
        return (logprob, entropy) if with_entropy else logprob

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        g_lp = grads[0]
        g_ent = grads[1] if ctx.with_entropy else None
        saved = tuple(ctx.saved_tensors) + ctx.config
        dh, dw = backward_grads(saved, g_lp, g_ent, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dh, dw, None, None, None, None, None


@register("logprob_entropy", "torch")
def logprob_entropy(hidden, weight, targets, temperature, token_chunk, vocab_chunk, with_entropy):
    """Validated inputs (see rlalign.ops.logprob); chunk sizes already multiples of 64 / VB."""
    out = _LogprobEntropy.apply(hidden, weight, targets.long(), float(temperature), int(token_chunk),
                                int(vocab_chunk), bool(with_entropy))
    return out if with_entropy else (out, None)


@register("lm_logits", "torch")
def lm_logits(hidden, weight, temperature, vocab_chunk):
    """fp32 [S, V] = the z of the module docstring, vocab chunk by vocab chunk (same GEMM shapes as
    logprob_entropy with the same vocab_chunk; no autograd: it feeds the sampler)."""
    tau = temperature_divisor(float(temperature), hidden.device)
    out = torch.empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        for cols in index_chunks(weight.shape[0], vocab_chunk):
            out[:, cols] = scaled_logits(hidden, weight[cols].float(), tau)
    return out


__all__ = ["logprob_entropy", "lm_logits", "logprob_from_logits", "forward_stats", "backward_grads", "add_grad_hidden",
           "add_grad_weight", "index_chunks"]
