"""A strict MoE training step on the CPU with many experts: where per-expert parameters cost host time.

    PYTHONPATH=. python benchmarks/moe_stacked_step.py [--experts 64] [--top-k 8] [--tokens 512] [--repeats 5]

Model: the embedded default model (4 layers, hidden 128, FFN 384) upcycled to ``--experts`` experts of 384
per layer (top ``--top-k``). One step: forward with entropy and backward of ``--tokens`` packed tokens (the
trainer's fused log-prob), the gradient clip (rlalign.train.parallel.clip_grad_norm_) and an AdamW step
(foreach=False, as the trainer). Prints the parameter count and each phase's median wall and CPU time. It uses
only APIs that existed before the experts were stacked, so the same file times both layouts
(3 x E parameters per sparse layer before, 3 after). Numbers are for the machine it runs on; the 2-core shared
development machine is noisy. ``--host-only``: the CUDA path's autograd Function alone (grouped_linear, its
kernels stubbed; run with TRITON_INTERPRET=1 on a machine without a GPU), per-expert lists against stacked
weights, in this tree only (lists stay accepted).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from rlalign.contract.profiles import use_profile
from rlalign.models import ForwardBatch, load_model
from rlalign.models.upcycle import upcycle
from rlalign.train.parallel import clip_grad_norm_

DEFAULT = Path(__file__).resolve().parents[1] / "rlalign" / "assets" / "default_model"


def _micro_batch(vocab: int, tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    seqs, total = [], 0
    while total < tokens:
        n = min(int(torch.randint(14, 22, (1,), generator=gen)), tokens - total)
        seqs.append(torch.randint(3, vocab, (n,), generator=gen).tolist())
        total += n
    return seqs, torch.randint(0, vocab, (total,), generator=gen)


def step(model, optimizer, seqs, targets) -> dict[str, tuple[float, float]]:
    """{phase: (wall seconds, process CPU seconds)}."""
    marks = [(time.perf_counter(), time.process_time())]
    lp, ent = model.logprobs(ForwardBatch.packed(seqs), targets, with_entropy=True)
    (lp.sum() + 0.01 * ent.sum()).backward()
    marks.append((time.perf_counter(), time.process_time()))
    clip_grad_norm_(model, 1.0)
    marks.append((time.perf_counter(), time.process_time()))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    marks.append((time.perf_counter(), time.process_time()))
    spans = {"forward+backward": (0, 1), "clip": (1, 2), "adamw+zero_grad": (2, 3), "step": (0, 3)}
    return {k: (marks[b][0] - marks[a][0], marks[b][1] - marks[a][1]) for k, (a, b) in spans.items()}


def grouped_host_overhead(n_experts: int = 128, repeats: int = 20) -> dict[str, float]:
    """Host milliseconds of one gate/up/down grouped_linear forward + backward (rlalign.ops.triton_backend.grouped,
    the CUDA path) with the kernels replaced by empty outputs of the right shape: what the autograd Function
    costs on the host with 3 x E per-expert weight inputs against 3 stacked ones (Qwen3-30B-A3B: E = 128)."""
    from rlalign.ops.triton_backend import grouped as G
    saved = G.grouped_rows, G.grouped_weight_grad
    G.grouped_rows = lambda x, offsets, weights, transpose_w=True, **kw: x.new_empty(
        (x.shape[0], weights[0].shape[0] if transpose_w else weights[0].shape[1]))
    G.grouped_weight_grad = lambda g, x, offsets, n, dtype, config=None: g.new_empty((n, g.shape[1], x.shape[1]))
    try:
        out = {}
        hidden, inter, rows = 16, 8, 32
        offsets = torch.zeros(n_experts + 1, dtype=torch.long)
        stacked = [torch.zeros(n_experts, inter, hidden, requires_grad=True),
                   torch.zeros(n_experts, inter, hidden, requires_grad=True),
                   torch.zeros(n_experts, hidden, inter, requires_grad=True)]
        lists = [[torch.zeros(w.shape[1:], requires_grad=True) for _ in range(n_experts)] for w in stacked]
        for name, (gate, up, down) in (("per-expert lists", lists), ("stacked", stacked)):
            x = torch.zeros(rows, hidden, requires_grad=True)
            def once():
                h = G.grouped_linear(x, offsets, gate) * G.grouped_linear(x, offsets, up)
                G.grouped_linear(h, offsets, down).sum().backward()
            for _ in range(3):
                once()
            t0 = time.perf_counter()
            for _ in range(repeats):
                once()
            out[name] = (time.perf_counter() - t0) / repeats * 1e3
        return out
    finally:
        G.grouped_rows, G.grouped_weight_grad = saved


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--host-only", action="store_true", help="only the grouped GEMM Function's host overhead")
    args = ap.parse_args(argv)
    if args.host_only:
        for name, ms in grouped_host_overhead().items():
            print(f"grouped_linear gate+up+down fwd+bwd, kernels stubbed, 128 experts, {name}: {ms:.2f} ms host")
        return
    dense, _ = load_model(DEFAULT)
    model = upcycle(dense, args.experts, args.top_k, seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    seqs, targets = _micro_batch(dense.config.vocab_size, args.tokens)
    params = list(model.parameters())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.experts} experts top-{args.top_k}, "
          f"{targets.numel()} tokens; {len(params)} parameters ({sum(p.numel() for p in params) / 1e6:.1f}M)")
    with use_profile("strict"):
        step(model, optimizer, seqs, targets)     # warm-up (AdamW state allocated)
        runs = [step(model, optimizer, seqs, targets) for _ in range(args.repeats)]
    for phase in runs[0]:
        wall, cpu = ([r[phase][i] * 1e3 for r in runs] for i in (0, 1))
        print(f"{phase:17s} wall median {statistics.median(wall):8.1f} ms [{min(wall):.1f}-{max(wall):.1f}]  "
              f"process CPU median {statistics.median(cpu):8.1f} ms")


if __name__ == "__main__":
    main()
