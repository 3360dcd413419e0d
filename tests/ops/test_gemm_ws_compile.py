"""The Gluon K-partition GEMM (gemm_ws.py) compiled for Hopper (sm_90a) on the CPU, no GPU needed.

One subprocess (the fake sm_90 driver must be active before the backend imports) compiles EVERY launch in
gemm_ws.WS_CANDIDATES as the launcher builds it, for the linear forward (P = 8, W [N, K], bias, bf16 out: the
deepest tree) and for the trainer's dX layout (B [K, N], P = 8, fp32 out: the largest shared-memory footprint),
runs Triton's ptxas -v on the PTX and reports (8 compiles, ~25 s uncached). Checked here: no spills and no
wgmma serialization (ptxas), the shared memory the module documents (gemm_ws.shared_bytes + the mbarriers, within
227 KiB), and the structure the bit-exactness argument rests on:
two wgmma chains per segment (its start and its k-step loop), every wgmma with scale-d = 1 as in the default
kernel's PTX (a segment starts from a +0.0 tile, not from scale-d = 0), the wgmma pipeline drains
(wait_group 0) once per tile only, and the TMA loads are issued from one loop (two load sites: A and B).
Skips when this Triton cannot compile Gluon for sm_90a here (no ptxas, no Gluon).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys

import pytest

from tests.workers import collect, spawn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# (layout name, P, b_trans, output): every WS_CANDIDATES launch is compiled on both
LAYOUTS = (("forward", 8, True, "bf16"), ("dX layout fp32 out", 8, False, "fp32"))
# a k-step's window in the consumer's PTX: from its wgmma.wait_group 1 (the previous chain done) to the next k-step's
# wait for its operands; the stage release sits in it
KSTEP_WINDOW = re.compile(r"wgmma\.wait_group\.sync\.aligned 1;(.*?)mbarrier\.try_wait", re.S)
# out_alias: a level-1 write waits for the previous TMA store's read of the buffer, then a consumer-wide barrier, then
# the shared-memory stores
ALIAS_GUARD = re.compile(r"cp\.async\.bulk\.wait_group\.read\s+0;[^\n]*\n(?:(?!st\.shared)[^\n]*\n)*?\s*bar\.sync[^\n]*\n"
                         r"(?:(?!st\.shared)[^\n]*\n)*?\s*st\.shared")
RELEASE = re.compile(r"(?:cp\.async\.mbarrier\.arrive\.noinc\.shared\.b64|mbarrier\.arrive\.shared::cta\.b64 _,)")


def _worker() -> None:
    import torch  # noqa: F401
    from tests.sm90 import activate_fake_sm90, ptxas_report
    activate_fake_sm90(gluon_gemm=True)
    from rlalign.ops.triton_backend import gemm_ws as W
    if W.GLUON_IMPORT_ERROR is not None:
        print("RESULTS " + json.dumps({"skip": f"no Gluon: {W.GLUON_IMPORT_ERROR}"}))
        return
    compiled = []
    original = W.kpart_ws_kernel.run

    def compile_only(*args, grid, warmup, **kwargs):
        kernel = original(*args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel)
        return kernel

    W.kpart_ws_kernel.run = compile_only
    bf = torch.bfloat16
    results = []
    for (layout, segments, b_trans, out), (cand, cfg) in itertools.product(LAYOUTS, enumerate(W.WS_CANDIDATES)):
        name = f"{layout} P={segments} WS_CANDIDATES[{cand}] {cfg}"
        out_dtype = torch.bfloat16 if out == "bf16" else torch.float32
        x, w = torch.empty(4096, 4096, dtype=bf), torch.empty(4096, 4096, dtype=bf)
        try:
            W.gemm_ws(x, w, b_trans=b_trans, segments=segments, out=torch.empty(4096, 4096, dtype=out_dtype),
                      bias=torch.empty(4096, dtype=bf) if b_trans else None, config=cfg)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.append({"case": name, "error": repr(exc)[-1500:]})
            continue
        kernel = compiled[-1]
        ptx = kernel.asm["ptx"]
        results.append({"case": name, "segments": segments, "smem": kernel.metadata.shared, "b_trans": b_trans,
                        "block_n": cfg.block_n, "block_k": cfg.block_k, "out_alias": cfg.out_alias,
                        "level2_global": cfg.level2_global,
                        "slot_stores": len(re.findall(r"st\.global\.v2\.b32", ptx)),
                        "slot_loads": len(re.findall(r"ld\.global\.v2\.b32", ptx)),
                        "expected_smem": W.shared_bytes(cfg, out_dtype, segments), "stages": cfg.stages,
                        "ptxas": ptxas_report(ptx, timeout=120),
                        "scale_d_zero": len(re.findall(r"wgmma\.mma_async[^\n]*\}, %rd\d+, %rd\d+, 0,", ptx)),
                        "wgmma": ptx.count("wgmma.mma_async"),
                        "drains": ptx.count("wgmma.wait_group.sync.aligned 0;"),
                        "tma_load_sites": len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global",
                                                         ptx)),
                        **_release_structure(ptx, cfg)})
    # gemm_ws.DEEP_RING_WS (an experiment of benchmarks/gpu_linear.py --ws-deep-ring): P = 4 only, on both layouts
    experiments = []
    for (layout, _, b_trans, out), cfg in itertools.product(LAYOUTS, W.DEEP_RING_WS):
        out_dtype = torch.bfloat16 if out == "bf16" else torch.float32
        W.gemm_ws(torch.empty(4096, 4096, dtype=bf), torch.empty(4096, 4096, dtype=bf), b_trans=b_trans, segments=4,
                  out=torch.empty(4096, 4096, dtype=out_dtype), config=cfg)
        kernel = compiled[-1]
        experiments.append({"case": f"{layout} P=4 DEEP_RING_WS {cfg}", "smem": kernel.metadata.shared,
                            "expected_smem": W.shared_bytes(cfg, out_dtype, 4), "stages": cfg.stages,
                            "ptxas": ptxas_report(kernel.asm["ptx"], timeout=120)})
    blocks = []
    for cfg, widths in ((W.SMALL_GRID_WS, (4096, 1024, 1024)), (W.NARROW_WS, (1024, 1024))):
        x, w = torch.empty(244, 4096, dtype=bf), torch.empty(sum(widths), 4096, dtype=bf)
        W.gemm_ws(x, w, b_trans=True, segments=1, out=tuple(torch.empty(244, n, dtype=bf) for n in widths),
                  config=cfg)
        ptx = compiled[-1].asm["ptx"]
        blocks.append({"case": f"{cfg} widths {widths}", "blocks": len(widths),
                       "ptxas": ptxas_report(ptx, timeout=120),
                       "tma_store_sites": len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx))})
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_linear
    from rlalign.ops.triton_backend.gemm import GemmConfig
    print("RESULTS " + json.dumps({"results": results, "blocks": blocks, "experiments": experiments, "blocks_choice": _blocks_choice(),
                                   "unsupported": _unsupported_calls(W),
                                   "selection": _selection(),
                                   "sweep_labels": [gpu_linear.ws_label(c) for c in W.WS_CANDIDATES],
                                   "triton_labels": [gpu_linear.ws_label(c) for c in gpu_linear.small_candidates_ws()]
                                   + [gpu_linear.ws_label(GemmConfig(**kw)) for kw in gpu_linear.TRITON_PLAIN_CANDIDATES],
                                   "sweep_subset": [gpu_linear.ws_label(c) for c in gpu_linear.ws_candidates("0,2")]}))


def _release_structure(ptx: str, cfg) -> dict:
    """How the consumer frees ring stages: per k-step window (KSTEP_WINDOW) the consumer-wide bar.syncs in all of it
    and before its release; the release instructions; the empty barriers' arrival count."""
    windows = KSTEP_WINDOW.findall(ptx)
    before_release = [w[:m.start()].count("bar.sync") for w in windows if (m := RELEASE.search(w))]
    return {"release": cfg.release, "consumer_threads": 32 * cfg.num_warps,
            "kstep_bar_syncs": [w.count("bar.sync") for w in windows], "bar_syncs_before_release": before_release,
            "alias_guarded_windows": [i for i, w in enumerate(windows) if ALIAS_GUARD.search(w)],
            "cta_arrives": ptx.count("mbarrier.arrive.shared::cta.b64 _,"),
            "thread_arrives": ptx.count("cp.async.mbarrier.arrive.noinc.shared.b64"),
            "barrier_init_counts": sorted(set(re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], (\d+);", ptx)))}


def _blocks_choice() -> dict:
    """Whether gemm.gemm_blocks takes one launch (compiled only: the fake driver) for stacked projections."""
    import torch
    from rlalign.ops.triton_backend import gemm as G
    bf = torch.bfloat16

    def took(m, widths, k=4096):
        return G.gemm_blocks(torch.empty(m, k, dtype=bf), torch.empty(sum(widths), k, dtype=bf), widths) is not None
    qkv, gate_up = (4096, 1024, 1024), (12288, 12288)
    return {"decode": [took(65, qkv), took(128, qkv), took(128, gate_up)],
            # 129..256 rows of the wide stacked q/k/v: the Triton kernel's decode tile (gemm.decode_tile)
            "decode_tile_rows": [took(129, qkv), took(244, qkv), took(256, qkv)],
            "many_waves": took(244, gate_up),   # 768 tiles of 64x128 on 132 SMs: the Triton kernel (WS_PLAIN_MAX_WAVES)
            "other_rows": [took(1, qkv), took(64, qkv), took(257, qkv), took(4096, qkv)],
            "off_tile_edge": took(244, (4000, 1024, 1024)), "four_blocks": took(244, (1024, ) * 4),
            "rows_not_16_bytes": took(244, (4092, 1028, 1024)),
            "launches": {name: repr(G.ws_default(torch.empty(244, 4096, dtype=bf), torch.empty(n, 4096, dtype=bf), True,
                                                 1, False, bf, None, False))
                         for name, n in (("8b qkv", 6144), ("8b gate_up", 24576), ("8b k", 1024))},
            "fp32": G.gemm_blocks(torch.empty(244, 4096), torch.empty(6144, 4096), qkv) is not None}


def _unsupported_calls(W) -> list:
    """(what, exception class, message) of calls the kernel must refuse by name."""
    import torch
    bf = torch.bfloat16
    x, w = torch.empty(64, 1024, dtype=bf), torch.empty(256, 1024, dtype=bf)
    calls = {
        "K not a multiple of P * 64": lambda: W.gemm_ws(x[:, :960], w[:, :960], b_trans=True, segments=8,
                                                        out=torch.empty(64, 256, dtype=bf)),
        "fp32 operands": lambda: W.gemm_ws(x.float(), w.float(), b_trans=True, segments=8,
                                           out=torch.empty(64, 256)),
        "misaligned row stride": lambda: W.gemm_ws(torch.empty(64, 1028, dtype=bf)[:, :1024], w, b_trans=True,
                                                   segments=8, out=torch.empty(64, 256, dtype=bf)),
        "A stored transposed (dW)": lambda: W.gemm_ws(x, w, b_trans=True, segments=8, a_trans=True,
                                                      out=torch.empty(64, 256, dtype=bf)),
        "wrong out shape": lambda: W.gemm_ws(x, w, b_trans=True, segments=8, out=torch.empty(64, 128, dtype=bf)),
        "256x128 tile": lambda: W.gemm_ws(x, w, b_trans=True, segments=8, out=torch.empty(64, 256, dtype=bf),
                                           config=W.WsConfig(block_m=256, block_n=128)),
        "16-column k-step": lambda: W.gemm_ws(x, w, b_trans=True, segments=8, out=torch.empty(64, 256, dtype=bf),
                                           config=W.WsConfig(block_k=16)),
        "out_alias without level 1 in shared memory": lambda: W.gemm_ws(
            x, w, b_trans=True, segments=8, out=torch.empty(64, 256, dtype=bf),
            config=W.WsConfig(block_m=128, block_n=64, out_alias=True)),
        "unknown release": lambda: W.gemm_ws(x, w, b_trans=True, segments=8, out=torch.empty(64, 256, dtype=bf),
                                             config=W.WsConfig(release="warp")),
    }
    out = []
    for what, call in calls.items():
        try:
            call()
            out.append([what, None, "did not raise"])
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out.append([what, type(exc).__name__, str(exc)])
    return out


def _selection() -> dict:
    """What the dispatcher's ws_default picks with RLALIGN_TRITON_GEMM_WS=0 / unset (the default: on; supported
    and not)."""
    import torch
    from rlalign.ops.triton_backend import gemm as G
    from rlalign.ops.triton_backend import gemm_ws as W
    bf = torch.bfloat16
    x, w = torch.empty(512, 1024, dtype=bf), torch.empty(256, 1024, dtype=bf)

    def pick(a, b, segments):
        return repr(G.ws_default(a, b, True, segments, False, bf, None, False))
    os.environ["RLALIGN_TRITON_GEMM_WS"] = "0"
    off = pick(x, w, 8)
    os.environ.pop("RLALIGN_TRITON_GEMM_WS", None)
    big_x, big_w = torch.empty(4096, 1024, dtype=bf), torch.empty(4096, 1024, dtype=bf)
    return {"off": off, "on": pick(x, w, 8), "on_fp32": pick(x.float(), w.float(), 8),
            "on_big": pick(big_x, big_w, 8), "on_edge": pick(big_x[:528], big_w, 8),
            "on_bad_k": pick(x[:, :960], w[:, :960], 8), "default_ws": repr(W.DEFAULT_WS),
            "decode_wide": pick(big_x[:244], big_w, 8), "decode_mid": pick(big_x[:128], big_w, 8),
            "decode_narrow": pick(big_x[:256], w, 8),
            "plain_decode": pick(big_x[:244], big_w, 1), "plain_edges": [pick(big_x[:65], big_w, 1),
                                                                         pick(big_x[:256], big_w, 1)],
            "plain_narrow": [pick(big_x[:244], big_w[:1024], 1), pick(big_x[:65], big_w[:2048], 1)],
            "narrow_ws": repr(W.NARROW_WS),
            "plain_other": [pick(big_x[:64], big_w, 1), pick(big_x[:257], big_w, 1), pick(big_x, big_w, 1),
                            repr(G.ws_default(big_x[:244], torch.empty(1024, 4096, dtype=bf), False, 1, False, bf, None, False))],
            "small_grid_ws": repr(W.SMALL_GRID_WS)}


@pytest.fixture(scope="module")
def sm90_ws():
    data, _, _, err = collect(spawn([os.path.abspath(__file__), "--worker"], interpret=False), timeout=300)
    if data is None and "No module named 'triton" in err:
        pytest.skip(f"the sm_90a Gluon compile did not run here: {err[-800:]}")
    assert data is not None, f"the sm_90a compile worker failed: {err[-3000:]}"   # a crash of ours is a failure
    if "skip" in data:
        pytest.skip(data["skip"])
    return data


def test_ws_compiles_for_sm90a(sm90_ws):
    errors = [f"{r['case']}: {r['error']}" for r in sm90_ws["results"] if "error" in r]
    assert not errors, "\n".join(errors)


def test_ws_no_spills_no_wgmma_serialization(sm90_ws):
    reports = [r for r in sm90_ws["results"] + sm90_ws["blocks"] + sm90_ws["experiments"]
               if r.get("ptxas") is not None]
    if not reports:
        pytest.skip("Triton's ptxas could not be run")
    for r in reports:
        lines = r["ptxas"].splitlines()
        spills = [line for line in lines if re.search(r"[1-9]\d* bytes spill", line) or
                  re.search(r"[1-9]\d* bytes (cumulative )?stack", line)]
        assert not spills, f"{r['case']}: {spills}"
        assert not [line for line in lines if "C7512" in line or "serialized" in line], f"{r['case']}: {r['ptxas']}"


def test_ws_shared_memory_is_the_documented_budget(sm90_ws):
    assert len(sm90_ws["experiments"]) == 4, sm90_ws["experiments"]     # the deep rings at P = 4, both layouts
    for r in sm90_ws["results"] + sm90_ws["experiments"]:
        if "error" in r:
            continue
        barriers = 2 * r["stages"] * 8
        # Triton aligns the allocations; a few hundred bytes of padding at most
        assert r["expected_smem"] + barriers <= r["smem"] <= r["expected_smem"] + barriers + 1024, r
        assert r["smem"] <= 232448, f"{r['case']}: {r['smem']} B of shared memory"


def test_ws_structure_behind_the_bit_exactness(sm90_ws):
    for r in sm90_ws["results"]:
        if "error" in r:
            continue
        # the unrolled segment loop: per segment one chain (block_k / 16 k16 wgmma: 4, or 2 with 32-column stages)
        # that starts it and one in the k-step loop; every wgmma accumulates (scale-d = 1), a segment starting from
        # a +0.0 tile, as in the default kernel's PTX (a constant-zero accumulator would be lowered to scale-d = 0)
        assert r["wgmma"] == 2 * r["segments"] * (r["block_k"] // 16), r
        assert r["scale_d_zero"] == 0, r
        assert r["drains"] == 1, r            # wait_group 0 only at a tile's end
        # level2_global (P = 8): level 2 goes to the program's global slot and comes back by 8-byte stores and
        # loads (a thread holds BN / 2 elements of the tile, 2 adjacent columns per access), nothing else
        expected = r["block_n"] // 4 if r["level2_global"] else 0
        assert (r["slot_stores"], r["slot_loads"]) == (expected, expected), r
        # A and B from the producer's one loop over all k-steps; a row-major B [K, N] tile wider than the 128-byte
        # swizzle is loaded as one TMA message per 64 columns
        assert r["tma_load_sites"] == 1 + (1 if r["b_trans"] else r["block_n"] * 2 // 128), r


def test_ws_stage_release_barriers(sm90_ws):
    """release="cta": one thread frees a stage after a consumer-wide bar.sync in every k-step (two
    bar.syncs a k-step: that one and the one before the operand wait). release="thread" (the default since
    2026-12-02): every consumer thread arrives itself (the empty barriers count all of them), no bar.sync before
    any release, one left a k-step; with out_alias one more at the two level-1 writes of a tile (segments 1 and 5
    end, in segments 2 and 6's first window): after the wait for the previous tile's TMA store, which read the
    buffer as the output tile."""
    for r in sm90_ws["results"]:
        if "error" in r:
            continue
        windows, before = r["kstep_bar_syncs"], r["bar_syncs_before_release"]
        # out_alias: exactly the two level-1 writes (segments 2 and 6's first windows) wait for the TMA store's read
        # of the buffer and then pass a consumer-wide barrier before their shared-memory stores
        assert r["alias_guarded_windows"] == ([4, 12] if r["out_alias"] else []), r
        # 8 segments, two wait_group-1 sites each (a segment's first chain and its k-step loop); all but the first
        # (segment 0's start) release a stage
        assert len(windows) == 2 * r["segments"] and len(before) == 2 * r["segments"] - 1, r
        if r["release"] == "thread":
            assert before == [0] * len(before), r
            level1_writes = {4, 12} if r["out_alias"] else set()
            assert [w for i, w in enumerate(windows) if i not in level1_writes and w > 1] == [], r
            assert [windows[i] for i in sorted(level1_writes)] == [2] * len(level1_writes), r
            assert r["cta_arrives"] == 0 and r["thread_arrives"] >= len(before) + 1, r
            assert r["barrier_init_counts"] == sorted({"1", str(r["consumer_threads"])}), r
        else:
            assert before == [1] * len(before), r
            assert min(windows[1:-1]) == 2, r
            assert r["thread_arrives"] == 0 and r["barrier_init_counts"] == ["1"], r


def test_ws_output_blocks_compile_to_block_stores(sm90_ws):
    """The launch that writes C's column blocks to separate tensors (linear_group's q/k/v, gate/up) compiles a store
    per block: more than one TMA store site, at most one per block (ptxas may merge two branches into one store whose
    descriptor is selected, as it does for blocks 1 and 2). Its spills and wgmma serialization:
    test_ws_no_spills_no_wgmma_serialization."""
    assert sm90_ws["blocks"], "no output-block launch compiled"
    for case in sm90_ws["blocks"]:
        assert 1 < case["tma_store_sites"] <= case["blocks"], case


def test_gemm_blocks_one_launch_only_where_the_dispatcher_takes_gluon(sm90_ws):
    """gemm_blocks takes the one launch at decode rows (65-256) for blocks on tile edges where its tiles take at most
    WS_PLAIN_MAX_WAVES waves and the Triton kernel's decode tile does not apply, and nowhere else."""
    choice = sm90_ws["blocks_choice"]
    assert not choice["many_waves"], choice
    assert choice["decode"] == [True] * 3, choice
    assert choice["decode_tile_rows"] == [False] * 3, choice
    assert choice["other_rows"] == [False] * 4, choice
    assert not choice["off_tile_edge"] and not choice["rows_not_16_bytes"], choice   # block edges on tile edges only
    assert not choice["four_blocks"] and not choice["fp32"], choice


def test_plain_decode_launches(sm90_ws):
    """P = 1 at decode rows (244): 64x64 tiles for the 8B k/v alone; the Triton kernel (its decode tile) for the
    stacked q/k/v and gate/up."""
    launches = sm90_ws["blocks_choice"]["launches"]
    assert launches["8b qkv"] == "None", launches
    assert "block_m=64, block_n=64" in launches["8b k"], launches
    assert launches["8b gate_up"] == "None", launches


def test_ws_refuses_what_it_does_not_implement_by_name(sm90_ws):
    """Fail closed: a clear GemmWsUnsupported naming the shape, never a silent fallback inside the Gluon path."""
    for what, cls, msg in sm90_ws["unsupported"]:
        assert cls == "GemmWsUnsupported", (what, cls, msg)
        assert "gemm_ws: A (" in msg and "P=8" in msg, (what, msg)


def test_ws_dispatcher_selects_only_when_enabled_and_supported(sm90_ws):
    sel = sm90_ws["selection"]
    assert sel["off"] == "None", sel
    # 128x128 tiles where they cover the 132 SMs (4,096 x 4,096: 1,024 tiles; 528 x 4,096: 5 x 32 = 160), the 64x128
    # launch where they would not (512 x 256: 8 tiles)
    assert sel["on_big"] == sel["on_edge"] == sel["default_ws"], sel
    assert sel["on"] == sel["small_grid_ws"] != sel["default_ws"], sel
    assert sel["on_fp32"] == "None" and sel["on_bad_k"] == "None", sel
    # at <= 256 rows (the per-segment split's range) only where the 64x128 tiles fill >= 70% of the SMs:
    # 244 x 4,096 is 4 x 32 = 128 tiles; 128 x 4,096 is 64, 256 x 256 is 8: the split
    assert sel["decode_wide"] == sel["small_grid_ws"], sel
    assert sel["decode_mid"] == sel["decode_narrow"] == "None", sel
    # P = 1: the 64x128 launch in the forward layout at 65-256 rows only (not <= 64, not past 256, not W [K, N])
    assert sel["plain_decode"] == sel["small_grid_ws"] and sel["plain_edges"] == [sel["small_grid_ws"]] * 2, sel
    assert sel["plain_other"] == ["None"] * 4, sel
    # where the 64x128 tiles would fill under a third of the 132 SMs (244 x 1,024: 32 tiles; 65 x 2,048: 32), 64x64
    assert sel["plain_narrow"] == [sel["narrow_ws"]] * 2, sel


def test_ws_sweep_names_every_candidate_apart(sm90_ws):
    """benchmarks/gpu_linear.py --sweep-ws's table and refusal list name launches by ws_label: every WS_CANDIDATES launch
    and every Triton tile the sweep takes a different name; --ws-candidates picks by index."""
    labels = sm90_ws["sweep_labels"]
    assert len(set(labels)) == len(labels), labels
    triton = sm90_ws["triton_labels"]   # --ws-small / --ws-triton: the Triton tiles, named from their fields
    assert len(set(triton)) == len(triton) and "triton 16x32/w4/s4/flat/k256/2cta" in triton, triton
    assert sm90_ws["sweep_subset"] == [labels[0], labels[2]], sm90_ws["sweep_subset"]


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
