"""The K-partition schedules of the strict GEMM (gemm.KPART_CANDIDATES) under the CPU interpreter: every
candidate gives the default schedule's raw bits.

The candidates are different schedules of the same per-element operations (segments from zero in 64-column
steps, the fixed tree, bias, one rounding): a loop per segment, one stream of k-steps over a program's
(tile, segment) items, one or two programs per SM. Hypothesis draws the shapes: M including 1, 63, 64 and 65
(and M = 1000 with a short K as an explicit example: the interpreter is slow), N off the tile grid, P = 2 / 4 / 8,
segments of 8..192 columns (off the 64-column step: the pointer path's masks), A stored transposed (the dW
layout) or not, B stored transposed (the nn.Linear layout) or not, bias.
fp32 operands only (the interpreter mis-rounds bf16; its fp32 dot is numpy's, whose summation order follows the
tile shape, hence the two references of _run_case): this checks indexing, masks, the tile/segment walk and the
order of the k-steps and of the tree; tests/cuda/test_cuda_linear.py checks the bf16 bits on the GPU.

The checks run in ONE subprocess with TRITON_INTERPRET=1 (the interpreter must be on before triton is imported).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import pytest

from tests.workers import run_worker

MAX_EXAMPLES = 3   # per candidate (the interpreter is slow); the degenerate M values are always among them (explicit examples)


def _shapes():
    from hypothesis import strategies as st
    return st.fixed_dictionaries({
        "m": st.one_of(st.sampled_from([1, 63, 64, 65]), st.integers(1, 130)),   # M = 1000: an explicit example
        "n": st.integers(1, 100),
        "p": st.sampled_from([2, 4, 8]),
        "seg_k": st.sampled_from([8, 48, 64, 128]),
        "a_trans": st.booleans(), "b_trans": st.booleans(), "bias": st.booleans(), "seed": st.integers(0, 2**16)})


def _run_case(cfg, case) -> str:
    """"identical", or the first difference of ``cfg``'s output on one drawn shape, against:

    * the default schedule (KPART_CANDIDATES[0]) on small-integer operands: every partial sum is exact, so any
      tile shape gives the same bits and a difference is an indexing / mask / segment-boundary / unwritten-element
      error;
    * the default's schedule at ``cfg``'s tile shape on random operands: the interpreter's dot is numpy's,
      whose summation order follows the tile shape, so only a same-tile reference pins the order of the k-steps
      and of the tree."""
    import dataclasses
    import torch
    from rlalign.ops.triton_backend.gemm import KPART_CANDIDATES, gemm
    from tests.bitwise import first_difference
    g = torch.Generator().manual_seed(case["seed"])
    m, n, k = case["m"], case["n"], case["p"] * case["seg_k"]
    same_tile = dataclasses.replace(KPART_CANDIDATES[0], block_m=cfg.block_m, block_n=cfg.block_n,
                                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def draw(shape, exact):
        return torch.randint(-3, 4, shape, generator=g).float() if exact else torch.randn(shape, generator=g)

    for exact, ref_cfg in ((True, KPART_CANDIDATES[0]), (False, same_tile)):
        a = draw((k, m) if case["a_trans"] else (m, k), exact)
        b = draw((n, k) if case["b_trans"] else (k, n), exact)
        bias = draw((n,), exact) if case["bias"] else None

        def run(c):
            out = torch.full((m, n), float("nan"))   # every element must be written
            return gemm(a, b, a_trans=case["a_trans"], b_trans=case["b_trans"], bias=bias, segments=case["p"],
                        config=c, out=out)
        diff = first_difference(run(cfg), run(ref_cfg))
        if diff != "identical":
            return f"{'integer operands vs the default' if exact else 'random operands vs ' + repr(same_tile)}: {diff}"
    return "identical"


def _check_candidate(cfg) -> str:
    from hypothesis import HealthCheck, example, given, settings
    failures = []

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_shapes())
    @example({"m": 1, "n": 33, "p": 8, "seg_k": 64, "a_trans": False, "b_trans": True, "bias": True, "seed": 1})
    @example({"m": 63, "n": 70, "p": 2, "seg_k": 192, "a_trans": False, "b_trans": False, "bias": False, "seed": 2})
    @example({"m": 65, "n": 33, "p": 8, "seg_k": 128, "a_trans": True, "b_trans": False, "bias": True, "seed": 6})
    @example({"m": 64, "n": 129, "p": 4, "seg_k": 48, "a_trans": True, "b_trans": True, "bias": True, "seed": 3})
    @example({"m": 65, "n": 64, "p": 8, "seg_k": 8, "a_trans": True, "b_trans": False, "bias": False, "seed": 4})
    @example({"m": 1000, "n": 20, "p": 2, "seg_k": 64, "a_trans": False, "b_trans": True, "bias": True, "seed": 5})
    def prop(case):
        diff = _run_case(cfg, case)
        if diff != "identical":
            failures.append(f"{case}: {diff}")
        assert diff == "identical"

    try:
        prop()
    except AssertionError:
        return failures[0] if failures else traceback.format_exc()[-1500:]
    return "identical"


def _refuses_stack_in_scratch() -> str:
    import torch
    from rlalign.ops.triton_backend.gemm import GemmConfig, gemm
    try:
        gemm(torch.zeros(4, 64), torch.zeros(8, 64), b_trans=True, segments=8,
             config=GemmConfig(128, 128, 8, 4, reg_levels=1, stream=True))
    except ValueError as exc:
        return "refused" if "registers only" in str(exc) else f"wrong message: {exc}"
    return "ran"



# (m, n, segments, fp32 operands, out mode, the gemm.DECODE_TILES tile that applies as "BMxBN", or None)
DECODE_TILE_CASES = (
    (244, 6144, 1, False, "bf16", "128x128"),    # the 8B stacked q/k/v at a decode batch (96 tiles on 132 SMs)
    (244, 24576, 1, False, "bf16", "128x128"),   # the 8B stacked gate/up
    (129, 12288, 1, False, "bf16", "128x128"),   # the first row count two 128-row tiles cover
    (256, 12288, 1, False, "bf16", "128x128"),
    (128, 12288, 1, False, "bf16", None),        # one 128-row tile: the other rules
    (257, 12288, 1, False, "bf16", None),        # three 128-row tiles: not measured, the fill rule
    (384, 24576, 1, False, "bf16", None),
    (385, 12288, 1, False, "bf16", "128x256"),   # four 128-row tiles: 128x256 tiles
    (462, 6144, 1, False, "bf16", "128x256"),    # the 0.6B stacked gate/up at 512 sequences (96 tiles)
    (462, 4096, 1, False, "bf16", None),         # the 0.6B stacked q/k/v there: 64 tiles, under 0.7 of the SMs
    (512, 24576, 1, False, "bf16", "128x256"),
    (513, 24576, 1, False, "bf16", None),        # above the decode rows
    (244, 4096, 1, False, "bf16", None),         # 64 tiles: under 0.7 of the SMs
    (244, 6144, 8, False, "bf16", None),         # the K partition
    (244, 6144, 1, True, "fp32", None),          # fp32 operands
    (244, 6144, 1, False, "fp32", None),         # fp32 output
    (244, 6144, 1, False, "acc_in", None),
    # M <= 64 (gemm.small_m_tile): the narrowest row tile covering M, the widest N that keeps 0.7 of the SMs busy
    (1, 4096, 1, False, "bf16", "16x32"),         # 8B q_proj: 128 tiles of 32
    (1, 1024, 1, False, "bf16", "16x32"),         # kv_proj: no tile fills; the band's narrowest
    (16, 6144, 1, False, "bf16", "16x64"),        # 8B stacked q/k/v: 96 tiles of 64
    (8, 151936, 1, False, "bf16", "16x128"),      # the LM head
    (8, 151936, 1, False, "fp32", "16x128"),      # fp32 logits: the same tile
    (17, 6144, 1, False, "bf16", "32x64"),        # two 16-row tiles' rows: one 32-row tile
    (32, 4096, 1, False, "bf16", "16x32"),        # 64 tiles of 32x64 under 0.7: two rows of 16x32
    (33, 12288, 1, False, "bf16", "64x128"),
    (64, 6144, 1, False, "bf16", "64x64"),
    (64, 1024, 1, False, "bf16", "64x32"),
    (64, 4096, 8, False, "bf16", None),           # the K partition: the per-segment split
    (16, 4096, 1, True, "fp32", None),            # fp32 operands (bf16x3 per 64-column step)
    (16, 4096, 1, False, "acc_in", None),
    (65, 4096, 1, False, "bf16", None),           # above the band
)


def _decode_tile_rule() -> list:
    """Per DECODE_TILE_CASES: (small_m_tile's or decode_tile's tile as "BMxBN" or None, pick_config's choice is that tile (when one
    applies) / is none of DECODE_TILES' tiles chosen for a row range it is not in, pick_config's choice is one of
    all_configs -- whose bits the CUDA tier compares)."""
    from rlalign.ops.triton_backend.gemm import all_configs, decode_tile, pick_config, small_m_tile
    out = []
    for m, n, segments, fp32, out_mode, _ in DECODE_TILE_CASES:
        tile = small_m_tile(m, n, segments, fp32, 132, out_mode) or decode_tile(m, n, segments, fp32, 132, out_mode)
        picked = pick_config(m, n, segments, fp32, 132, out_mode)
        out.append([None if tile is None else f"{tile.block_m}x{tile.block_n}", tile is None or picked == tile,
                    picked in all_configs(segments, fp32, out_mode)])
    return out

def _worker() -> None:
    from tests.ops.test_triton_interpret import _patch_interpreter
    _patch_interpreter()
    from rlalign.ops.triton_backend.gemm import KPART_CANDIDATES, pick_config
    results = {"count": len(KPART_CANDIDATES), "default_is_dispatched": KPART_CANDIDATES[0] == pick_config(4096, 4096, 8, False, 132),
               "stack_in_scratch": _refuses_stack_in_scratch(), "decode_tile": _decode_tile_rule(), "candidates": {}}
    for cfg in KPART_CANDIDATES[1:]:
        try:
            results["candidates"][repr(cfg)] = _check_candidate(cfg)
        except Exception:  # report, go on with the other candidates
            results["candidates"][repr(cfg)] = "error: " + traceback.format_exc()[-1500:]
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results():
    pytest.importorskip("triton")
    pytest.importorskip("hypothesis")
    return run_worker([os.path.abspath(__file__), "--worker"], interpret=True, timeout=900)


def test_the_default_is_the_dispatched_schedule_and_has_rivals(interpreter_results):
    """KPART_CANDIDATES[0] is what the dispatcher picks at large M on the K partition (the sweep's reference)."""
    assert interpreter_results["default_is_dispatched"]
    assert interpreter_results["count"] >= 2


def test_every_candidate_gives_the_default_bits(interpreter_results):
    differing = {c: r for c, r in interpreter_results["candidates"].items() if r != "identical"}
    assert not differing, "vs the default schedule: " + "; ".join(f"{c}: {r}" for c, r in differing.items())


def test_stream_schedule_refuses_a_stack_in_the_scratch(interpreter_results):
    """segment_stream_kernel keeps its tree stack in registers (a scratch level leaves Triton's loop unpipelined):
    a config asking for scratch levels is refused, not run slowly."""
    assert interpreter_results["stack_in_scratch"] == "refused"


@pytest.mark.parametrize("case", range(len(DECODE_TILE_CASES)), ids=lambda i: "-".join(map(str, DECODE_TILE_CASES[i])))
def test_the_decode_tile_rule(interpreter_results, case):
    """gemm.decode_tile gives the tile DECODE_TILE_CASES names (none where it says none); pick_config returns it
    there (before the fill rule); every pick is one of all_configs."""
    tile, picked_it, listed = interpreter_results["decode_tile"][case]
    assert tile == DECODE_TILE_CASES[case][-1] and picked_it and listed, (DECODE_TILE_CASES[case], tile, picked_it, listed)

if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()

