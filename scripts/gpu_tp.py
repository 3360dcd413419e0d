"""TP=N (default 2) vs TP=1 on a Qwen3-8B-shaped random-init model, and strict vs native TP=N step time.

    python scripts/gpu_tp.py --out /tmp/tp                 # 2 GPUs, NCCL, bf16, --layers 8 (of 36)
    python scripts/gpu_tp.py --out /tmp/tp --tp 4          # 4 GPUs (keys say tp4 instead of tp2)
    python scripts/gpu_tp.py --out /tmp/tp --layers 36     # the full depth (slower to build and step)
    python scripts/gpu_tp.py --out /tmp/tp --smoke         # CPU + gloo, a tiny Qwen3 shape (what CI can run)

Two processes (one per GPU) build the same random weights (a seeded generator per parameter, on
the device), then each:

1. scores one packed batch (``--seqs`` x ``--seq-len`` tokens) with the unsharded model (the
   rollout side's ops) and with ``parallelize(model, Group.single())`` (TP=1): logprob, entropy,
   and the gradients of a loss that uses both;
2. shards the model over the N ranks (TP=N) and does the same;
3. times ``--steps`` training steps (forward + backward, after ``--warmup``) at TP=N in the strict
   profile and in the native profile (cuBLAS, stock NCCL all-reduce), and at TP=1 for reference.

Rank 0 writes ``gpu_tp.json`` under ``--out``: mismatch counts (logprob, entropy, loss, every
gradient) of TP=N vs TP=1 and of TP=1 vs the unsharded model, the step times and the
strict/native ratio. A phase that raises is recorded with its error and the rest still runs.
``--layers`` cuts the depth (36 for the real 8B); the JSON says which depth ran. Nothing is
downloaded; NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402

from rlalign.contract.profiles import use_profile  # noqa: E402
from rlalign.distributed import full_state, parallelize, spawn  # noqa: E402
from rlalign.distributed.launch import Group  # noqa: E402
from rlalign.models import ForwardBatch  # noqa: E402
from rlalign.models.config import ModelConfig  # noqa: E402
from rlalign.models.decoder import CausalLM  # noqa: E402
from rlalign.bench.rollout import PRESETS  # noqa: E402

SMOKE_SHAPE = dict(PRESETS["qwen3-8b"], vocab_size=3000, hidden_size=128, intermediate_size=256,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_hidden_layers=2)


def model_config(args) -> ModelConfig:
    hf = dict(SMOKE_SHAPE) if args.smoke else dict(PRESETS["qwen3-8b"])
    if args.layers and not args.smoke:
        hf["num_hidden_layers"] = args.layers
    return ModelConfig.from_hf_dict(hf)


@torch.no_grad()
def build(config: ModelConfig, dtype, device, seed: int) -> CausalLM:
    """The same weights on every rank: parameter i ~ N(0, 0.02) from a generator seeded (seed, i) on the device."""
    model = CausalLM(config, dtype=dtype, device=device)
    for i, (name, p) in enumerate(model.named_parameters()):
        gen = torch.Generator(device=device).manual_seed(seed * 100003 + i)
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_((torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype))
    return model.train()


def make_batch(config, seqs: int, seq_len: int, device):
    gen = torch.Generator().manual_seed(1234)
    tokens = [torch.randint(0, config.vocab_size, (seq_len,), generator=gen).tolist() for _ in range(seqs)]
    targets = torch.randint(0, config.vocab_size, (seqs * seq_len,), generator=gen)
    weights = torch.randn(seqs * seq_len, generator=gen)
    return ForwardBatch.packed(tokens, device=device), targets.to(device), weights.to(device)


def step(model, batch, targets, weights, want_grads: bool):
    """One training step's forward + backward; returns outputs (and gathered full gradients)."""
    model.zero_grad(set_to_none=True)
    lp, ent = model.logprobs(batch, targets, with_entropy=True)
    loss = (weights * lp).sum() / targets.numel() + 0.01 * ent.mean()
    loss.backward()
    out = {"lp": lp.detach(), "ent": ent.detach(), "loss": loss.detach()}
    if want_grads:
        out["grads"] = full_state(model, grads=True)
    model.zero_grad(set_to_none=True)
    return out


def mismatches(a: dict, b: dict) -> dict:
    """Counts of differing elements (raw bits) per output and per gradient, plus the worst |diff|."""
    def count(x, y):
        if x.shape != y.shape:
            return {"differ": -1, "of": x.numel(), "note": f"shapes {tuple(x.shape)} vs {tuple(y.shape)}"}
        diff = ~((x == y) | (torch.isnan(x) & torch.isnan(y)))
        return {"differ": int(diff.sum()), "of": x.numel(), "max_abs": float((x.float() - y.float()).abs().max())}
    out = {k: count(a[k], b[k]) for k in ("lp", "ent", "loss")}
    if "grads" in a and "grads" in b:
        grads = {n: count(g, b["grads"][n]) for n, g in a["grads"].items()}
        out["grads_differ_total"] = sum(g["differ"] for g in grads.values())
        out["grads_params_differing"] = [n for n, g in grads.items() if g["differ"]]
        out["grads"] = grads
    return out


def timed_steps(model, batch, targets, weights, profile: str, warmup: int, steps: int, device) -> dict:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    with use_profile(profile):
        for _ in range(warmup):
            step(model, batch, targets, weights, want_grads=False)
        times = []
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            step(model, batch, targets, weights, want_grads=False)
            sync()
            times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "all_s": times}


def phase(report: dict, name: str, fn):
    try:
        report[name] = fn()
    except Exception as exc:  # noqa: BLE001 -- record the failure, keep measuring the rest
        report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    return report[name]


def worker(world: Group, args) -> dict | None:
    device = torch.device(f"cuda:{world.rank}") if not args.smoke else torch.device("cpu")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    config = model_config(args)
    batch, targets, weights = make_batch(config, args.seqs, args.seq_len, device)
    report: dict = {}
    results: dict = {}
    tpn_key = f"tp{args.tp}"

    def unsharded():
        results["plain"] = step(build(config, dtype, device, args.seed), batch, targets, weights, want_grads=True)
        return "ok"

    def tp1():
        results["tp1"] = step(parallelize(build(config, dtype, device, args.seed), Group.single()), batch, targets,
                              weights, want_grads=True)
        return "ok"

    def tpn():
        results[tpn_key] = step(parallelize(build(config, dtype, device, args.seed), world), batch, targets, weights,
                              want_grads=True)
        return "ok"

    phase(report, "unsharded_step", unsharded)
    phase(report, "tp1_step", tp1)
    phase(report, f"{tpn_key}_step", tpn)
    if "tp1" in results and tpn_key in results:
        report[f"{tpn_key}_vs_tp1"] = mismatches(results[tpn_key], results["tp1"])
    if "tp1" in results and "plain" in results:
        report["tp1_vs_unsharded"] = mismatches(results["tp1"], results["plain"])
    results.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    model = parallelize(build(config, dtype, device, args.seed), world)
    for profile in ("strict", "native"):
        phase(report, f"time_{tpn_key}_{profile}",
              lambda: timed_steps(model, batch, targets, weights, profile, args.warmup, args.steps, device))
    del model
    if args.tp1_timing:
        model = build(config, dtype, device, args.seed)
        for profile in ("strict", "native"):
            phase(report, f"time_tp1_{profile}",
                  lambda: timed_steps(model, batch, targets, weights, profile, args.warmup, args.steps, device))
        del model
    strict, native = report.get(f"time_{tpn_key}_strict", {}), report.get(f"time_{tpn_key}_native", {})
    if "median_s" in strict and "median_s" in native:
        report[f"{tpn_key}_strict_over_native"] = strict["median_s"] / native["median_s"]
    if device.type == "cuda":
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return report if world.rank == 0 else None


def environment(args) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "smoke": args.smoke,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu_tp.json")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the 8B shape (36 = full depth)")
    p.add_argument("--tp", type=int, default=2, choices=(2, 4, 8), help="tensor-parallel degree (GPUs)")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tp1-timing", dest="tp1_timing", action="store_false",
                   help="skip the single-GPU strict/native step times")
    p.add_argument("--smoke", action="store_true", help="CPU + gloo, tiny Qwen3 shape (no GPU needed)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seqs, args.seq_len, args.steps, args.warmup = min(args.seqs, 4), min(args.seq_len, 48), 2, 1
    elif torch.cuda.device_count() < args.tp:
        print(f"gpu_tp.py: needs {args.tp} GPUs, found {torch.cuda.device_count()} (use --smoke on a CPU)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(args)
    started = time.perf_counter()
    report = spawn(worker, args.tp, args, backend="gloo" if args.smoke else "nccl")[0]
    doc = {"environment": environment(args), "model": {"shape": "qwen3-8b" if not args.smoke else "tiny qwen3",
                                                       "layers": config.num_layers, "full_depth_layers": 36,
                                                       "dtype": "float32" if args.smoke else "bfloat16"},
           "batch": {"seqs": args.seqs, "seq_len": args.seq_len, "tokens": args.seqs * args.seq_len},
           "timing": {"steps": args.steps, "warmup": args.warmup}, "wall_s": time.perf_counter() - started,
           **report}
    key = f"tp{args.tp}"
    tp = doc.get(f"{key}_vs_tp1", {})
    doc["tp"] = args.tp
    doc[f"{key}_equals_tp1_bitwise"] = bool(tp) and all(tp[k]["differ"] == 0 for k in ("lp", "ent", "loss")) \
        and tp.get("grads_differ_total", 1) == 0
    (out / "gpu_tp.json").write_text(json.dumps(doc, indent=2))
    summary = {k: doc.get(k) for k in (f"{key}_equals_tp1_bitwise", f"{key}_strict_over_native")}
    summary[f"logprob_mismatches_{key}_vs_tp1"] = tp.get("lp", {}).get("differ")
    summary["logprob_mismatches_tp1_vs_unsharded"] = doc.get("tp1_vs_unsharded", {}).get("lp", {}).get("differ")
    print(json.dumps(summary))
    print(f"wrote {out / 'gpu_tp.json'}")
    return 0 if doc[f"{key}_equals_tp1_bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
