"""The rollout benchmark's byte accounting (rlalign.bench.roofline) and its per-step figures.

Known configs give known bytes: a tiny config computed by hand, Qwen3-0.6B's published parameter count,
and an independent count from a real model's tensors (tied and untied heads)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlalign.bench.rollout import PRESETS, DecodeStep, decode_metrics
from rlalign.bench.roofline import (StepBytes, decode_step_bytes, decode_step_floor, kv_bytes_per_token,
                                    parameter_counts, step_shapes)
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM


def _config(name: str, **overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(PRESETS[name], **overrides))


def test_tiny_config_by_hand():
    # tiny: vocab 512, hidden 64, intermediate 128, 2 layers, 4 heads / 2 kv heads of 16, q/k norms, untied head.
    # per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 + q_norm 16 + k_norm 16 + two norms 2*64 + 3 * 64*128
    per_layer = 4096 + 2048 + 2048 + 4096 + 16 + 16 + 128 + 3 * 8192
    assert per_layer == 37024
    read_once = 2 * per_layer + 64 + 512 * 64          # + final norm + LM head; the embedding table is not read
    got = decode_step_bytes(_config("tiny"), torch.float32, rows=3, context_tokens=30)
    assert got == StepBytes(weights=(read_once + 3 * 64) * 4, kv_read=30 * 2 * 2 * 2 * 16 * 4,
                            kv_write=3 * 2 * 2 * 2 * 16 * 4)
    assert got.total == 428288 + 15360 + 1536


def test_qwen3_0_6b_matches_its_published_size():
    cfg = _config("qwen3-0.6b")
    assert parameter_counts(cfg) == (596_049_920, 151_936 * 1024)     # 0.6B, tied embeddings
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 28 * 2 * 8 * 128 * 2
    step = decode_step_bytes(cfg, torch.bfloat16, rows=512, context_tokens=512 * 150)
    assert step.weights == (596_049_920 + 512 * 1024) * 2                # the tied table is the head: read once
    assert step.kv_read == 512 * 150 * 114_688                         # ~8.8 GB, as estimated by hand


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("layers", [1, 3])
def test_counts_agree_with_a_real_models_tensors(tied, layers):
    cfg = _config("tiny", tie_word_embeddings=tied, num_hidden_layers=layers)
    model = CausalLM(cfg, dtype=torch.bfloat16)
    table = model.model.embed_tokens.weight.nbytes
    every = sum(p.nbytes for p in model.parameters())      # a tied head is the same tensor: counted once
    want = every - (0 if tied else table) + 5 * cfg.hidden_size * 2
    assert decode_step_bytes(cfg, torch.bfloat16, rows=5, context_tokens=77).weights == want


# 1 GB/s and 1 GFLOP/s in float32: a matrix of n x k elements costs max(4 n k, 2 rows n k) nanoseconds
SLOW = dict(elem=4, peak_gbps=1.0, peak_tflops=1e-3)


@pytest.mark.parametrize("rows, per_element", [(1, 4), (3, 6)])   # 1 row: bandwidth bound; 3 rows: compute bound
def test_per_op_floor_of_the_tiny_config_by_hand(rows, per_element):
    cfg = _config("tiny")
    # per layer q 64x64, k 32x64, v 32x64, o 64x64, gate / up 128x64, down 64x128; the untied LM head 512x64
    matrices = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192) + 512 * 64
    other = 2 * (16 + 16 + 2 * 64) + 64                       # q/k norms, the two norms per layer, the final norm
    ctx = 30
    kv = (ctx + rows) * 2 * 2 * 2 * 16 * 4                    # read + written; above the 4 * ctx * 4 * 16 * 2 FLOPs
    want = (per_element * matrices + (other + rows * 64) * 4 + kv) * 1e-9
    step = decode_step_bytes(cfg, torch.float32, rows, ctx)
    assert decode_step_floor(step_shapes(cfg), step, rows, ctx, **SLOW) == pytest.approx(want, rel=1e-12)


def test_per_op_floor_counts_stacked_experts_at_their_routed_rows():
    moe = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, norm_topk_prob=True)
    cfg = _config("tiny", **moe)
    shapes = step_shapes(cfg)
    stacks = [m for m in shapes.matrices if m[2]]
    assert sorted(stacks) == sorted([(32, 64, 8), (32, 64, 8), (64, 32, 8)] * 2) and shapes.top_k == 2
    step = decode_step_bytes(cfg, torch.float32, 16, 100)
    base = decode_step_floor(dataclasses.replace(shapes, matrices=tuple(m for m in shapes.matrices if not m[2])),
                             step, 16, 100, **SLOW)
    # 16 rows x top 2 over 8 experts: 4 rows an expert -> 8 FLOPs an element against 4 bytes: compute bound
    want = base + 2 * 8 * (3 * 32 * 64) * 8e-9
    assert decode_step_floor(shapes, step, 16, 100, **SLOW) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b"])
@pytest.mark.parametrize("rows", [1, 64, 256, 512])
def test_per_op_floor_bounds_both_single_ceilings(name, rows):
    """The per-op roofline is at least the bandwidth roofline and at least the matmuls' FLOPs at the peak;
    at one row it is the bandwidth roofline (every op bandwidth bound)."""
    cfg = _config(name)
    shapes = step_shapes(cfg)
    ctx = rows * 480
    step = decode_step_bytes(cfg, torch.bfloat16, rows, ctx)
    floor = decode_step_floor(shapes, step, rows, ctx, 2, 4300.0, 780.0)
    flops = sum(2 * rows * n * k for n, k, e in shapes.matrices)
    assert floor >= step.total / 4300e9 * (1 - 1e-12) and floor >= flops / 780e12
    if rows == 1:
        assert floor == pytest.approx(step.total / 4300e9, rel=1e-12)


class _Events:
    def __init__(self, ms):
        self.ms = ms

    def pair(self):
        ms = self.ms

        class Start:
            def elapsed_time(self, end):
                return ms
        return Start(), object()


def test_decode_metrics_from_known_steps():
    cfg = _config("tiny")
    steps = [DecodeStep(rows=4, context_tokens=40, seconds=0.010, events=_Events(6.0).pair(), graph_checks=3),
             DecodeStep(rows=2, context_tokens=30, seconds=0.030, events=_Events(10.0).pair(), graph_checks=4)]
    bytes_ = [decode_step_bytes(cfg, torch.float32, 4, 40).total, decode_step_bytes(cfg, torch.float32, 2, 30).total]
    m = decode_metrics(steps, cfg, torch.float32, peak_gbps=0.5)
    assert m["decode_steps"] == 2 and m["decode_rows_mean"] == 3.0 and m["decode_context_mean"] == round(70 / 6, 1)
    assert m["decode_step_ms"] == 20.0 and m["decode_tokens_per_s"] == 150.0
    assert m["bytes_per_decode_step"] == round(sum(bytes_) / 2)
    assert m["achieved_gbps"] == pytest.approx(sum(bytes_) / 0.040 / 1e9, rel=1e-3)
    assert m["roofline_fraction"] == pytest.approx(sum(bytes_) / 0.040 / 1e9 / 0.5, rel=1e-3)
    assert m["forward_gpu_ms"] == 8.0 and m["host_ms_per_step"] == 12.0        # (40 - 16) / 2
    assert m["graph_finite_checks_per_step"] == 3.5
    assert m["forward_roofline_fraction"] == pytest.approx(sum(bytes_) / 0.016 / 1e9 / 0.5, rel=1e-3)
    assert m["op_floor_ms"] is None and m["op_roofline_fraction"] is None      # no FLOP ceiling given
    with_flops = decode_metrics(steps, cfg, torch.float32, peak_gbps=0.5, peak_tflops=1e-3)
    floors = [decode_step_floor(step_shapes(cfg), decode_step_bytes(cfg, torch.float32, s.rows, s.context_tokens),
                                s.rows, s.context_tokens, 4, 0.5, 1e-3) for s in steps]
    assert with_flops["op_floor_ms"] == round(1e3 * sum(floors) / 2, 3)
    assert with_flops["op_roofline_fraction"] == pytest.approx(sum(floors) / 0.040, rel=1e-3)
    assert with_flops["forward_op_roofline_fraction"] == pytest.approx(sum(floors) / 0.016, rel=1e-3)
    eager = decode_metrics([DecodeStep(4, 40, 0.01)], cfg, torch.float32, peak_gbps=None)
    assert eager["forward_gpu_ms"] is None and eager["host_ms_per_step"] is None and eager["roofline_fraction"] is None
    assert decode_metrics([], cfg, torch.float32, 1.0) == {"decode_steps": 0}
