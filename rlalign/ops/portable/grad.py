"""The portable profile's backward: autograd Functions whose forward is the portable op and whose backward uses
only the profile's operations (elementwise IEEE ops one per kernel, :func:`rlalign.reductions.tree_sum` trees,
the shared exp), so a gradient has the same bits on the CPU and on a CUDA GPU.

Exact formulas (fp32 math; outputs rounded once to the input's dtype). Every reduction over tokens (a weight's
gradient) is one tree over the call's token axis in token order; every other sum is a tree over its own axis:

    linear      dX = matmul_nt(dY, W^T)   (tree over N)      dW = matmul_nt(dY^T, X^T)  (tree over tokens)
                db = tree over tokens of dY
    linear_group the same per weight; dX = ((dX_1 + dX_2) + dX_3) ... in the weights' order (one node, so autograd
                never chooses the order of the input's gradient contributions)
    rms_norm    r = 1 / sqrt(tree(x^2) / H + eps) (the forward's bits), gw = g * w, c = ((r * r) * r) * tree(gw * x) / H
                dx = gw * r - x * c         dw = tree over tokens of g * (x * r)
    rope        dx1 = g1 c + g2 s,   dx2 = g2 c - g1 s
    silu_mul    sig = 1 / (1 + exp(-g)),  d_up = dy * silu(g),  d_gate = (dy * up) * (sig * (1 + g * (1 - sig)))
    attention   per sequence: p = e / l (the forward's scores, exp and tree), dp_u = tree_d(dO v_u),
                D = tree_d(dO o), ds = (p * (dp - D)) * scale; dq = tree_u(ds k_u), dk_u = tree_(group head, query)
                (ds q), dv_u = tree_(group head, query)(p dO)
    log-prob /  p = exp(z - lse), q = g_lp + g_ent * (z - mu) (mu = tree(e z) / s), dz = [target] g_lp - p q,
    entropy     dlogits = dz / T; dh = matmul_nt(dlogits, W^T) (tree over V), dW = matmul_nt(dlogits^T, h^T)
    embedding   dW[v] = tree, in token order, of the rows of dY whose id is v (stable sort by id, a zero-padded
                [count, ids, H] layout, the tree over the leading axis); rows of ids never seen are zero

No ``index_add_`` / ``scatter_add_`` (atomic on CUDA: the order of the adds changes run to run), no GEMM, no
library reduction. A weight's gradient depends on how the step's tokens are cut into calls (micro-batches), as in
strict, but not on the device.
"""

from __future__ import annotations

import torch

from rlalign.ops.portable import arith, attention, dense, logprob
from rlalign.reductions import tree_sum


def _tokens_tree(x: torch.Tensor) -> torch.Tensor:
    """Tree over the leading (token) axis of x [T, ...] (T >= 1 or a zero result)."""
    if x.shape[0] == 0:
        return x.new_zeros(x.shape[1:])
    return arith.tree_sum_leading(x)


def _linear_grads(ctx_needs, x2d, w, has_bias, g):
    gx = gw = gb = None
    if ctx_needs[0]:
        gx = arith.matmul_nt(g, w.float().t().contiguous())
    if ctx_needs[1]:
        gw = arith.matmul_nt(g.t().contiguous(), x2d.float().t().contiguous())
    if has_bias and ctx_needs[2]:
        gb = _tokens_tree(g)
    return gx, gw, gb


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return dense.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).float()
        gx, gw, gb = _linear_grads(ctx.needs_input_grad, x.reshape(-1, x.shape[-1]), w, ctx.has_bias, g)
        return (None if gx is None else gx.reshape(x.shape).to(x.dtype), None if gw is None else gw.to(w.dtype),
                None if gb is None else gb.to(w.dtype))


def linear(x, weight, bias, k_segments=None):
    """ops.linear in the portable profile, differentiable (``k_segments`` changes nothing)."""
    return _Linear.apply(x, weight, bias)


class _LinearGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, *params):
        weights, biases = params[:n], params[n:]
        ctx.save_for_backward(x, *weights)
        ctx.n, ctx.has_bias = n, [b is not None for b in biases]
        return tuple(dense.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        n, x2d = ctx.n, x.reshape(-1, x.shape[-1])
        need_x = ctx.needs_input_grad[0]
        gx, gws, gbs = None, [], []
        for i, (w, grad) in enumerate(zip(weights, grads)):
            needs = (need_x, ctx.needs_input_grad[2 + i], ctx.needs_input_grad[2 + n + i])
            if grad is None:
                gws.append(None), gbs.append(None)
                continue
            g = grad.reshape(-1, grad.shape[-1]).float()
            dx, dw, db = _linear_grads(needs, x2d, w, ctx.has_bias[i], g)
            if dx is not None:
                gx = dx if gx is None else gx + dx        # the weights' order, one add at a time
            gws.append(None if dw is None else dw.to(w.dtype))
            gbs.append(None if db is None else db.to(w.dtype))
        gx = None if gx is None else gx.reshape(x.shape).to(x.dtype)
        return (gx, None, *gws, *gbs)


def linear_group(x, weights, biases, views: bool = False):
    """ops.linear_group in the portable profile, differentiable (one Function: see the module doc)."""
    return _LinearGroup.apply(x, len(weights), *weights, *biases)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return dense.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        hidden = x.shape[-1]
        xf = x.float().reshape(-1, hidden)
        g = grad.float().reshape(-1, hidden)
        ms = arith.div(tree_sum(xf * xf), float(hidden))
        r = arith.div(torch.ones_like(ms), arith.sqrt(ms + float(ctx.eps))).unsqueeze(-1)      # [T, 1]
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gwt = g * w.float()
            c = arith.div(((r * r) * r) * tree_sum(gwt * xf).unsqueeze(-1), float(hidden))
            gx = (gwt * r - xf * c).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = _tokens_tree(g * (xf * r)).to(w.dtype)
        return gx, gw, None


def rms_norm(x, weight, eps, residual=None):
    """ops.rms_norm in the portable profile, differentiable (the residual add is the caller's, as in strict's
    training path: ops.rms_norm adds it before the call when gradients are needed)."""
    if residual is not None:
        h = x + residual
        return _RmsNorm.apply(h, weight, eps), h
    return _RmsNorm.apply(x, weight, eps)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return dense.rope(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        g = grad.float()
        g1, g2 = g[..., :half], g[..., half:]
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat([g1 * c + g2 * s, g2 * c - g1 * s], dim=-1).to(grad.dtype), None, None


def rope(x, cos, sin):
    """ops.rope in the portable profile, differentiable in x (the tables are constants)."""
    return _Rope.apply(x, cos, sin)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return dense.silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        gf, uf, dy = gate.float(), up.float(), grad.float()
        sig = arith.div(torch.ones_like(gf), arith.exp(-gf) + 1.0)
        d_up = (dy * arith.silu(gf)).to(up.dtype)
        d_gate = (dy * uf) * (sig * ((gf * ((-sig) + 1.0)) + 1.0))
        return d_gate.to(gate.dtype), d_up


def silu_mul(gate, up):
    """ops.silu_mul in the portable profile, differentiable."""
    return _SiluMul.apply(gate, up)


def _sequence_attention_grads(q, k, v, o, do, scale: float):
    """(dq, dk, dv) fp32 of one sequence: q, o, do [L, Hq, D], k, v [L, Hkv, D] (fp32); see the module doc. Query
    rows, then keys, in chunks of at most attention.CHUNK_ELEMS products (memory only: every value's operations
    are its own, so no bit depends on the chunks)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qg, dog, og = (t.view(n, hkv, group, d) for t in (q, do, o))
    kt, vt = k.permute(1, 0, 2).unsqueeze(1), v.permute(1, 0, 2).unsqueeze(1)          # [Hkv, 1, L, D]
    kd = k.permute(1, 2, 0).unsqueeze(1)                                               # [Hkv, 1, D, L]
    step = max(1, attention.CHUNK_ELEMS.get(q.device.type, attention.DEFAULT_CHUNK_ELEMS) // max(1, hq * n * d))
    keys = torch.arange(n, device=q.device)
    p = torch.empty((n, hkv, group, n), dtype=torch.float32, device=q.device)
    ds = torch.empty_like(p)
    dq = torch.empty((n, hkv, group, d), dtype=torch.float32, device=q.device)
    for r in range(0, n, step):
        rows = slice(r, r + step)
        seen = (keys.unsqueeze(0) <= keys[rows].unsqueeze(1))[:, None, None, :]     # [m, 1, 1, L(key)]
        s = arith.dot(qg[rows].unsqueeze(3), kt) * float(scale)                        # [m, Hkv, G, L]
        s = torch.where(seen, s, float("-inf"))
        e = torch.where(seen, arith.exp(s - (s.amax(-1, keepdim=True) + 0.0)), 0.0)
        p[rows] = arith.div(e, tree_sum(e).unsqueeze(-1))
        dp = arith.dot(dog[rows].unsqueeze(3), vt)                                     # [m, Hkv, G, L]
        big_d = arith.dot(dog[rows], og[rows]).unsqueeze(-1)                           # [m, Hkv, G, 1]
        ds[rows] = torch.where(seen, (p[rows] * (dp - big_d)) * float(scale), 0.0)
        dq[rows] = arith.dot(ds[rows].unsqueeze(3), kd)                                # [m, Hkv, G, D]
    # dk, dv: one tree per key over (group head, query), in that order
    per_key = (lambda t: t.permute(3, 1, 2, 0).reshape(n, hkv, 1, group * n))        # [L(key), Hkv, 1, G * L(query)]
    q_rows = qg.permute(1, 3, 2, 0).reshape(1, hkv, d, group * n)                     # [1, Hkv, D, G * L(query)]
    do_rows = dog.permute(1, 3, 2, 0).reshape(1, hkv, d, group * n)
    ds_keys, p_keys = per_key(ds), per_key(p)
    dk = torch.empty((n, hkv, d), dtype=torch.float32, device=q.device)
    dv = torch.empty_like(dk)
    for u in range(0, n, step):
        cols = slice(u, u + step)
        dk[cols] = arith.dot(ds_keys[cols], q_rows)
        dv[cols] = arith.dot(p_keys[cols], do_rows)
    return dq.reshape(n, hq, d), dk, dv


class _AttentionVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        out = attention.attention_varlen(q, k, v, cu_seqlens, scale)
        ctx.save_for_backward(q, k, v, out, cu_seqlens)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, cu_seqlens = ctx.saved_tensors
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        cu = cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            if b > a:
                dq[a:b], dk[a:b], dv[a:b] = _sequence_attention_grads(
                    q[a:b].float(), k[a:b].float(), v[a:b].float(), out[a:b].float(), grad[a:b].float(), ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def attention_varlen(q, k, v, cu_seqlens, scale: float, window=None, sinks=None):
    """ops.attention_varlen in the portable profile, differentiable (memory per sequence: [L, Hq, L, D] products
    in the backward, an audit mode's cost)."""
    attention._refuse_window_sinks("attention_varlen", window, sinks)
    return _AttentionVarlen.apply(q, k, v, cu_seqlens, scale)


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy):
        lp, ent = logprob.logprob_entropy(hidden, weight, targets, temperature, with_entropy=with_entropy)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        ctx.set_materialize_grads(False)
        return (lp, ent) if with_entropy else lp

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, targets = ctx.saved_tensors
        return (*_head_grads(hidden, weight, targets, ctx.temperature, grads[0], grads[1] if ctx.with_entropy else None,
                             ctx.needs_input_grad[0], ctx.needs_input_grad[1]), None, None, None)


def _head_grads(hidden, weight, targets, temperature, g_lp, g_ent, need_dh: bool, need_dw: bool):
    """(dh, dW) of the head (the module doc's formulas). The logit gradient is built in token chunks for dh and in
    vocab chunks (every token) for dW, each chunk's logits recomputed -- at once when [tokens, vocab] fits
    logprob.CHUNK_ELEMS. Memory only: every entry's operations are its own, so no bit depends on the chunks."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    lse, mu = _row_stats(hidden, weight, temperature, g_ent is not None)
    g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().unsqueeze(-1)
    g_ent = None if g_ent is None else g_ent.float().unsqueeze(-1)
    targets = targets.long().unsqueeze(1)
    wt, ht = weight.float().t().contiguous(), hidden.float().t().contiguous()
    budget = logprob.CHUNK_ELEMS.get(hidden.device.type, logprob.DEFAULT_CHUNK_ELEMS)
    dh = dw = None
    if tokens * vocab <= budget:
        dz = _dlogits(logprob.scaled_logits(hidden, weight, temperature), lse, mu, targets, 0, g_lp, g_ent,
                      temperature)
        dh = arith.matmul_nt(dz, wt) if need_dh else None
        dw = arith.matmul_nt(dz.t().contiguous(), ht) if need_dw else None
    else:
        if need_dh:
            dh = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
            step = max(1, budget // vocab)
            for r in range(0, tokens, step):
                rows = slice(r, r + step)
                z = logprob.scaled_logits(hidden[rows], weight, temperature)
                dh[rows] = arith.matmul_nt(_dlogits(z, lse[rows], None if mu is None else mu[rows], targets[rows], 0,
                                                    g_lp[rows], None if g_ent is None else g_ent[rows], temperature),
                                           wt)
        if need_dw:
            dw = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
            step = max(1, budget // max(1, tokens))
            for c in range(0, vocab, step):
                cols = slice(c, c + step)
                z = logprob.scaled_logits(hidden, weight[cols], temperature)
                dz = _dlogits(z, lse, mu, targets, c, g_lp, g_ent, temperature)
                dw[cols] = arith.matmul_nt(dz.t().contiguous(), ht)
    return (None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype))


def _row_stats(hidden, weight, temperature, with_mean: bool):
    """Per token (in token chunks, as the forward): lse = m + log(tree_sum(e)) [T, 1] and, ``with_mean``,
    mu = tree_sum(e z) / tree_sum(e) [T, 1] (the entropy's mean logit), e = exp(z - m)."""
    tokens = hidden.shape[0]
    lse = torch.empty((tokens, 1), dtype=torch.float32, device=hidden.device)
    mu = torch.empty_like(lse) if with_mean else None
    budget = logprob.CHUNK_ELEMS.get(hidden.device.type, logprob.DEFAULT_CHUNK_ELEMS)
    step = max(1, budget // max(1, weight.shape[0]))
    for r in range(0, tokens, step):
        z = logprob.scaled_logits(hidden[r:r + step], weight, temperature)
        m = z.amax(-1, keepdim=True) + 0.0
        e = arith.exp(z - m)
        s = tree_sum(e).unsqueeze(-1)
        lse[r:r + step] = m + arith.log(s)
        if with_mean:
            mu[r:r + step] = arith.div(tree_sum(e * z).unsqueeze(-1), s)
    return lse, mu


def _dlogits(z, lse, mu, targets, v0: int, g_lp, g_ent, temperature) -> torch.Tensor:
    """dL/dlogits fp32 of logits z [S, Vc] (vocab columns v0 ..): p = exp(z - lse), q = g_lp (+ g_ent (z - mu)),
    dz = [target] g_lp - p q, divided by the temperature."""
    p = arith.exp(z - lse)
    q = g_lp if g_ent is None else g_lp + g_ent * (z - mu)
    pq = p * q
    is_target = torch.arange(v0, v0 + z.shape[1], device=z.device).unsqueeze(0) == targets
    dz = torch.where(is_target, g_lp - pq, -pq)
    return dz if float(temperature) == 1.0 else arith.div(dz, float(temperature))


def logprob_entropy(hidden, weight, targets, temperature, token_chunk=None, vocab_chunk=None, with_entropy=True):
    """ops.logprob_entropy in the portable profile, differentiable (chunk sizes change nothing; dW's tree runs over
    the call's tokens)."""
    out = _LogprobEntropy.apply(hidden, weight, targets, float(temperature), bool(with_entropy))
    return out if with_entropy else (out, None)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.shape = weight.shape
        return weight[ids]

    @staticmethod
    def backward(ctx, grad):
        (ids, ) = ctx.saved_tensors
        return None, embedding_grad(ids.reshape(-1), grad.reshape(-1, grad.shape[-1]), ctx.shape)


def embedding_grad(ids: torch.Tensor, grad: torch.Tensor, shape) -> torch.Tensor:
    """dW [V, H] of ``weight[ids]``: per id, the tree in token order of its rows of ``grad`` (module doc)."""
    out = torch.zeros(shape, dtype=torch.float32, device=grad.device)
    if ids.numel() == 0:
        return out.to(grad.dtype)
    order = torch.sort(ids, stable=True).indices                   # ties keep token order
    sorted_ids = ids[order]
    unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.repeat_interleave(torch.arange(unique.numel(), device=ids.device), counts)
    rank = torch.arange(ids.numel(), device=ids.device) - starts[slot]
    padded = torch.zeros((int(counts.max()), unique.numel(), grad.shape[-1]), dtype=torch.float32,
                         device=grad.device)
    padded[rank, slot] = grad[order].float()                       # one row per (rank, id): no two writes meet
    out[unique] = arith.tree_sum_leading(padded)
    return out.to(grad.dtype)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The row gather of ops.embedding, with the portable backward when ``weight`` needs a gradient."""
    return _Embedding.apply(ids, weight)





class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = arith.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y, ) = ctx.saved_tensors
        return grad * y


def exp(x: torch.Tensor) -> torch.Tensor:
    """arith.exp of fp32 ``x``, differentiable (d exp(x) = exp(x) dx: one multiply by the forward's result)."""
    return _Exp.apply(x)


__all__ = ["linear", "linear_group", "rms_norm", "rope", "silu_mul", "attention_varlen", "logprob_entropy",
           "embedding", "embedding_grad", "exp"]
