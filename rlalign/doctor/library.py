"""Library assumptions the torch backend relies on (``spec.cpu_backend_assumptions``): fixed-shape GEMMs are
row / column / item invariant, exp / log / sqrt are position invariant, all of it deterministic run to run; and
the compiled CPU kernels (a speed path) give the torch formulation's bits."""

from __future__ import annotations

import torch

from rlalign.contract import spec
from rlalign.contract.bits import bits_equal
from rlalign.doctor.base import Check, randn as _randn
from rlalign.ops.torch_backend import clib, elementwise, norm, primitives
from rlalign.ops.torch_backend.attention import compiled as compiled_attention, gemms as attention_gemms
from rlalign.ops.torch_backend.linear import linear_fp32

def gemm_row_position(device, gen):
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


def gemm_column_invariance(device, gen):
    """A column's bits do not depend on the call's N or the column's offset (a column-parallel rank computes N / tp
    columns). In the cross-machine mode on the CPU the strict linear's own GEMM is checked, the compiled kernel
    that defines every shape there (the library's tiles run no strict GEMM); elsewhere the library's ``mm``."""
    if device.type == "cpu" and primitives.kernel_defines():
        return _strict_linear_columns(gen)
    k = 256
    a = _randn(gen, spec.ROW_BLOCK, k, device=device)
    w = _randn(gen, spec.VOCAB_BLOCK, k, device=device)
    ref = torch.mm(a, w.t())
    for n, off in _COLUMN_CASES:
        big = _randn(gen, n, k, device=device)
        big[off:off + spec.VOCAB_BLOCK] = w
        if not bits_equal(torch.mm(a, big.t())[:, off:off + spec.VOCAB_BLOCK], ref):
            return False, f"columns differ when N={n}, offset {off}"
    return True


# (N, offset) of the column checks: wide and narrow calls, offsets and widths off the 16-column blocks
_COLUMN_CASES = ((2 * spec.VOCAB_BLOCK, 0), (3 * spec.VOCAB_BLOCK, spec.VOCAB_BLOCK), (spec.VOCAB_BLOCK + 37, 37))


def _strict_linear_columns(gen):
    """The strict CPU linear (forward with and without the canonical K partition, dX, weight gradient) and the LM
    head's vocab-block GEMM: the same columns at every N and offset, narrow slices (N = 15, 8, 1) included."""
    k, width = 256, spec.VOCAB_BLOCK
    a = torch.randn(spec.ROW_BLOCK + 3, k, generator=gen)
    w = torch.randn(width, k, generator=gen)
    g = torch.randn(a.shape[0], width, generator=gen)
    ref = {"forward": linear_fp32(a, w, None), "forward, 8 K segments": linear_fp32(a, w, spec.K_SEGMENTS),
           "LM head block": primitives.tile_mm(a, w), "weight gradient": primitives.weight_grad(g, a).t()}
    for n, off in _COLUMN_CASES + ((15, 3), (8, 0), (1, 0)):
        big, gb = torch.randn(n, k, generator=gen), torch.randn(a.shape[0], n, generator=gen)
        cols = slice(off, off + min(width, n - off))
        big[cols], gb[:, cols] = w[:cols.stop - cols.start], g[:, :cols.stop - cols.start]
        got = {"forward": linear_fp32(a, big, None), "forward, 8 K segments": linear_fp32(a, big, spec.K_SEGMENTS),
               "LM head block": primitives.tile_mm(a, big), "weight gradient": primitives.weight_grad(gb, a).t()}
        for name, out in got.items():
            if not bits_equal(out[:, cols], ref[name][:, :cols.stop - cols.start]):
                return False, f"strict linear ({name}): columns differ when N={n}, offset {off}"
    return True, "the strict linear's compiled kernel (the cross-machine mode's definition); the library's tiles run no strict GEMM"


def bmm_item_invariance(device, gen):
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


# head widths the attention tile check covers (the op takes even widths; MKL's narrow-N edge kernels sit below 16)
ATTENTION_WIDTHS = tuple(range(2, 17, 2)) + (24, 32, 48, 64, 80, 96, 128, 192, 256)


def attention_tile_rows(device, gen):
    """The attention formulation's per-item GEMMs, q.k ([16, D] x [D, 64], keys given transposed) and p.v
    ([16, 64] x [64, D]), give each row of a tile bits of its own (rows permuted, among other rows, zero-padded;
    an item alone or in a batch) at every width the backend keeps on the library (``gemms.items_hold``): checked
    again on fresh inputs. The widths whose library GEMM fails run the compiled row kernel (named); without
    the kernels those widths raise, and the check does not hold."""
    q, b, threads = spec.ATTN_Q_TILE, spec.ATTN_KV_BLOCK, torch.get_num_threads()
    routed = []
    for d in ATTENTION_WIDTHS:
        for name, shape in (("q.k", (q, d, b, True)), ("p.v", (q, b, d, False))):
            if not attention_gemms.items_hold(*shape, threads):
                routed.append(f"{name} D={d}")
            elif not attention_gemms.items_hold_on(*shape, gen):
                return False, f"{name} D={d}: a row's bits depend on its place in the tile (fresh inputs)"
    if routed and clib.library() is None:
        return False, ("not row invariant in the library and the compiled kernels are not built (strict raises "
                       "there): " + ", ".join(routed))
    return True, ("compiled row kernel: " + ", ".join(routed)) if routed else ""


def bmm_equals_mm(device, gen):
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


def elementwise_position(device, gen):
    x = _randn(gen, 4096, 32, device=device) * 8
    pos = torch.rand(4096, 32, generator=gen).to(device) * 100 + 1e-6
    for name, fn, arg in (("exp", torch.exp, -x.abs()), ("log", torch.log, pos), ("sqrt", torch.sqrt, pos)):
        body = fn(arg)
        tail = fn(arg[:, :17])            # on a 16-lane loop, element 16 of each row takes the tail path
        single = torch.stack([fn(arg[i, 16:17]) for i in range(64)])[:, 0]
        if not (bits_equal(body[:, :17], tail) and bits_equal(body[:64, 16], single)):
            return False, f"{name}: vector body, tail and single-element results differ"
    return True


def determinism(device, gen):
    a, w = _randn(gen, spec.ROW_BLOCK, 512, device=device), _randn(gen, 512, 512, device=device)
    return bits_equal(torch.mm(a, w.t()), torch.mm(a, w.t()))


def compiled_kernels(device, gen):
    """The compiled CPU kernels (a speed path) give the torch formulation's bits on fresh inputs."""
    if clib.library() is None:
        return True, "not built here (no C compiler, or RLALIGN_CPU_KERNELS=0): the torch formulation runs"
    threads = torch.get_num_threads()
    dims = [d for d in (16, 32, 64, 128) if compiled_attention.compiled_matches(d, threads)]
    for d in dims:
        lens = torch.randint(1, 200, (5,), generator=gen).tolist()
        n_new = [1 if i % 2 else int(torch.randint(1, n + 1, (1,), generator=gen)) for i, n in enumerate(lens)]
        if not compiled_attention.compiled_agrees(d, gen, lens, n_new):
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
            tile = primitives._tile_mm(a, wk) if p == 1 else primitives.tree_merge(primitives.tile_mm_segments(a, wk, p))
            pairs += ((f"linear rows ({k}x{n}, {p} segments)", primitives.compiled_gemm(a, wk, p), tile),)
    for name, got, want in pairs:
        if got is None or not bits_equal(got, want):
            return False, f"{name}: the kernel's bits differ from the formulation's"
    return True, f"attention on the kernels for head_dim {dims} (others: the formulation)"


CHECKS: tuple[Check, ...] = (
    Check("gemm (library)", f"row position in a fixed {spec.ROW_BLOCK}-row block", gemm_row_position, torch_backend_only=True),
    Check("gemm (library)", "column value independent of N and column offset", gemm_column_invariance, torch_backend_only=True),
    Check("bmm (library)", "item independent of batch count and index", bmm_item_invariance, torch_backend_only=True),
    Check("bmm (library)", f"item == mm of its {spec.ROW_BLOCK}-row block (shared or own weight)", bmm_equals_mm,
          devices=("cpu",), torch_backend_only=True),
    Check("bmm (library)", f"attention: a row's bits independent of its place in the {spec.ATTN_Q_TILE}-row tile",
          attention_tile_rows, devices=("cpu",), torch_backend_only=True),
    Check("exp/log/sqrt (library)", "vector body == tail == single element", elementwise_position,
          torch_backend_only=True),
    Check("CPU kernels (compiled)", "== the torch formulation, bit for bit", compiled_kernels, devices=("cpu",),
          torch_backend_only=True),
    Check("gemm (library)", "run to run", determinism, torch_backend_only=True),
)
