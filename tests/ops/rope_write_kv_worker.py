"""Worker of tests/ops/test_rope_write_kv.py, run in a subprocess (the interpreter must be switched on, or the
stand-in sm_90 driver installed, before triton is imported).

``--interpret N`` (TRITON_INTERPRET=1, fp32): ``ops.rope_write_kv`` routed to the Triton launcher (CPU tensors
normally take the torch backend; this process only) against the separate path it replaces -- rope_kernel (the
Triton backend's rope launcher) for q and k, then ``write_kv_cache`` of the rotated k: rotated q and k and both
caches bit-equal (NaN-filled caches: every slot not written stays NaN), over hypothesis-chosen token counts,
head counts, head_dim, page sizes, shuffled slots and q/k/v laid out apart or as column views of one tensor; a
NaN / +inf / -inf planted in k gives write_kv_cache's error, message for message, under the per-op policy (naming the first bad index and the layer), the boundary
policy and a graph capture (the recorded verdict); one planted in q or v is not this op's check (no error,
the same bits).

``--sm90``: compile rope_write_kv_kernel (and rope_kernel, for comparison) for sm_90a at the Qwen3-0.6B
decode shape, bf16 and fp32; prints ptxas's report per kernel."""

from __future__ import annotations

WHERE = ("none", "k", "q", "v")
VALUES = (float("nan"), float("inf"), float("-inf"))
POLICIES = ("per-op", "boundary", "capture")


def _inputs(t, hq, hkv, d, page_size, extra_pages, seed, int32_slots, stacked=False):
    """``stacked``: q, k, v are column views of one [T, (Hq + 2 Hkv) D + 3] tensor (the stacked projection's
    output the paged forward passes; 3 spare columns make the token stride odd)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    if stacked:
        out = torch.randn(t, (hq + 2 * hkv) * d + 3, generator=g)
        cuts = (0, hq * d, (hq + hkv) * d, (hq + 2 * hkv) * d)
        q, k, v = (out[:, a:z].view(t, (z - a) // d, d) for a, z in zip(cuts, cuts[1:]))
    else:
        q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    angles = torch.rand(t, d // 2, generator=g).double() * 50
    cos, sin = angles.cos().float(), angles.sin().float()
    pages = -(-t // page_size) + extra_pages
    slots = torch.randperm(pages * page_size, generator=g)[:t].to(torch.int32 if int32_slots else torch.int64)
    cache = torch.full((pages, page_size, hkv, d), float("nan"))
    return q, k, v, cos, sin, cache, slots


def _outcome(fn):
    from rlalign.contract import ContractError
    try:
        return "ok", fn()
    except ContractError as exc:
        return "error", str(exc)


def _separate(q, k, v, cos, sin, cache, slots, policy, norm):
    """The path rope_write_kv replaces: (with ``norm`` = (q weight, k weight, eps): ops.rms_norm of q and k, on the
    Triton launcher) rope_kernel for q and k, then write_kv_cache (strict, torch backend)."""
    from rlalign import ops
    from rlalign.ops.triton_backend import elementwise as E
    kc, vc = cache.clone(), cache.clone()
    rotated = []

    def run():
        qn, kn = (ops.rms_norm(q, norm[0], norm[2]), ops.rms_norm(k, norm[1], norm[2])) if norm else (q, k)
        rotated.extend(E._rope_launch(x.contiguous(), cos, sin, 1.0) for x in (qn, kn))
        return ops.write_kv_cache(rotated[1], v, kc, vc, slots)
    outcome = _under(policy, run)
    return outcome, (*(rotated or (None, None)), kc, vc)


def _fused(q, k, v, cos, sin, cache, slots, policy, norm):
    from rlalign import ops
    kc, vc = cache.clone(), cache.clone()
    outcome = _under(policy, lambda: ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots, qk_norm=norm))
    return outcome, kc, vc


def _under(policy, fn):
    """(outcome, verdicts recorded by a capture as (op, message, ok))."""
    from rlalign import ops
    from rlalign.ops import _checks as chk
    with ops.check_scope("layers.3"):
        if policy == "capture":
            with chk.use_check_policy(chk.BOUNDARY), chk.capturing_graph() as verdicts:
                out = _outcome(fn)
            return out, [(op, message, bool(ok)) for op, message, ok in verdicts]
        with chk.use_check_policy(policy):
            return _outcome(fn), []


def check_case(t, hq, hkv, d, page_size, extra_pages, seed, int32_slots, where, value, at, policy, norm=False,
               stacked=False) -> None:
    """``norm``: with the fused q/k norm (against ops.rms_norm before the rope): its input checks (the
    separate path's outcome, whatever the policy makes of a bad q or k) and its bits. ``stacked``: q, k, v are
    column views of one tensor (read in place by the fused kernel; the separate path copies them)."""
    import torch
    from rlalign.contract.bits import bits_equal
    q, k, v, cos, sin, cache, slots = _inputs(t, hq, hkv, d, page_size, extra_pages, seed, int32_slots, stacked)
    weights = None
    if norm:
        g = torch.Generator().manual_seed(seed + 1)
        weights = (torch.randn(d, generator=g), torch.randn(d, generator=g), 1e-6)
    if where != "none":
        target = {"q": q, "k": k, "v": v}[where]
        if target.numel():
            target[torch.unravel_index(torch.tensor(at % target.numel()), target.shape)] = value
    case = f"T={t} Hq={hq} Hkv={hkv} D={d} page={page_size} slots int32={int32_slots} {where}={value} " \
           f"at {at} policy={policy} q/k norm={norm} stacked={stacked}"
    (want, want_verdicts), (qr, kr, kc_ref, vc_ref) = _separate(q, k, v, cos, sin, cache, slots, policy, weights)
    (got, got_verdicts), kc, vc = _fused(q, k, v, cos, sin, cache, slots, policy, weights)
    expect_error = where == "k" and policy != "capture"
    if not norm and (want[0] == "error") != expect_error:
        raise AssertionError(f"{case}: the separate path gave {want}, not what the defect implies")
    if got[0] != want[0] or (got[0] == "error" and got[1] != want[1]):
        raise AssertionError(f"{case}: rope_write_kv gave {got}, the separate path {want}")
    if got_verdicts != want_verdicts:
        raise AssertionError(f"{case}: captured verdicts {got_verdicts} != the separate path's {want_verdicts}")
    if policy == "capture" and [ok for _, _, ok in want_verdicts] != [where != "k"]:
        raise AssertionError(f"{case}: the capture's verdict {want_verdicts} does not match the defect")
    if got[0] == "error":
        return   # the caches: written by the fused kernel before a deferred verdict is read (documented)
    qo, ko = got[1]
    for name, a, b in (("q", qo, qr), ("k", ko, kr), ("k_cache", kc, kc_ref), ("v_cache", vc, vc_ref)):
        if not bits_equal(a, b):
            raise AssertionError(f"{case}: {name} differs from the separate path")


def _route_to_triton() -> None:
    """CPU tensors take the torch backend; in this process, send ops.rope_write_kv to the Triton launcher."""
    from rlalign.ops import _dispatch
    from rlalign.ops._registry import IMPLEMENTATIONS
    from rlalign.ops.triton_backend import elementwise as E
    IMPLEMENTATIONS[("rope_write_kv", "torch")] = E.rope_write_kv
    IMPLEMENTATIONS[("rms_norm", "torch")] = E.rms_norm   # the separate path's norm: the kernel the fused one inlines
    _dispatch._resolve_impl.cache_clear()


def run_interpret(max_examples: int) -> dict:
    from hypothesis import HealthCheck, given, settings, strategies as st
    _route_to_triton()

    @st.composite
    def cases(draw):
        hkv = draw(st.integers(1, 4))
        return (draw(st.integers(1, 40)), hkv * draw(st.sampled_from([1, 2, 4])), hkv,
                draw(st.sampled_from([2, 6, 8, 64, 128])), draw(st.sampled_from([1, 3, 16])),
                draw(st.integers(0, 3)), draw(st.integers(0, 2 ** 16)), draw(st.booleans()),
                draw(st.sampled_from(WHERE)), draw(st.sampled_from(VALUES)), draw(st.integers(0, 10 ** 6)),
                draw(st.sampled_from(POLICIES)), draw(st.booleans()), draw(st.booleans()))

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def fused_matches_the_separate_path(case):
        check_case(*case)

    fused_matches_the_separate_path()
    from rlalign.ops.triton_backend import elementwise as E
    for d in range(2, 1025, 2):   # the fused q/k norm runs rms_norm's own tile (same rows, columns, warps)
        bhalf, rows = E._rope_rows_per_program(d // 2)
        assert E._rms_launch_shape(d) == (2 * bhalf, rows, 4), (d, E._rms_launch_shape(d), bhalf, rows)
    n = 1
    for where in WHERE:   # every defect place and policy at least once, on several programs (T x Hkv > 32 rows)
        for value in VALUES:
            for policy in POLICIES:
                for norm in (False, True):
                    for stacked in (False, True):
                        check_case(37, 8, 2, 128, 16, 1, 11, False, where, value, 12345, policy, norm, stacked)
                        n += 1
    return {"fixed_cases": n}


def run_sm90() -> dict:
    import torch
    from tests.sm90 import activate_fake_sm90, compile_only_launches, ptxas_report
    activate_fake_sm90()
    compiled = compile_only_launches()
    from rlalign.ops.triton_backend import elementwise as E
    report = []
    for dtype in (torch.bfloat16, torch.float32):   # Qwen3-0.6B decode: 462 rows, 16 q heads, 8 kv heads, D 128
        q, k = torch.empty(462, 16, 128, dtype=dtype), torch.empty(462, 8, 128, dtype=dtype)
        cos = torch.empty(462, 64)
        cache = torch.empty(64, 16, 8, 128, dtype=dtype)
        slots = torch.zeros(462, dtype=torch.int64)
        # a compile-only launch leaves the flags unwritten: the check is not run here
        E.rope_write_kv(q, k, k, cos, cos, cache, cache, slots, lambda kr, ok: None)
        E._rope_launch(q, cos, cos, 1.0)
        w = torch.empty(128, dtype=dtype)   # the fused q/k norm, and the rms_norm kernel it matches
        E.rope_write_kv(q, k, k, cos, cos, cache, cache, slots, lambda kr, ok: None, qk_norm=(w, w, 1e-6))
        E.rms_forward(q.view(-1, 128), w, 1e-6)
        for name, _, kwargs, kernel in compiled[-4:]:
            ptx = kernel.asm["ptx"]
            report.append({"kernel": name + ("+norm" if kwargs.get("NORM") else ""), "dtype": str(dtype),
                           "ptxas": ptxas_report(ptx),
                           "fma": ptx.count("fma.rn.f32"), "mul": ptx.count("mul.f32") + ptx.count("mul.rn.f32"),
                           "smem": kernel.metadata.shared})
    return {"kernels": report, "norm_sums": _norm_sum_widths(compiled)}


def _norm_sum_widths(compiled) -> list[dict]:
    """The float reductions of rms_fwd_kernel and of rope_write_kv_kernel's fused q/k norm, compiled at head dims
    whose row offsets Triton can (128) and cannot (16, 48: a column view of a stacked q/k/v output with an odd token
    stride) prove 16-byte aligned, and at hidden sizes of rows: their widths (tests.sm90.float_reduction_widths)."""
    import torch
    from tests.sm90 import float_reduction_widths
    from rlalign.ops.triton_backend import elementwise as E
    start = len(compiled)
    for dtype in (torch.bfloat16, torch.float32):
        for d in (16, 48, 128):
            t, hq, hkv = 99, 4, 2
            out = torch.empty(t, (hq + 2 * hkv) * d + 3, dtype=dtype)
            q, k, v = out[:, :hq * d].view(t, hq, d), out[:, hq * d:(hq + hkv) * d].view(t, hkv, d), out[:, -hkv * d:]
            w, cos = torch.empty(d, dtype=dtype), torch.empty(t, d // 2)
            cache = torch.empty(t, 1, hkv, d, dtype=dtype)
            E.rope_write_kv(q, k, v.view(t, hkv, d), cos, cos, cache, cache, torch.zeros(t, dtype=torch.int64),
                            lambda kr, ok: None, qk_norm=(w, w, 1e-6))
            E.rms_forward(q.reshape(-1, d).contiguous(), w, 1e-6)
        for h in (1000, 4096):
            x = torch.empty(8, h, dtype=dtype)
            E.rms_forward(x, x[0], 1e-6)
            E.rms_backward(x, x[0], x, torch.empty(8))
    return [{"kernel": name + ("+norm" if kwargs.get("NORM") else ""), "args": {k: str(v) for k, v in kwargs.items()
             if k.isupper()}, "widths": float_reduction_widths(kernel.asm["ttgir"])}
            for name, _, kwargs, kernel in compiled[start:]]


if __name__ == "__main__":
    from tests.workers import worker_main
    worker_main(run_sm90, lambda args: run_interpret(int(args[0]) if args else 40))
