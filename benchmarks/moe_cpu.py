"""Where a strict Qwen3-MoE step spends its time on the CPU, against the dense model it was upcycled from.

    PYTHONPATH=. python benchmarks/moe_cpu.py [--repeats 3] [--threads N]

Models: the embedded default model (dense, 4 layers, hidden 128, FFN 384) and configs/moe-cpu.yaml's model
(the same model upcycled: every layer sparse, 4 experts of 384, top-2). Work: configs/moe-cpu.yaml's step
shape -- a rollout of 32 prompts x 8 samples x 6 new tokens (RolloutEngine.generate), and one training
micro-batch of 4096 packed tokens (forward with entropy + backward, the trainer's fused logprob).

Prints, per model and phase, the median wall time, and for the MoE model the forward time inside each MoE op
(ops.router_logits / moe_route / moe_experts / moe_combine, wrapped with timers) and the time of
route + combine alone, forward and backward, on one layer's shapes (x the number of layers: their share of
the training step). Numbers are for the machine it runs on; the
2-core shared development machine is noisy (docs/cpu.md records one run and its spread).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import torch

from rlalign import ops
from rlalign.contract.profiles import use_profile
from rlalign.models import ForwardBatch, load_model
from rlalign.models.upcycle import upcycle
from rlalign.rollout.config import SamplingParams
from rlalign.rollout.engine import RolloutEngine

DEFAULT = Path(__file__).resolve().parents[1] / "rlalign" / "assets" / "default_model"
MOE_OPS = ("router_logits", "moe_route", "moe_experts", "moe_combine")


class OpTimer:
    """Wraps rlalign.ops' MoE functions (looked up at call time by models.moe) with wall-clock accumulators."""

    def __init__(self):
        self.seconds = collections.Counter()
        self._saved = {}

    def __enter__(self):
        for name in MOE_OPS:
            fn = self._saved[name] = getattr(ops, name)
            setattr(ops, name, self._timed(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(ops, name, fn)

    def _timed(self, name, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return run


def _prompts(n: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (int(torch.randint(8, 16, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def rollout(model, prompts) -> float:
    engine = RolloutEngine(model)
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(n=8, max_new_tokens=6, temperature=1.0, ignore_eos=True))
    return time.perf_counter() - t0


def train_step(model, seqs, targets) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    lp, ent = model.logprobs(ForwardBatch.packed(seqs), targets, with_entropy=True)
    (lp.sum() + 0.01 * ent.sum()).backward()
    return time.perf_counter() - t0


def _micro_batch(vocab: int, tokens: int = 4096) -> tuple[list[list[int]], torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    seqs, total = [], 0
    while total < tokens:
        n = min(int(torch.randint(14, 22, (1,), generator=gen)), tokens - total)
        seqs.append(torch.randint(3, vocab, (n,), generator=gen).tolist())
        total += n
    return seqs, torch.randint(0, vocab, (total,), generator=gen)


def route_and_combine(tokens: int, n_experts: int, top_k: int, hidden: int, dtype) -> float:
    """Seconds of ops.moe_route + ops.moe_combine, forward and backward, on one layer's shapes in isolation
    (the candidates for a compiled path: router_logits and moe_experts already run the strict linear)."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(tokens, n_experts, generator=gen).requires_grad_(True)
    y = torch.randn(tokens, top_k, hidden, generator=gen).to(dtype).requires_grad_(True)
    g = torch.randn(tokens, hidden, generator=gen).to(dtype)
    t0 = time.perf_counter()
    experts, weights = ops.moe_route(logits, top_k, normalize=True)
    out = ops.moe_combine(y, weights, experts)
    out.backward(g)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dense, _ = load_model(DEFAULT)
    models = {"dense": dense.eval(), "moe": upcycle(dense, 4, 2, seed=0).eval()}
    vocab = dense.config.vocab_size
    prompts, (seqs, targets) = _prompts(32, vocab), _micro_batch(vocab)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; rollout 32x8 prompts x 6 tokens; "
          f"train micro-batch {targets.numel()} tokens")
    with use_profile("strict"):
        for name, model in models.items():
            rollout(model, prompts[:2]), train_step(model, seqs[:4], targets[:sum(map(len, seqs[:4]))])  # warm-up
            for phase, fn, arg in (("rollout", rollout, (prompts,)), ("train step", train_step, (seqs, targets))):
                times, timer = [], OpTimer()
                with timer:
                    for _ in range(args.repeats):
                        times.append(fn(model, *arg))
                total = sum(times)
                line = (f"{name:5s} {phase:10s} median {statistics.median(times):7.3f} s  "
                        f"[{min(times):.3f}-{max(times):.3f}]")
                if name == "moe":
                    shares = ", ".join(f"{op} {timer.seconds[op] / total:5.1%}" for op in MOE_OPS)
                    line += f"  forward share: {shares}"
                print(line)
        cfg = models["moe"].config
        per_layer = [route_and_combine(targets.numel(), 4, 2, cfg.hidden_size, models["moe"].dtype)
                     for _ in range(args.repeats + 1)][1:]
        print(f"moe_route + moe_combine forward+backward alone, one layer of the train micro-batch: median "
              f"{statistics.median(per_layer) * 1e3:.1f} ms x {cfg.num_layers} layers")


if __name__ == "__main__":
    main()
