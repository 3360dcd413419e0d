"""One training step (forward + backward of a policy-gradient-shaped loss): fused vs naive loss.

    python bench/train_step_memory.py [--tokens 4096 --hidden 256 --layers 2 --vocab 151936] [--json]

Same model, same packed batch, same loss ``-(advantage * logprob).mean()`` over every token:

    fused:  CausalLM.forward_hidden -> ops.logprob_entropy (strict; chunked, custom backward; no [T, V] logits)
    naive:  CausalLM.forward_hidden -> log_softmax(hidden.float() @ W.float().T).gather(...)  (materialises [T, V])

Each method runs in a fresh subprocess; peak extra memory = peak RSS during the step minus RSS
after the model and batch are built (the method in bench/logprob_memory.py). Time is the
wall-clock of the step (one warm-up step on a small batch first). Ratios fused/naive are printed
and appended as a dated row to bench/RESULTS.md by hand (with the command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from logprob_memory import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402


def build(args):
    import torch
    from rlalign.models.testing import tiny_model
    model = tiny_model("qwen3", hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4, vocab_size=args.vocab,
                       tie_word_embeddings=True, max_position_embeddings=4096).train()
    from rlalign.models.batch import ForwardBatch
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, args.vocab, (args.seq_len,), generator=g).tolist()
            for _ in range(args.tokens // args.seq_len)]
    batch = ForwardBatch.packed(seqs)
    targets = torch.randint(0, args.vocab, (batch.num_tokens,), generator=g)
    adv = torch.randn(batch.num_tokens, generator=g)
    return model, batch, targets, adv


def step(model, batch, targets, adv, method):
    import torch
    from rlalign import ops
    hidden = model.forward_hidden(batch)
    w = model.lm_head_weight
    if method == "fused":
        lp, _ = ops.logprob_entropy(hidden, w, targets)
    else:
        lp = torch.log_softmax(hidden.float() @ w.float().t(), -1).gather(1, targets[:, None])[:, 0]
    loss = -(adv * lp).mean()
    loss.backward()
    return float(loss.detach())


def worker(args) -> dict:
    import torch
    model, batch, targets, adv = build(args)
    small = build(argparse.Namespace(**{**vars(args), "tokens": args.seq_len}))
    step(*small, args.method)   # warm-up: thread pools, code paths
    model.zero_grad(set_to_none=True)
    del small
    base = rss_bytes()
    reset_peak_rss()
    t0 = time.perf_counter()
    loss = step(model, batch, targets, adv, args.method)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    grad_norm = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])))
    return {"method": args.method, "peak_extra_mb": (peak - base) / 2**20, "seconds": seconds, "loss": loss,
            "grad_norm": grad_norm}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--json", action="store_true")
    p.add_argument("--method", choices=["fused", "naive"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.method:
        print(json.dumps(worker(args)))
        return 0
    rows = {}
    for method in ("naive", "fused"):
        cmd = [sys.executable, __file__, "--method", method] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                              if k not in ("json", "method")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[method] = json.loads(out.stdout.strip().splitlines()[-1])
    import torch
    result = {
        "name": "train_step_memory", "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "shape": {k: v for k, v in vars(args).items() if k not in ("json", "method")}, "rows": list(rows.values()),
        "ratios": {"peak_extra_memory_fused_over_naive": rows["fused"]["peak_extra_mb"] / rows["naive"]["peak_extra_mb"],
                   "time_fused_over_naive": rows["fused"]["seconds"] / rows["naive"]["seconds"],
                   "grad_norm_rel_diff": abs(rows["fused"]["grad_norm"] - rows["naive"]["grad_norm"]) / rows["naive"]["grad_norm"]},
    }
    if args.json:
        print(json.dumps(result))
    else:
        for r in result["rows"]:
            print(f"{r['method']:>6}: peak extra {r['peak_extra_mb']:9.1f} MiB   step {r['seconds']:6.2f} s   loss {r['loss']:.6f}")
        for k, v in result["ratios"].items():
            print(f"{k}: {v:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
