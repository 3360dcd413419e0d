"""Gated-DeltaNet ops (Qwen3-Next's linear-attention layers), strict on the CPU and on CUDA, in fixed-order fp32
formulas.

Everything is written with elementwise IEEE ops, ``exp`` / ``log`` / ``sqrt`` (position invariant,
spec.cpu_backend_assumptions) and :func:`rlalign.reductions.tree_sum` over a dimension whose length is fixed by the
contract -- never a library reduction or GEMM -- so a row's bits depend on its own inputs only, not on the batch, its
position in it or how many rows follow it. Differentiable torch ops throughout: autograd gives the backward.

* :func:`short_conv` -- the causal depthwise conv1d of a token from its K taps (the token and the K-1 before it),
  a tree sum over the K products, then SiLU.
* :func:`delta_inputs` -- per token: q, k l2-normalised (q also scaled by Dk^-1/2), g = -exp(A_log) *
  softplus(a + dt_bias), beta = sigmoid(b).
* :func:`delta_chunks` -- the gated delta rule over chunks of ``C = spec.GDN_CHUNK`` rows aligned to absolute
  positions 0, C, 2C, ...; the state exists only at chunk boundaries (formula in its docstring).
* :func:`gated_rms_norm` -- RMSNorm(o) * w * silu(z), rounded once.

sigmoid(x) is written 1 / (1 + exp(-x)) (torch.sigmoid's scalar tail differs from its vector body), softplus(x)
as log(1 + exp(x)) (x for x > 20, torch's threshold). Only the strict profile runs these; the native and portable
profiles and devices other than the CPU and CUDA are refused in one line (no vendor kernel is wired for them).

On CUDA the per-token ops above are the same torch formulas (elementwise IEEE ops and tree sums: a value's bits do
not depend on where it sits in the tensor on the GPU either; no cuBLAS, no library reduction in the forward), and
:func:`delta_chunks` runs the Triton backend's chunk kernel (``triton_backend.gated_delta``: one program per
(sequence, value head) walking its chunks in order) -- its bits are not the CPU formula's, but the same for a row
however its sequence was cut; its backward is the backend's Triton kernel too (deterministic run to run).
"""

from __future__ import annotations

import torch

from rlalign.contract import spec
from rlalign.contract.errors import fail
from rlalign.contract.profiles import Profile, as_profile
from rlalign.ops import _checks as chk
from rlalign.ops._dispatch import strict_impl
from rlalign.reductions import tree_sum

DEVICES = ("cpu", "cuda")


def _check(op: str, profile, *tensors: torch.Tensor) -> None:
    if as_profile(profile) is Profile.NATIVE:
        raise fail(op, "the native profile has no Gated-DeltaNet route; use the strict profile")
    if as_profile(profile) is Profile.PORTABLE:
        raise fail(op, "Gated-DeltaNet layers are not implemented in the portable profile (docs/portable.md)")
    for t in tensors:
        if t.device.type not in DEVICES:
            raise fail(op, f"Gated-DeltaNet layers run on the CPU or CUDA (got a tensor on {t.device})")
    chk.same_device(op, *tensors)
    chk.dtype_ok(op, *tensors)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)): the strict sigmoid, position invariant (torch.sigmoid is not on the CPU); the one owner,
    also DeepSeek-V3's router scores and the shared-expert gate (rlalign.ops.moe)."""
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    big = x > 20.0
    return torch.where(big, x, torch.log(1.0 + torch.exp(torch.where(big, 0.0, x))))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (tree sum), fp32."""
    return x / torch.sqrt(tree_sum(x * x) + eps).unsqueeze(-1)


def short_conv(taps: torch.Tensor, weight: torch.Tensor, *, profile=None) -> torch.Tensor:
    """silu(sum_t weight[:, t] * taps[:, t, :]) in fp32: taps [T, K, D] (tap t = the input K-1-t tokens back; zeros
    before the sequence's start), weight [D, K] (the conv1d's weight squeezed). -> fp32 [T, D]."""
    _check("short_conv", profile, taps, weight)
    if taps.dim() != 3 or weight.shape != (taps.shape[2], taps.shape[1]):
        raise fail("short_conv", f"taps must be [T, K, D] and weight [D, K], got {tuple(taps.shape)} and "
                                 f"{tuple(weight.shape)}")
    prods = taps.float() * weight.float().t().unsqueeze(0)            # [T, K, D]
    return silu(tree_sum(prods.transpose(1, 2)))


def delta_inputs(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                 dt_bias: torch.Tensor, *, profile=None):
    """(q_hat, k_hat, g, beta) fp32 per token: q_hat = l2norm(q) * Dk^-1/2, k_hat = l2norm(k) ([T, Hk, Dk]);
    g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) ([T, Hv])."""
    _check("delta_inputs", profile, a, b, a_log, dt_bias)
    scale = q.shape[-1] ** -0.5
    q_hat = l2_normalize(q.float()) * scale
    k_hat = l2_normalize(k.float())
    g = -torch.exp(a_log.float()) * softplus(a.float() + dt_bias.float())
    return q_hat, k_hat, g, sigmoid(b.float())


def _cumulative(g: torch.Tensor, first: int, rows: int, known: torch.Tensor | None) -> torch.Tensor:
    """Gamma_i = Gamma_{i-1} + g_i along dim -1, left to right (row i depends on g_0..g_i only): rows < ``first``
    from ``known`` (the same additions made before), rows first..rows-1 added here, later rows repeat the last."""
    out = list(known[..., :first].unbind(-1)) if first else []
    for i in range(first, rows):
        out.append(g[..., 0] if i == 0 else out[-1] + g[..., i])
    out += [out[-1]] * (g.shape[-1] - rows)
    return torch.stack(out, dim=-1)


def _dot_pairs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[..., C, C]: element (i, j) = tree_sum(x_i * y_j) over the last dim."""
    return tree_sum(x.unsqueeze(-2) * y.unsqueeze(-3))


def _solve_unit_lower(a: torch.Tensor, rhs: torch.Tensor, first: int, rows: int,
                      known: torch.Tensor | None) -> torch.Tensor:
    """U with U_i = rhs_i - sum_{j<i} a_ij U_j (forward substitution of (I + strict-lower a) U = rhs). ``a`` holds
    the rows first..rows-1 only ([..., rows - first, C]); U's rows < ``first`` come from ``known`` (this very
    substitution, made before), rows >= ``rows`` are zero. The sum over j < i is a tree of exactly i terms, so row i
    does not depend on later rows."""
    done = list(known[..., :first, :].unbind(-2)) if first else []
    for i in range(first, rows):
        if i == 0:
            done.append(rhs[..., 0, :])
            continue
        terms = a[..., i - first, :i].unsqueeze(-1) * torch.stack(done, dim=-2)    # [..., i, D]
        done.append(rhs[..., i, :] - tree_sum(terms.transpose(-1, -2)))
    done += [rhs.new_zeros(rhs.shape[:-2] + rhs.shape[-1:])] * (rhs.shape[-2] - rows)
    return torch.stack(done, dim=-2)


def _contract_state(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """[..., C, Dv]: row i = sum_k x_i[k] state[k, :] (tree over Dk). x [B, H, C, Dk], state [B, H, Dk, Dv]."""
    return tree_sum((x.unsqueeze(-1) * state.unsqueeze(-3)).transpose(-1, -2))


def delta_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 valid: torch.Tensor, state: torch.Tensor, *, known=None, profile=None):
    """The gated delta rule over J consecutive absolute chunks (arguments and results: :func:`chunk_formula`).

    CPU: :func:`chunk_formula`. CUDA: the Triton chunk kernel (module docstring), the same results except that it
    recomputes a decode step's earlier rows from their stored inputs instead of reading ``known`` (the same bits:
    a row's bits depend only on the rows before it), returns states, gamma and u only when ``known`` is given (the
    engine stores them) or gradients are recorded (states only: the backward reads them), None otherwise, and leaves
    ``states`` of a chunk that is not full at the state before it (the formula's is meaningless there; neither is
    ever read)."""
    _check("delta_chunks", profile, q, k, v, g, beta, state)
    if q.device.type == "cpu":
        return chunk_formula(q, k, v, g, beta, valid, state, known=known)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, state)):
        out, states = _KernelRule.apply(q, k, v, g, beta, valid, state)
        return out, states, None, None
    engine = known is not None   # the engine's paged path stores the states, Gamma and U; a packed forward needs none
    out, states, gamma, u = strict_impl("delta_chunks", q.device, profile)(
        q, k, v, g, beta, valid, state, store_states=engine, store_u=engine)
    if known is not None and known[0]:   # the op's contract: rows < first are the caller's, left zero here
        out[..., :min(known[0], q.shape[-2]), :] = 0.0
    return out, states, gamma, u


class _KernelRule(torch.autograd.Function):
    """The CUDA rule with its Triton backward (``triton_backend.gated_delta``: per (sequence, head) the chunks in
    reverse, each chunk's forward recomputed from the state the forward saved at its start, the gradients of its
    products written out; deterministic run to run)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, valid, state):
        out, states, _, _ = strict_impl("delta_chunks", q.device)(q, k, v, g, beta, valid, state, store_states=True,
                                                                  store_u=False)
        ctx.save_for_backward(q, k, v, g, beta, valid, state, states)
        return out, states

    @staticmethod
    def backward(ctx, d_out, d_states):
        q, k, v, g, beta, valid, state, states = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dstate = strict_impl("delta_chunks_backward", q.device)(
            q, k, v, g, beta, valid, state, states, d_out, d_states)
        return dq, dk, dv, dg, dbeta, None, dstate


def chunk_formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  valid: torch.Tensor, state: torch.Tensor, *, known=None):
    """The gated delta rule over J consecutive absolute chunks of B sequences, from their states at the first chunk's
    start. q, k [J, B, H, C, Dk] (q_hat, k_hat), v [J, B, H, C, Dv], g, beta [J, B, H, C], valid [J, B, C] (a prefix
    of each chunk's rows; padded rows hold zeros), state [B, H, Dk, Dv] fp32. ``known``: None, or (first, gamma,
    u) with rows < ``first`` of every chunk already computed (a decode step's earlier rows of its open chunk: their
    Gamma [J, B, H, C] and U [J, B, H, C, Dv + Dk] as this op returned them); rows < first of ``out`` are then zero.
    -> (out [J, B, H, C, Dv], states [J, B, H, Dk, Dv]: the state after chunk j, meaningful where it is full,
    gamma, u: every row's Gamma and U, to be handed back as ``known``).

    Per chunk (rows i, j of the chunk; Gamma_i = g_0 + ... + g_i left to right; S the state at its start)::

        A_ij   = beta_i (k_i . k_j) exp(Gamma_i - Gamma_j)        j < i
        U      = (I + A)^-1 [beta v | beta exp(Gamma) k]          forward substitution, row by row
        v'_i   = U^v_i - U^k_i . S                                 (the delta rule's corrected values)
        o_i    = (q_i exp(Gamma_i)) . S + sum_{j<=i} (q_i . k_j) exp(Gamma_i - Gamma_j) v'_j
        S'     = exp(Gamma_C-1) S + sum_j (k_j exp(Gamma_C-1 - Gamma_j)) (x) v'_j      (a full chunk only)

    Every dot product is a tree over Dk; the sum over j <= i a tree over the chunk's C rows with the terms j > i set
    to +0 by a select (not a product), so row i's bits depend only on rows <= i of its chunk and on S: packed
    training, any chunking of a prefill and one-token decode give the same bits (Gamma and U of a row are the same
    bits whether computed here or handed back as ``known``). This is transformers' ``torch_chunk_gated_delta_rule``
    with its chunk boundaries at absolute positions (the math is the same)."""
    c = q.shape[-2]
    if c != spec.GDN_CHUNK or valid.shape[-1] != c:
        raise fail("delta_chunks", f"chunks must have spec.GDN_CHUNK={spec.GDN_CHUNK} rows, got {c}")
    rows = max(int(valid.sum(-1).max()) if valid.numel() else 0, 1)
    first, known_gamma, known_u = known if known is not None else (0, None, None)
    first = min(first, rows - 1)
    gamma = _cumulative(g.float(), first, rows, known_gamma)           # [J, B, H, C]
    new = slice(first, rows)                                           # the rows computed here
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()[new]
    strict_lower = causal.tril(first - 1)                             # j < i = first + row
    diff = gamma[..., new].unsqueeze(-1) - gamma.unsqueeze(-2)         # [.., i, j] = Gamma_i - Gamma_j
    decay = torch.where(causal, torch.exp(torch.where(causal, diff, 0.0)), 0.0)
    a = torch.where(strict_lower, beta[..., new].unsqueeze(-1) * _dot_pairs(k[..., new, :], k) * decay, 0.0)
    intra = torch.where(causal, _dot_pairs(q[..., new, :], k) * decay, 0.0)
    eg = torch.exp(gamma).unsqueeze(-1)
    rhs = torch.cat([beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * eg * k], dim=-1)
    u = _solve_unit_lower(a, rhs, first, rows, known_u)
    dv = v.shape[-1]
    u_v, u_k = u[..., :dv], u[..., dv:]
    q_decayed = (q * eg)[..., new, :]
    k_to_end = k * torch.exp(gamma[..., -1:] - gamma).unsqueeze(-1)    # k_j exp(Gamma_C-1 - Gamma_j)
    chunk_decay = torch.exp(gamma[..., -1]).unsqueeze(-1).unsqueeze(-1)
    outs, states = [], []
    for j in range(q.shape[0]):
        v_new = u_v[j] - _contract_state(u_k[j], state)               # [B, H, C, Dv]
        terms = torch.where(causal.unsqueeze(-1), intra[j].unsqueeze(-1) * v_new.unsqueeze(-3), 0.0)
        outs.append(_contract_state(q_decayed[j], state) + tree_sum(terms.transpose(-1, -2)))
        if rows == c:   # only a full chunk's state is ever read
            update = k_to_end[j].unsqueeze(-1) * v_new.unsqueeze(-2)   # [B, H, C, Dk, Dv]
            state = chunk_decay[j] * state + tree_sum(update.permute(0, 1, 3, 4, 2))
        states.append(state)
    out = torch.stack(outs)
    pad = (first, c - rows)
    if pad != (0, 0):
        out = torch.cat([out.new_zeros(out.shape[:-2] + (first, dv)), out,
                         out.new_zeros(out.shape[:-2] + (c - rows, dv))], dim=-2)
    return out, torch.stack(states), gamma, u


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype, *,
                   profile=None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight * silu(z) over the last dim, fp32, rounded once to ``out_dtype``
    (Qwen3-Next's ``RMSNormGated``; the weight is NOT zero-centred)."""
    _check("gated_rms_norm", profile, z, weight)
    xf = x.float()
    inv = 1.0 / torch.sqrt(tree_sum(xf * xf) / x.shape[-1] + eps)
    return (xf * inv.unsqueeze(-1) * weight.float() * silu(z.float())).to(out_dtype)


def gate_sigmoid(x: torch.Tensor, gate: torch.Tensor, *, profile=None) -> torch.Tensor:
    """x * sigmoid(gate) in fp32, rounded once to x's dtype (Qwen3-Next's gated attention output)."""
    _check("gate_sigmoid", profile, x, gate)
    return (x.float() * sigmoid(gate.float())).to(x.dtype)


__all__ = ["short_conv", "delta_inputs", "delta_chunks", "gated_rms_norm", "gate_sigmoid", "l2_normalize"]
