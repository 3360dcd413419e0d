"""``rlalign doctor``: check, on this machine, every invariance the strict profile relies on.

It sits above the ops it drives (it calls the public ops and the torch backend's compiled-kernel
checks) and below everything that reports on the machine (``environment``).

Two kinds of checks, each with fresh random inputs (a new seed every run):

* *library assumptions* -- exactly the properties listed in ``spec.cpu_backend_assumptions``
  (fixed-shape GEMMs are row/column/item invariant, exp/log/sqrt are position invariant, all of it
  deterministic run to run), on the shapes the torch backend issues, and that the compiled CPU
  kernels (a speed path) give the torch formulation's bits;
* *op invariances* -- each strict op's contract end to end (batch size, row position, packing,
  prefill vs decode, chunk sizes, TP partition), through the public ops.

Strict relies on the doctor being green on the machine that runs it.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from typing import Callable

import torch

from rlalign import ops
from rlalign.contract import spec
from rlalign.contract.bits import bits_equal
from rlalign.ops import backend_name
from rlalign.ops.torch_backend import attention as torch_attention, clib, elementwise, norm, primitives
from rlalign.ops.torch_backend import linear as torch_linear


@dataclasses.dataclass
class CheckResult:
    op: str
    invariance: str
    holds: bool
    seconds: float
    detail: str = ""


@dataclasses.dataclass
class Check:
    op: str
    invariance: str
    run: Callable[[torch.device, torch.Generator], "bool | tuple[bool, str]"]
    devices: tuple[str, ...] = ("cpu", "cuda")
    torch_backend_only: bool = False   # a library property only the torch backend relies on


def _randn(gen, *shape, device, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


# ---- library assumptions ----------------------------------------------------------------------

def _gemm_row_position(device, gen):
    for k, n in ((64, 64), (256, 768), (1024, 1024), (128, 1024)):
        w = _randn(gen, n, k, device=device)
        row = _randn(gen, 1, k, device=device)
        ref = None
        for pos in (0, 1, 7, spec.ROW_BLOCK // 2, spec.ROW_BLOCK - 1):
            blk = _randn(gen, spec.ROW_BLOCK, k, device=device) * 10
            blk[pos] = row[0]
            out = torch.mm(blk, w.t())[pos]
            if ref is None:
                ref = out
            elif not bits_equal(out, ref):
                return False, f"K={k} N={n}: row at block position {pos} differs"
    return True


def _gemm_column_invariance(device, gen):
    k = 256
    a = _randn(gen, spec.ROW_BLOCK, k, device=device)
    w = _randn(gen, spec.VOCAB_BLOCK, k, device=device)
    ref = torch.mm(a, w.t())
    for n, off in ((2 * spec.VOCAB_BLOCK, 0), (3 * spec.VOCAB_BLOCK, spec.VOCAB_BLOCK), (spec.VOCAB_BLOCK + 37, 37)):
        big = _randn(gen, n, k, device=device)
        big[off:off + spec.VOCAB_BLOCK] = w
        if not bits_equal(torch.mm(a, big.t())[:, off:off + spec.VOCAB_BLOCK], ref):
            return False, f"columns differ when N={n}, offset {off}"
    return True


def _bmm_item_invariance(device, gen):
    q, b = spec.ATTN_Q_TILE, spec.ATTN_KV_BLOCK
    for d in (32, 64, 128):
        for shape_a, shape_b in (((q, d), (d, b)), ((q, b), (b, d))):
            a1, b1 = _randn(gen, 1, *shape_a, device=device), _randn(gen, 1, *shape_b, device=device)
            ref = torch.bmm(a1, b1)[0]
            for count in (2, 9, 100):
                a, bb = _randn(gen, count, *shape_a, device=device), _randn(gen, count, *shape_b, device=device)
                i = count // 2
                a[i], bb[i] = a1[0], b1[0]
                if not bits_equal(torch.bmm(a, bb)[i], ref):
                    return False, f"D={d}: item differs at batch count {count}"
    return True


def _bmm_equals_mm(device, gen):
    """The row blocks of tile_mm (and of every K segment) are the items of one torch.bmm on the CPU:
    each item must have the bits of the plain torch.mm of its block, for a weight broadcast to every
    item (stride 0; given transposed as linear does, or as a plain [K, N] matrix as the logprob
    backward does) and for distinct per-item weights (the K-segment copies). Checked where the backend relies
    on it: a (K, N) whose library tile fails :func:`primitives.tiles_hold` on this machine runs the compiled
    row kernel instead (MKL's tile at K = N = 1,024 is one such on AVX-512 Xeons: there a block alone and an
    item of a batch differ, which the route avoids), so it is skipped and named."""
    b = spec.ROW_BLOCK
    skipped, checked = [], 0
    for k, n in ((16, 128), (48, 128), (128, 15), (64, 1024), (256, 768), (1024, 1024)):
        if device.type == "cpu" and not primitives.tiles_hold(k, n, torch.get_num_threads()):
            skipped.append(f"K={k} N={n}")
            continue
        checked += 1
        for count in (2, 5, 33):
            a = _randn(gen, count, b, k, device=device)
            w = _randn(gen, n, k, device=device)
            for wt in (w.t(), w.t().contiguous()):
                out = torch.bmm(a, wt.expand(count, k, n))
                for i in (0, count // 2, count - 1):
                    if not bits_equal(out[i], torch.mm(a[i], wt)):
                        return False, f"K={k} N={n}: item {i} of {count} (shared weight) differs from mm"
            ws = _randn(gen, count, n, k, device=device)
            out = torch.bmm(a, ws.transpose(1, 2))
            for i in (0, count - 1):
                if not bits_equal(out[i], torch.mm(a[i], ws[i].t())):
                    return False, f"K={k} N={n}: item {i} of {count} (own weight) differs from mm"
    if not checked:
        return False, "no shape left to check: every one runs the compiled kernel (tiles_hold refused all)"
    return True, ("not relied on (compiled kernel): " + ", ".join(skipped)) if skipped else ""


def _elementwise_position(device, gen):
    x = _randn(gen, 4096, 32, device=device) * 8
    pos = torch.rand(4096, 32, generator=gen).to(device) * 100 + 1e-6
    for name, fn, arg in (("exp", torch.exp, -x.abs()), ("log", torch.log, pos), ("sqrt", torch.sqrt, pos)):
        body = fn(arg)
        tail = fn(arg[:, :17])            # on a 16-lane loop, element 16 of each row takes the tail path
        single = torch.stack([fn(arg[i, 16:17]) for i in range(64)])[:, 0]
        if not (bits_equal(body[:, :17], tail) and bits_equal(body[:64, 16], single)):
            return False, f"{name}: vector body, tail and single-element results differ"
    return True


def _determinism(device, gen):
    a, w = _randn(gen, spec.ROW_BLOCK, 512, device=device), _randn(gen, 512, 512, device=device)
    return bits_equal(torch.mm(a, w.t()), torch.mm(a, w.t()))


def _compiled_kernels(device, gen):
    """The compiled CPU kernels (a speed path) give the torch formulation's bits on fresh inputs."""
    if clib.library() is None:
        return True, "not built here (no C compiler, or RLALIGN_CPU_KERNELS=0): the torch formulation runs"
    threads = torch.get_num_threads()
    dims = [d for d in (16, 32, 64, 128) if torch_attention.compiled_matches(d, threads)]
    for d in dims:
        lens = torch.randint(1, 200, (5,), generator=gen).tolist()
        n_new = [1 if i % 2 else int(torch.randint(1, n + 1, (1,), generator=gen)) for i, n in enumerate(lens)]
        if not torch_attention.compiled_agrees(d, gen, lens, n_new):
            return False, f"attention, head_dim {d}: the kernels' bits differ from the formulation's"
    x, w = _randn(gen, 300, 129, device=device) * 4, _randn(gen, 129, device=device)
    cos, sin = _randn(gen, 300, 32, device=device), _randn(gen, 300, 32, device=device)
    q, up = _randn(gen, 300, 3, 64, device=device), _randn(gen, 300, 129, device=device)
    parts = _randn(gen, 8, 300, 129, device=device)
    pairs = (("rms_norm", norm.compiled_rms_norm(x, w, 1e-6), norm.rms_norm_formula(x, w, 1e-6)),
             ("rope", elementwise.rope(q, cos, sin), elementwise.rope_formula(q, cos, sin)),
             ("silu_mul", elementwise.silu_mul(x, up), elementwise.silu_mul_formula(x, up)),
             ("tree_merge", primitives.tree_merge_compiled(parts), primitives.tree_merge(list(parts.unbind(0)))))
    for k, n, p in ((128, 384, 1), (384, 128, 8), (512, 96, 4)):
        if primitives.gemm_matches(k, n, p, threads):
            a, wk = _randn(gen, 70, k, device=device), _randn(gen, n, k, device=device)
            tile = primitives.tile_mm(a, wk) if p == 1 else primitives.tree_merge(primitives.tile_mm_segments(a, wk, p))
            pairs += ((f"linear rows ({k}x{n}, {p} segments)", primitives.compiled_gemm(a, wk, p), tile),)
    for name, got, want in pairs:
        if got is None or not bits_equal(got, want):
            return False, f"{name}: the kernel's bits differ from the formulation's"
    return True, f"attention on the kernels for head_dim {dims} (others: the formulation)"


# ---- op invariances ---------------------------------------------------------------------------

def _op_linear_batch(device, gen):
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


def _op_linear_narrow(device, gen):
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


def _op_linear_tp(device, gen):
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


def _op_rms_norm(device, gen):
    x = _randn(gen, 300, 1024, device=device, dtype=torch.bfloat16)
    w = _randn(gen, 1024, device=device, dtype=torch.bfloat16)
    full = ops.rms_norm(x, w, 1e-6, profile="strict")
    return all(bits_equal(ops.rms_norm(x[i:i + 1], w, 1e-6, profile="strict"), full[i:i + 1]) for i in (0, 17, 299))


def _op_rope(device, gen):
    for dtype in (torch.float32, torch.bfloat16):
        x = _randn(gen, 300, 3, 64, device=device, dtype=dtype)
        positions = torch.randint(0, 4096, (300,), generator=gen).to(device)
        cos, sin = ops.rope_cos_sin(positions, ops.rope_inv_freq(64, 10000.0))
        full = ops.rope(x, cos, sin, profile="strict")
        for i in (0, 17, 299):
            if not bits_equal(ops.rope(x[i:i + 1], cos[i:i + 1], sin[i:i + 1], profile="strict"), full[i:i + 1]):
                return False, f"{dtype}: token {i} alone differs from the token in a batch of 300"
    return True


def _op_rope_write_kv(device, gen):
    """The paged forward's rope + cache write (one kernel on CUDA) == rope + write_kv_cache, for a batch of 300
    tokens and for a token alone (NaN-filled caches: the slots not written stay NaN)."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (_randn(gen, 300, h, 64, device=device, dtype=dtype) for h in (4, 2, 2))
        cos, sin = ops.rope_cos_sin(torch.randint(0, 4096, (300,), generator=gen).to(device),
                                    ops.rope_inv_freq(64, 10000.0))
        slots = torch.randperm(320, generator=gen)[:300].to(device)
        cache = torch.full((20, 16, 2, 64), float("nan"), device=device, dtype=dtype)
        want = [cache.clone(), cache.clone()]
        rq, rk = ops.rope(q, cos, sin, profile="strict"), ops.rope(k, cos, sin, profile="strict")
        ops.write_kv_cache(rk, v, *want, slots, profile="strict")
        got = [cache.clone(), cache.clone()]
        for rows in (slice(0, 300), slice(17, 18)):   # the batch, then token 17 alone (its slots rewritten)
            out = ops.rope_write_kv(q[rows], k[rows], v[rows], cos[rows], sin[rows], *got, slots[rows],
                                    profile="strict")
            if not (bits_equal(out[0], rq[rows]) and bits_equal(out[1], rk[rows])):
                return False, f"{dtype}: rotated q/k of tokens {rows.start}..{rows.stop - 1} differ from rope's"
        if not all(bits_equal(a, b) for a, b in zip(got, want)):
            return False, f"{dtype}: the caches differ from write_kv_cache's"
    return True


def _op_silu_mul(device, gen):
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


def _op_embedding(device, gen):
    for dtype in (torch.float32, torch.bfloat16):
        w = _randn(gen, 1000, 96, device=device, dtype=dtype)
        ids = torch.randint(0, 1000, (300,), generator=gen).to(device)
        full = ops.embedding(ids, w, profile="strict")
        if not bits_equal(full, w[ids]):
            return False, f"{dtype}: rows are not exact copies of the weight rows"
        if not bits_equal(ops.embedding(ids[17:18], w, profile="strict"), full[17:18]):
            return False, f"{dtype}: a token alone differs from the token in a batch"
    return True


def _op_attention_prefill_decode(device, gen):
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


def _op_logprob_chunks(device, gen):
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


def _op_sample_batch(device, gen):
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


CHECKS: tuple[Check, ...] = (
    Check("gemm (library)", f"row position in a fixed {spec.ROW_BLOCK}-row block", _gemm_row_position, torch_backend_only=True),
    Check("gemm (library)", "column value independent of N and column offset", _gemm_column_invariance, torch_backend_only=True),
    Check("bmm (library)", "item independent of batch count and index", _bmm_item_invariance, torch_backend_only=True),
    Check("bmm (library)", f"item == mm of its {spec.ROW_BLOCK}-row block (shared or own weight)", _bmm_equals_mm,
          devices=("cpu",), torch_backend_only=True),
    Check("exp/log/sqrt (library)", "vector body == tail == single element", _elementwise_position,
          torch_backend_only=True),
    Check("CPU kernels (compiled)", "== the torch formulation, bit for bit", _compiled_kernels, devices=("cpu",),
          torch_backend_only=True),
    Check("gemm (library)", "run to run", _determinism, torch_backend_only=True),
    Check("linear", "batch size 1..512 (bf16, fp32)", _op_linear_batch),
    Check("linear", "narrow N (1-9) and odd K, with/without K partition: batch size, row order (bf16, fp32)",
          _op_linear_narrow),
    Check("linear", "canonical K partition: TP 1/2/4/8", _op_linear_tp),
    Check("rms_norm", "row alone == row in batch", _op_rms_norm),
    Check("rope", "token alone == token in batch (bf16, fp32)", _op_rope),
    Check("rope_write_kv", "== rope + write_kv_cache, token alone == in batch (bf16, fp32)", _op_rope_write_kv),
    Check("silu_mul", "row alone == row in batch, odd offsets (bf16, fp32)", _op_silu_mul),
    Check("embedding", "exact row copy, token alone == in batch", _op_embedding),
    Check("attention", "packed == decode vs paged cache == sequence alone", _op_attention_prefill_decode),
    Check("logprob/entropy", "token/vocab chunk sizes, batch; one-entry last block; lm_logits rows", _op_logprob_chunks),
    Check("sample", "token independent of batch", _op_sample_batch),
)


def run_checks(device: str = "cpu", seed: int | None = None, progress: Callable[[str], None] | None = None):
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    results = []
    for check in CHECKS:
        if dev.type not in check.devices:
            continue
        if check.torch_backend_only and backend_name(dev) != "torch":
            continue  # e.g. CUDA with the triton backend: cuBLAS properties are not relied on
        if progress:
            progress(f"{check.op}: {check.invariance}")
        t0 = time.perf_counter()
        try:
            out = check.run(dev, gen)
        except Exception as exc:  # a check that crashes does not hold; say why
            out = (False, f"{type(exc).__name__}: {exc}")
        holds, detail = out if isinstance(out, tuple) else (bool(out), "")
        results.append(CheckResult(check.op, check.invariance, holds, time.perf_counter() - t0, detail))
    return results, seed


def environment(device: str) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            "cpu": _cpu_name(), "cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()}
    try:
        import triton   # lazy: an optional GPU dependency, reported only when present
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
