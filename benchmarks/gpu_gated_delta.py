"""Benchmark: the strict Gated-DeltaNet rule on CUDA (rlalign/ops/triton_backend/gated_delta.py: one Triton program per
(sequence, value head) walking its chunks of 64 in order, products bf16x3) against plain torch references on the
same GPU, Qwen3-Next-80B-A3B's linear-attention shape (32 value heads, Dk = Dv = 128; q and k already repeated to
the value heads and l2-normalised), fp32:

* ``strict``: ``rlalign.ops.gated_delta.delta_chunks`` (the op the model calls; the packed/prefill path);
* ``chunked``: transformers' ``torch_chunk_gated_delta_rule`` (chunk 64, cuBLAS GEMMs and a per-row triangular solve
  loop: the plain chunked torch formulation; no batch-invariance promise);
* ``recurrent``: transformers' ``torch_recurrent_gated_delta_rule`` (one state update per token);
* ``fla``: flash-linear-attention's ``chunk_gated_delta_rule`` Triton kernels where the package is installed (the
  vendor speed reference; bf16 inputs as vLLM feeds it).

Rows: prefill forward (one sequence of T tokens), forward + backward (autograd of each; the recurrent rule only up to
``--recurrent-max`` tokens), and decode (B sequences, one new token each at position 32 of its open chunk: strict
recomputes the open chunk from the state at its start, as the engine does; recurrent updates B states by one token).
Each row also has ``max_err``: the largest |difference| from the float64 recurrent rule over the first 256 tokens,
relative to its largest value.

    python benchmarks/gpu_gated_delta.py [--out DIR] [--tokens 4096,16384] [--decode-batch 64,256]

Writes bench_gated_delta.json (+ .csv) to $OUT (or --out, default benchmarks/).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from rlalign.bench.args import positive_ints
from rlalign.contract import spec
from rlalign.ops import gated_delta as gd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_linear import write  # noqa: E402

C = spec.GDN_CHUNK
HEADS, DK, DV = 32, 128, 128


def timed(fn) -> float:
    from rlalign.bench.cuda_timing import bench_ms
    return bench_ms(fn, warmup=10, rep=50)


def inputs(t: int, b: int = 1, seed: int = 0, grad: bool = False):
    """q_hat, k_hat (l2-normalised, q also by Dk^-1/2), v, g, beta: [B, T, H, ...] fp32 on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, t, HEADS, DK, device="cuda", generator=gen)
    k = torch.randn(b, t, HEADS, DK, device="cuda", generator=gen)
    xs = [q / q.norm(dim=-1, keepdim=True) * DK ** -0.5, k / k.norm(dim=-1, keepdim=True),
          torch.randn(b, t, HEADS, DV, device="cuda", generator=gen),
          -0.5 * torch.rand(b, t, HEADS, device="cuda", generator=gen),
          torch.rand(b, t, HEADS, device="cuda", generator=gen)]
    return [x.requires_grad_(grad) for x in xs]


def as_chunks(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, ...] -> [J, B, H, C, ...] zero-padded to whole chunks."""
    b, t = x.shape[:2]
    j = -(-t // C)
    x = torch.cat([x, x.new_zeros((b, j * C - t) + tuple(x.shape[2:]))], dim=1)
    x = x.view(b, j, C, *x.shape[2:]).transpose(0, 1)          # [J, B, C, H, ...]
    return x.transpose(2, 3)


def strict(q, k, v, g, beta, state=None, first: int = 0):
    """The op over whole sequences [B, T, ...] from ``state`` (zeros) -> [B, T, H, Dv]; ``first``: the chunk-local
    row the sequences start at (decode: their open chunk's rows before the new token are passed in too)."""
    b, t = q.shape[:2]
    j = -(-t // C)
    valid = (torch.arange(j * C) < t).view(j, 1, C).expand(j, b, C)
    state = torch.zeros(b, HEADS, DK, DV, device="cuda") if state is None else state
    out, *_ = gd.delta_chunks(*(as_chunks(x) for x in (q, k, v, g, beta)), valid, state)
    return out.transpose(2, 3).transpose(0, 1).reshape(b, j * C, HEADS, DV)[:, first:t]


def transformers_rule(name: str):
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except ImportError:
        return None
    rule = m.torch_chunk_gated_delta_rule if name == "chunked" else m.torch_recurrent_gated_delta_rule

    def run(q, k, v, g, beta, state=None):   # transformers scales q by Dk^-1/2 itself: undo ours
        return rule(q * DK ** 0.5, k, v, g, beta, initial_state=state, output_final_state=state is not None,
                    use_qk_l2norm_in_kernel=False)[0]
    return run


def fla_rule():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None

    def run(q, k, v, g, beta, state=None):
        bf = [x.to(torch.bfloat16) for x in (q, k, v)]
        return chunk_gated_delta_rule(*bf, g, beta, scale=1.0, initial_state=state, output_final_state=False)[0]
    return run


def max_err(rule) -> float:
    """max |rule - float64 recurrent| / max |float64 recurrent| over 256 tokens."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule as rec
    x = inputs(256, seed=7)
    with torch.no_grad():
        q, k, v, g, beta = (t.double() for t in x)
        ref = rec(q * DK ** 0.5, k, v, g, beta, use_qk_l2norm_in_kernel=False)[0]
        got = rule(*x).double()
    return float((got - ref).abs().max() / ref.abs().max())


def prefill_rows(tokens: int, rules: dict, recurrent_max: int) -> list[dict]:
    rows = []
    for name, rule in rules.items():
        if name == "recurrent" and tokens > recurrent_max:
            continue
        try:
            rows.append(prefill_row(name, rule, tokens))
        except Exception as exc:   # a reference that does not run here (e.g. an fla build): say so, go on
            if name == "strict":
                raise
            rows.append({"case": "prefill", "rule": name, "tokens": tokens,
                         "error": f"{type(exc).__name__}: {exc}"[:200]})
    return rows


def prefill_row(name: str, rule, tokens: int) -> dict:
    """One sequence of ``tokens``: forward ms, forward + backward ms, accuracy."""
    x = inputs(tokens)
    with torch.no_grad():
        fwd = timed(lambda: rule(*x))
    xg = inputs(tokens, grad=True)
    w = torch.randn(1, tokens, HEADS, DV, device="cuda")

    def train():
        for t in xg:
            t.grad = None
        (rule(*xg).float() * w).sum().backward()
    row = {"case": "prefill", "rule": name, "tokens": tokens, "forward_ms": round(fwd, 3),
           "fwd_bwd_ms": round(timed(train), 3)}
    try:
        row["max_err"] = max_err(rule)
    except ImportError:
        pass
    return row


def decode_rows(batch: int, rules: dict) -> list[dict]:
    """One token per sequence at chunk-local position 32, from the state at its chunk's start."""
    rows = []
    pos = C // 2
    x = inputs(pos + 1, b=batch, seed=3)
    state = torch.randn(batch, HEADS, DK, DV, device="cuda") * 0.1
    with torch.no_grad():
        rows.append({"case": "decode", "rule": "strict", "batch": batch,
                     "ms_per_step": round(timed(lambda: strict(*x, state=state, first=pos)), 3)})
        if rules.get("recurrent") is not None:
            one = [t[:, pos:pos + 1] for t in x]
            rows.append({"case": "decode", "rule": "recurrent", "batch": batch,
                         "ms_per_step": round(timed(lambda: rules["recurrent"](*one, state=state)), 3)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description="Gated-DeltaNet rule on CUDA: strict chunk kernel vs torch references")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=positive_ints, default=[4096, 16384])
    ap.add_argument("--decode-batch", type=positive_ints, default=[64, 256])
    ap.add_argument("--recurrent-max", type=int, default=4096)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    started = time.time()
    rules = {"strict": strict, "chunked": transformers_rule("chunked"), "recurrent": transformers_rule("recurrent"),
             "fla": fla_rule()}
    rules = {k: v for k, v in rules.items() if v is not None}
    rows = []
    for t in args.tokens:
        rows += prefill_rows(t, rules, args.recurrent_max)
    for b in args.decode_batch:
        rows += decode_rows(b, rules)
    for r in rows:
        print(r, flush=True)
    write(args.out, "gated_delta", rows, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
