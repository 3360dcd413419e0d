"""Each strict op's contract end to end through the public ops: batch size, row position, packing, prefill vs
decode, chunk sizes, the TP partition."""

from __future__ import annotations

import torch

from rlalign import ops
from rlalign.contract import spec
from rlalign.contract.bits import bits_equal
from rlalign.doctor.base import Check, randn as _randn
from rlalign.ops import gated_delta as gd
from rlalign.ops.torch_backend import linear as torch_linear, primitives

def op_linear_batch(device, gen):
    for dtype in (torch.float32, torch.bfloat16):
        w = _randn(gen, 256, 512, device=device, dtype=dtype)
        x = _randn(gen, 512, 512, device=device, dtype=dtype)
        full = ops.linear(x, w, profile="strict")
        for m in (1, 3, 5, 63, 64, 65, 200):
            if not bits_equal(ops.linear(x[:m], w, profile="strict"), full[:m]):
                return False, f"{dtype}: rows differ at M={m} vs M=512"
    return True


# narrow N (the PPO value head is N = 1; a one-column last vocab chunk) and odd K, with and without the
# canonical partition (K = 1000, 3000: segments of 125, 375 columns): the shapes where MKL's tile is not
# row invariant, so the CPU linear runs its compiled kernel for them (primitives.linear_route)
_NARROW_LINEAR = ((1, 128, None), (1, 4099, None), (2, 127, spec.K_SEGMENTS), (3, 1000, spec.K_SEGMENTS),
                  (3, 3000, spec.K_SEGMENTS), (5, 4099, None), (7, 17, None), (9, 1000, None), (16, 4099, None))


def op_linear_narrow(device, gen):
    routes = []
    for n, k, segments in _NARROW_LINEAR:
        for dtype in (torch.float32, torch.bfloat16):
            w = _randn(gen, n, k, device=device, dtype=dtype)
            x = _randn(gen, 200, k, device=device, dtype=dtype)
            full = ops.linear(x, w, k_segments=segments, profile="strict")
            for m in (1, 63, 64, 65, 129):
                if not bits_equal(ops.linear(x[:m], w, k_segments=segments, profile="strict"), full[:m]):
                    return False, f"N={n} K={k} k_segments={segments} {dtype}: rows differ at M={m} vs M=200"
            perm = torch.randperm(200, generator=gen).to(device)
            if not bits_equal(ops.linear(x[perm], w, k_segments=segments, profile="strict"), full[perm]):
                return False, f"N={n} K={k} k_segments={segments} {dtype}: rows permuted change bits"
        if device.type == "cpu":
            p = torch_linear.segment_count(k, segments) if segments else 1
            routes.append(f"{n}x{k}{'/' + str(p) if p > 1 else ''}: {primitives.linear_route(k, n, p)}")
    return True, ("routes (N x K/segments): " + ", ".join(routes)) if routes else ""


def op_linear_tp(device, gen):
    k = 1024
    w = _randn(gen, 64, k, device=device, dtype=torch.bfloat16)
    x = _randn(gen, 33, k, device=device, dtype=torch.bfloat16)
    full = ops.linear(x, w, k_segments=spec.K_SEGMENTS, profile="strict")
    for tp in (2, 4, 8):
        shard = k // tp
        parts = [ops.linear(x[:, r * shard:(r + 1) * shard].float(), w[:, r * shard:(r + 1) * shard].float(),
                            k_segments=spec.K_SEGMENTS // tp, profile="strict") for r in range(tp)]
        while len(parts) > 1:
            parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
        if not bits_equal(parts[0].to(torch.bfloat16), full):
            return False, f"TP={tp} differs from TP=1"
    return True


def op_rms_norm(device, gen):
    x = _randn(gen, 300, 1024, device=device, dtype=torch.bfloat16)
    w = _randn(gen, 1024, device=device, dtype=torch.bfloat16)
    full = ops.rms_norm(x, w, 1e-6, profile="strict")
    return all(bits_equal(ops.rms_norm(x[i:i + 1], w, 1e-6, profile="strict"), full[i:i + 1]) for i in (0, 17, 299))


def op_rope(device, gen):
    for dtype in (torch.float32, torch.bfloat16):
        x = _randn(gen, 300, 3, 64, device=device, dtype=dtype)
        positions = torch.randint(0, 4096, (300,), generator=gen).to(device)
        cos, sin = ops.rope_cos_sin(positions, ops.rope_inv_freq(64, 10000.0))
        full = ops.rope(x, cos, sin, profile="strict")
        for i in (0, 17, 299):
            if not bits_equal(ops.rope(x[i:i + 1], cos[i:i + 1], sin[i:i + 1], profile="strict"), full[i:i + 1]):
                return False, f"{dtype}: token {i} alone differs from the token in a batch of 300"
    return True


def op_rope_write_kv(device, gen):
    """The paged forward's rope + cache write (one kernel on CUDA) == rope + write_kv_cache, and with Qwen3's q/k
    norms == rms_norm, then rope + write_kv_cache, for a batch of 300 tokens and for a token alone, q/k/v given as
    column views of one projection output (as the paged forward passes them), head dims 16 and 64 (NaN-filled
    caches: the slots not written stay NaN)."""
    for dtype in (torch.float32, torch.bfloat16):
        for d in (16, 64):
            for norm in (False, True):
                problem = _rope_write_kv_case(device, gen, dtype, d, norm)
                if problem:
                    return False, f"{dtype}, head_dim {d}{', q/k norm' if norm else ''}: {problem}"
    return True


def _rope_write_kv_case(device, gen, dtype, d: int, norm: bool) -> str | None:
    stacked = _randn(gen, 300, 8 * d + 3, device=device, dtype=dtype)   # 3 spare columns: an odd token stride
    q, k, v = (stacked[:, a * d:z * d].view(300, z - a, d) for a, z in ((0, 4), (4, 6), (6, 8)))
    cos, sin = ops.rope_cos_sin(torch.randint(0, 4096, (300,), generator=gen).to(device),
                                ops.rope_inv_freq(d, 10000.0))
    slots = torch.randperm(320, generator=gen)[:300].to(device)
    cache = torch.full((20, 16, 2, d), float("nan"), device=device, dtype=dtype)
    qk_norm = (_randn(gen, d, device=device, dtype=dtype), _randn(gen, d, device=device, dtype=dtype), 1e-6)
    qn, kn = ((ops.rms_norm(q, qk_norm[0], 1e-6, profile="strict"), ops.rms_norm(k, qk_norm[1], 1e-6, profile="strict"))
              if norm else (q, k))
    want = [cache.clone(), cache.clone()]
    rq, rk = ops.rope(qn, cos, sin, profile="strict"), ops.rope(kn, cos, sin, profile="strict")
    ops.write_kv_cache(rk, v, *want, slots, profile="strict")
    got = [cache.clone(), cache.clone()]
    for rows in (slice(0, 300), slice(17, 18)):   # the batch, then token 17 alone (its slots rewritten)
        out = ops.rope_write_kv(q[rows], k[rows], v[rows], cos[rows], sin[rows], *got, slots[rows],
                                qk_norm=qk_norm if norm else None, profile="strict")
        if not (bits_equal(out[0], rq[rows]) and bits_equal(out[1], rk[rows])):
            return f"rotated q/k of tokens {rows.start}..{rows.stop - 1} differ from the separate ops'"
    if not all(bits_equal(a, b) for a, b in zip(got, want)):
        return "the caches differ from write_kv_cache's"
    return None


def op_silu_mul(device, gen):
    for dtype in (torch.float32, torch.bfloat16):
        gate = _randn(gen, 300, 129, device=device, dtype=dtype) * 4
        up = _randn(gen, 300, 129, device=device, dtype=dtype)
        full = ops.silu_mul(gate, up, profile="strict")
        for i in (0, 17, 299):
            if not bits_equal(ops.silu_mul(gate[i:i + 1], up[i:i + 1], profile="strict"), full[i:i + 1]):
                return False, f"{dtype}: row {i} alone differs from the row in a batch of 300"
        # odd offsets and lengths: the vector loops' tails
        if not bits_equal(ops.silu_mul(gate[5, 3:], up[5, 3:], profile="strict"), full[5, 3:]):
            return False, f"{dtype}: elements at an odd offset differ"
    return True


def op_embedding(device, gen):
    for dtype in (torch.float32, torch.bfloat16):
        w = _randn(gen, 1000, 96, device=device, dtype=dtype)
        ids = torch.randint(0, 1000, (300,), generator=gen).to(device)
        full = ops.embedding(ids, w, profile="strict")
        if not bits_equal(full, w[ids]):
            return False, f"{dtype}: rows are not exact copies of the weight rows"
        if not bits_equal(ops.embedding(ids[17:18], w, profile="strict"), full[17:18]):
            return False, f"{dtype}: a token alone differs from the token in a batch"
    return True


def op_attention_prefill_decode(device, gen):
    hq, hkv, d, page = 4, 2, 64, 16
    lens = [1, 70, 130]
    total = sum(lens)
    q = _randn(gen, total, hq, d, device=device, dtype=torch.bfloat16)
    k = _randn(gen, total, hkv, d, device=device, dtype=torch.bfloat16)
    v = _randn(gen, total, hkv, d, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    packed = ops.attention_varlen(q, k, v, cu, profile="strict")
    # decode the last sequence token by token against a paged cache with shuffled pages
    s0, n = cu[2].item(), lens[2]
    pages = -(-n // page)
    perm = torch.randperm(pages + 3, generator=gen)[:pages].to(device)
    kc = torch.zeros(pages + 3, page, hkv, d, device=device, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    table = perm.to(torch.int32).unsqueeze(0)
    for t in range(n):
        slot = (perm[t // page] * page + t % page).view(1).long()
        ops.write_kv_cache(k[s0 + t:s0 + t + 1], v[s0 + t:s0 + t + 1], kc, vc, slot)
        out = ops.attention_paged(q[s0 + t:s0 + t + 1], kc, vc, table,
                                  torch.tensor([t + 1], dtype=torch.int32, device=device),
                                  torch.tensor([0, 1], dtype=torch.int32, device=device), profile="strict")
        if not bits_equal(out[0], packed[s0 + t]):
            return False, f"token {t}: decode differs from packed forward"
    alone = ops.attention_varlen(q[s0:], k[s0:], v[s0:], cu[2:] - cu[2], profile="strict")
    if not bits_equal(alone, packed[s0:]):
        return False, "sequence alone differs from packed with others"
    return True


def op_logprob_chunks(device, gen):
    h = _randn(gen, 200, 128, device=device, dtype=torch.bfloat16)
    w = _randn(gen, 5000, 128, device=device, dtype=torch.bfloat16)
    tgt = torch.randint(0, 5000, (200,), generator=gen).to(device)
    ref_lp, ref_ent = ops.logprob_entropy(h, w, tgt, profile="strict")
    for tc, vc in ((64, 1024), (128, 4096), (256, 2048)):
        lp, ent = ops.logprob_entropy(h, w, tgt, token_chunk=tc, vocab_chunk=vc, profile="strict")
        if not (bits_equal(lp, ref_lp) and bits_equal(ent, ref_ent)):
            return False, f"chunks ({tc}, {vc}) change the result"
    lp1, _ = ops.logprob_entropy(h[7:8], w, tgt[7:8], profile="strict")
    if not bits_equal(lp1, ref_lp[7:8]):
        return False, "a token alone differs from the same token in a batch"
    # one-entry last vocab block (V % VOCAB_BLOCK == 1) and a one-column last default vocab chunk (8193)
    for v in (spec.VOCAB_BLOCK + 1, 8193):
        wv = _randn(gen, v, 128, device=device, dtype=torch.bfloat16)
        tv = torch.randint(0, v, (200,), generator=gen).to(device)
        lp, ent = ops.logprob_entropy(h, wv, tv, profile="strict")
        lp_only, _ = ops.logprob_entropy(h, wv, tv, with_entropy=False, profile="strict")
        if not (bits_equal(lp, lp_only) and bool(torch.isfinite(ent).all())):
            return False, f"V={v}: the logprob with entropy differs from the one without"
        if not bits_equal(ops.logprob_entropy(h[7:8], wv, tv[7:8], profile="strict")[1], ent[7:8]):
            return False, f"V={v}: a token's entropy alone differs from the same token in a batch"
        logits = ops.lm_logits(h[:70], wv, profile="strict")
        if not bits_equal(ops.lm_logits(h[69:70], wv, profile="strict"), logits[69:70]):
            return False, f"V={v}: an lm_logits row alone differs from the row in a batch"
    return True


def op_sample_batch(device, gen):
    logits = _randn(gen, 64, 3000, device=device) * 3
    n = logits.shape[0]
    kw = dict(seeds=torch.full((n,), 1234, device=device), seq_ids=torch.arange(n, device=device),
              positions=torch.arange(n, device=device) * 7, temperature=0.9, top_k=50, top_p=0.9)
    full = ops.sample(logits, profile="strict", **kw)
    for i in (0, 31, 63):
        one = ops.sample(logits[i:i + 1], profile="strict",
                         **{k: (v[i:i + 1] if torch.is_tensor(v) else v) for k, v in kw.items()})
        if not bits_equal(one, full[i:i + 1]):
            return False, f"row {i} alone samples a different token"
    return True


def op_sampled_logprob(device, gen):
    h = _randn(gen, 48, 128, device=device, dtype=torch.bfloat16)
    w = _randn(gen, 3000, 128, device=device, dtype=torch.bfloat16)
    n = h.shape[0]
    kw = dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01)
    tokens, lp = ops.sample_and_score(h, w, seeds=torch.full((n,), 99, device=device),
                                      positions=torch.arange(n, device=device), logprobs="sampled", profile="strict", **kw)
    trainer = ops.sampled_logprob(h, w, tokens, profile="strict", **kw).logprob
    if not bits_equal(lp, trainer) or not bool(torch.isfinite(lp).all()):
        return False, "the sampler's sampled log-probs differ from the trainer op's (or a token is outside its kept set)"
    if not bits_equal(ops.sampled_logprob(h, w, tokens, token_chunk=5, profile="strict", **kw).logprob, trainer):
        return False, "the token chunk size changes the result"
    if not bits_equal(ops.sampled_logprob(h[7:8], w, tokens[7:8], profile="strict", **kw).logprob, trainer[7:8]):
        return False, "a token alone differs from the same token in a batch"
    return True


def op_delta_chunks(device, gen):
    """Gated-DeltaNet's rule: a 70-token sequence packed with a 1-token one == alone == cut into a prefill of 61 tokens
    and 9 one-token decode steps across the chunk boundary (each from the state its chunk starts from)."""
    c, h, d = spec.GDN_CHUNK, 2, 16
    seqs = []
    for n in (70, 1):
        q = gd.l2_normalize(_randn(gen, n, h, d, device=device))
        k = gd.l2_normalize(_randn(gen, n, h, d, device=device))
        seqs.append([q * d ** -0.5, k, _randn(gen, n, h, d, device=device),
                     -0.5 * _randn(gen, n, h, device=device).abs(), _randn(gen, n, h, device=device).sigmoid()])

    def scan(items):
        """items [(inputs, start, end, state at chunk start // C)] -> (out rows [start, end) each, states)."""
        j = max((e - 1) // c - s // c + 1 for _, s, e, _ in items)
        parts = []
        for x in range(5):
            rows = []
            for inputs, s, e, _ in items:
                r = inputs[x][s // c * c:e]
                rows.append(torch.cat([r, r.new_zeros((j * c - r.shape[0],) + tuple(r.shape[1:]))]).view(
                    j, c, *r.shape[1:]).transpose(1, 2))
            parts.append(torch.stack(rows, dim=1))
        pos = torch.tensor([s // c * c for _, s, _, _ in items]).view(1, -1, 1) + torch.arange(j * c).view(j, 1, c)
        valid = pos < torch.tensor([e for _, _, e, _ in items]).view(1, -1, 1)
        state = torch.stack([st for *_, st in items])
        # known = no rows computed before: the engine's call, which returns the states after the chunks
        out, states, _, _ = gd.delta_chunks(*parts, valid, state, known=(0, None, None), profile="strict")
        rows = [out[:, b].transpose(1, 2).reshape(-1, h, d)[s - s // c * c:e - s // c * c]
                for b, (_, s, e, _) in enumerate(items)]
        return rows, states

    zero = torch.zeros(h, d, d, device=device)
    with torch.no_grad():
        (packed, single), _ = scan([(seqs[0], 0, 70, zero), (seqs[1], 0, 1, zero)])
        (alone,), states = scan([(seqs[0], 0, 70, zero)])
        if not (bits_equal(packed, alone) and bits_equal(single, scan([(seqs[1], 0, 1, zero)])[0][0])):
            return False, "a sequence packed with another differs from the sequence alone"
        pieces = [scan([(seqs[0], 0, 61, zero)])[0][0]]
        for t in range(61, 70):
            pieces.append(scan([(seqs[0], t, t + 1, zero if t < c else states[0, 0])])[0][0])
        if not bits_equal(torch.cat(pieces), alone):
            return False, "prefill + decode steps differ from the sequence in one call"
    return True


CHECKS: tuple[Check, ...] = (
    Check("linear", "batch size 1..512 (bf16, fp32)", op_linear_batch),
    Check("linear", "narrow N (1-9) and odd K, with/without K partition: batch size, row order (bf16, fp32)",
          op_linear_narrow),
    Check("linear", "canonical K partition: TP 1/2/4/8", op_linear_tp),
    Check("rms_norm", "row alone == row in batch", op_rms_norm),
    Check("rope", "token alone == token in batch (bf16, fp32)", op_rope),
    Check("rope_write_kv", "== (rms_norm +) rope + write_kv_cache, token alone == in batch, column views "
          "(bf16, fp32)", op_rope_write_kv),
    Check("silu_mul", "row alone == row in batch, odd offsets (bf16, fp32)", op_silu_mul),
    Check("embedding", "exact row copy, token alone == in batch", op_embedding),
    Check("attention", "packed == decode vs paged cache == sequence alone", op_attention_prefill_decode),
    Check("logprob/entropy", "token/vocab chunk sizes, batch; one-entry last block; lm_logits rows", op_logprob_chunks),
    Check("sample", "token independent of batch", op_sample_batch),
    Check("sampled_logprob", "engine == trainer (kept set and bits), token alone == in batch, token chunks",
          op_sampled_logprob),
    Check("delta_chunks", "Gated-DeltaNet: packed == alone == prefill + decode across a chunk boundary",
          op_delta_chunks),
)
