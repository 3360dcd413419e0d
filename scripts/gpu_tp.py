"""Tensor-parallel degrees vs TP=1 on a Qwen3-8B-shaped random-init model: bits and step time per degree.

    python scripts/gpu_tp.py --out /tmp/tp                      # 2 GPUs, NCCL, bf16, --layers 8 (of 36)
    python scripts/gpu_tp.py --out /tmp/tp --tp 1,2,4,8 --layers 36   # 8 GPUs: the full shape at every degree
    python scripts/gpu_tp.py --out /tmp/tp --tp 4               # 4 GPUs (TP=4 vs TP=1 only)
    python scripts/gpu_tp.py --out /tmp/tp --tp 1,2,4 --smoke   # CPU + gloo, a tiny Qwen3 shape (what CI runs)

``--tp`` lists the degrees (TP=1, the reference, is always added). One process per GPU for the largest
degree (NCCL; gloo with --smoke); TP=t runs on ranks 0..t-1 while the others wait. Every rank builds the
same random weights (a seeded generator per parameter, on the device). Then:

1. rank 0 scores one packed batch (``--seqs`` x ``--seq-len`` tokens) with the unsharded model (the
   rollout side's ops) and with ``parallelize(model, Group.single())`` (TP=1): log-prob, entropy, and the
   gradients of a loss that uses both; TP=1's outputs and gathered gradients are kept as the reference;
2. for each degree t > 1, ranks 0..t-1 shard the model (TP=t) and do the same; rank 0 compares the
   log-probs, entropies, loss and every full (gathered) gradient with TP=1's, raw bits;
3. ``--steps`` training steps (forward + backward, after ``--warmup``) are timed at every degree in the
   strict profile and in the native profile (cuBLAS, stock NCCL all-reduce); TP=1's times are the
   unsharded model's (the single-GPU baseline).

Rank 0 writes ``gpu_tp.json`` under ``--out`` (rewritten before each degree with ``"complete": false``, so
a run cut short keeps what finished): per degree ``tp{t}_vs_tp1`` (differing elements of each
output and gradient, worst |diff|), ``tp{t}_equals_tp1_bitwise``, ``time_tp{t}_{strict,native}``,
``tp{t}_strict_over_native``; ``tp1_vs_unsharded`` (log-prob and entropy must be equal: the forward at
any degree is the rollout's); ``step_time_s`` (median per degree and profile) and ``all_degrees_equal``.
A phase that raises is recorded with its error and the rest still runs; the exit status is 0 only when
every degree equals TP=1 bitwise. ``--layers`` cuts the depth (36 = the real 8B); the JSON says which
depth ran. Nothing is downloaded; NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
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
import torch.distributed as dist  # noqa: E402

from rlalign.bench.rollout import PRESETS  # noqa: E402
from rlalign.contract.errors import RLAlignError  # noqa: E402
from rlalign.contract.profiles import use_profile  # noqa: E402
from rlalign.distributed import full_state, parallelize, spawn  # noqa: E402
from rlalign.distributed.launch import Group  # noqa: E402
from rlalign.distributed.parallelize import check_tp  # noqa: E402
from rlalign.models import ForwardBatch  # noqa: E402
from rlalign.models.config import ModelConfig  # noqa: E402
from rlalign.models.decoder import CausalLM  # noqa: E402
from rlalign.parity.tp import parse_degrees  # noqa: E402

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


def count_differing(x: torch.Tensor, y: torch.Tensor) -> dict:
    """Elements whose raw bits differ (NaN equals NaN), the first differing index and values, the worst |diff|."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return {"differ": -1, "of": x.numel(), "note": f"{tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"}
    same = (x == y) & (torch.signbit(x) == torch.signbit(y)) if x.is_floating_point() else x == y
    if x.is_floating_point():
        same |= torch.isnan(x) & torch.isnan(y)
    differ = int((~same).sum())
    out = {"differ": differ, "of": x.numel(), "max_abs": float((x.float() - y.float()).abs().max()) if x.numel() else 0.0}
    if differ:
        first = int((~same).reshape(-1).nonzero()[0])
        out["first"] = {"index": first, "a": float(x.reshape(-1)[first]), "b": float(y.reshape(-1)[first])}
    return out


def mismatches(a: dict, b: dict) -> dict:
    """Counts of differing elements (raw bits) per output and, when both have them, per gradient."""
    out = {k: count_differing(a[k], b[k]) for k in ("lp", "ent", "loss")}
    if "grads" in a and "grads" in b:
        names = sorted(set(a["grads"]) | set(b["grads"]))
        grads = {n: count_differing(a["grads"][n], b["grads"][n]) if n in a["grads"] and n in b["grads"]
                 else {"differ": -1, "note": "gradient on one side only"} for n in names}
        out["grads_differ_total"] = sum(abs(g["differ"]) for g in grads.values())
        out["grads_params_differing"] = [n for n, g in grads.items() if g["differ"]]
        out["grads_compared"] = len(grads)
        out["grads"] = grads
    return out


def bitwise_equal(m: dict) -> bool:
    return bool(m) and all(m[k]["differ"] == 0 for k in ("lp", "ent", "loss")) \
        and m.get("grads_compared", 0) > 0 and m.get("grads_differ_total", 1) == 0


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


def degree_groups(world: Group, degrees) -> dict[int, Group | None]:
    """{t: ranks 0..t-1 as a group (None on the other ranks)}; every rank creates every group, in order."""
    groups = {}
    for t in degrees:
        if t == 1:
            groups[t] = Group.single() if world.rank == 0 else None
        elif t == world.size:
            groups[t] = world
        else:
            pg = dist.new_group(list(range(t)))
            groups[t] = Group(pg, world.rank, t) if world.rank < t else None
    return groups


def time_both_profiles(report: dict, key: str, model, args, batch, targets, weights, device) -> None:
    for profile in ("strict", "native"):
        phase(report, f"time_{key}_{profile}",
              lambda: timed_steps(model, batch, targets, weights, profile, args.warmup, args.steps, device))
    strict, native = report.get(f"time_{key}_strict", {}), report.get(f"time_{key}_native", {})
    if "median_s" in strict and "median_s" in native:
        report[f"{key}_strict_over_native"] = strict["median_s"] / native["median_s"]


def reference_tp1(report: dict, config, dtype, device, args, batch, targets, weights) -> dict | None:
    """Rank 0: the unsharded model's and TP=1's outputs, TP=1's gradients (the reference); TP=1 step times."""
    results: dict = {}

    def unsharded():
        results["plain"] = step(build(config, dtype, device, args.seed), batch, targets, weights, want_grads=False)
        return "ok"

    def tp1():
        results["tp1"] = step(parallelize(build(config, dtype, device, args.seed), Group.single()), batch, targets,
                              weights, want_grads=True)
        return "ok"

    phase(report, "unsharded_step", unsharded)
    phase(report, "tp1_step", tp1)
    if "tp1" in results and "plain" in results:
        # the forward at every degree is the rollout's: log-prob and entropy must match the unsharded model
        report["tp1_vs_unsharded"] = mismatches(results["tp1"], results["plain"])
    if args.tp1_timing:
        model = build(config, dtype, device, args.seed)
        time_both_profiles(report, "tp1", model, args, batch, targets, weights, device)
        del model
    _free(device)
    return results.get("tp1")


def run_degree(report: dict, t: int, group: Group, reference, config, dtype, device, args, batch, targets, weights):
    """Ranks 0..t-1: TP=t's outputs and gathered gradients vs the TP=1 reference (rank 0), then step times."""
    key = f"tp{t}"
    results: dict = {}

    def sharded_step():
        results[key] = step(parallelize(build(config, dtype, device, args.seed), group), batch, targets, weights,
                            want_grads=True)
        return "ok"

    phase(report, f"{key}_step", sharded_step)
    if group.rank == 0 and reference is not None and key in results:
        report[f"{key}_vs_tp1"] = mismatches(results[key], reference)
    results.clear()
    _free(device)
    model = parallelize(build(config, dtype, device, args.seed), group)
    time_both_profiles(report, key, model, args, batch, targets, weights, device)
    del model
    _free(device)


def _free(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def worker(world: Group, args) -> dict | None:
    device = torch.device(f"cuda:{world.rank}") if not args.smoke else torch.device("cpu")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    config = model_config(args)
    batch, targets, weights = make_batch(config, args.seqs, args.seq_len, device)
    groups = degree_groups(world, args.degrees)
    report: dict = {}
    reference = reference_tp1(report, config, dtype, device, args, batch, targets, weights) if world.rank == 0 else None
    for t in args.degrees:
        if t == 1:
            continue
        if world.rank == 0:
            write_doc(args, report, complete=False)   # what is done so far survives a run cut short
        if world.size > 1:
            dist.barrier()   # the ranks outside TP=t wait here while TP=t runs
        if groups[t] is not None:
            run_degree(report, t, groups[t], reference, config, dtype, device, args, batch, targets, weights)
    if device.type == "cuda":
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return report if world.rank == 0 else None


def environment(args) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "smoke": args.smoke,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL"))}}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def summarize(doc: dict, degrees) -> dict:
    """Per-degree verdicts and step times (added to the JSON and printed)."""
    for t in degrees:
        if t > 1:
            doc[f"tp{t}_equals_tp1_bitwise"] = bitwise_equal(doc.get(f"tp{t}_vs_tp1", {}))
    doc["step_time_s"] = {str(t): {p: doc.get(f"time_tp{t}_{p}", {}).get("median_s") for p in ("strict", "native")}
                          for t in degrees}
    unsharded = doc.get("tp1_vs_unsharded", {})
    forward_ok = bool(unsharded) and unsharded["lp"]["differ"] == 0 and unsharded["ent"]["differ"] == 0
    doc["all_degrees_equal"] = forward_ok and all(doc[f"tp{t}_equals_tp1_bitwise"] for t in degrees if t > 1)
    summary = {"all_degrees_equal": doc["all_degrees_equal"], "layers": doc["model"]["layers"],
               "logprob_mismatches_tp1_vs_unsharded": unsharded.get("lp", {}).get("differ")}
    for t in degrees:
        if t > 1:
            summary[f"tp{t}_equals_tp1_bitwise"] = doc[f"tp{t}_equals_tp1_bitwise"]
            summary[f"logprob_mismatches_tp{t}_vs_tp1"] = doc.get(f"tp{t}_vs_tp1", {}).get("lp", {}).get("differ")
    summary["step_time_s"] = doc["step_time_s"]
    summary["errors"] = sorted(k for k, v in doc.items() if isinstance(v, dict) and "error" in v)
    return summary


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu_tp.json")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the 8B shape (36 = full depth)")
    p.add_argument("--tp", default="2", help="tensor-parallel degrees, e.g. 2 or 1,2,4,8 (TP=1 is always run); "
                                            "the largest is the number of GPUs used")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tp1-timing", dest="tp1_timing", action="store_false",
                   help="skip the single-GPU strict/native step times")
    p.add_argument("--smoke", action="store_true", help="CPU + gloo, tiny Qwen3 shape (no GPU needed)")
    args = p.parse_args(argv)
    args.degrees = tuple(sorted(set(parse_degrees(args.tp)) | {1}))
    if args.smoke:
        args.seqs, args.seq_len = min(args.seqs, 4), min(args.seq_len, 48)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    return args


def write_doc(args, report: dict, complete: bool) -> dict:
    """gpu_tp.json: environment, shape, the report so far and (complete) the per-degree verdicts and times."""
    config = model_config(args)
    doc = {"environment": environment(args), "model": {"shape": "qwen3-8b" if not args.smoke else "tiny qwen3",
                                                       "layers": config.num_layers, "full_depth_layers": 36,
                                                       "vocab": config.vocab_size,
                                                       "dtype": "float32" if args.smoke else "bfloat16"},
           "batch": {"seqs": args.seqs, "seq_len": args.seq_len, "tokens": args.seqs * args.seq_len},
           "timing": {"steps": args.steps, "warmup": args.warmup}, "degrees": list(args.degrees),
           "processes": max(args.degrees), "wall_s": time.time() - args.started, "complete": complete, **report}
    if complete:
        doc["summary"] = summarize(doc, args.degrees)
    out = Path(args.out)
    (out / "gpu_tp.json.tmp").write_text(json.dumps(doc, indent=2))
    (out / "gpu_tp.json.tmp").replace(out / "gpu_tp.json")
    return doc


def main(argv=None) -> int:
    args = parse_args(argv)
    config = model_config(args)
    ranks = max(args.degrees)
    try:
        for t in args.degrees:
            check_tp(config, t, CausalLM(config, device="meta"))
    except RLAlignError as exc:
        print(f"gpu_tp.py: {exc} (--tp {args.tp}, {config.num_layers}-layer shape)", file=sys.stderr)
        return 2
    if not args.smoke and torch.cuda.device_count() < ranks:
        print(f"gpu_tp.py: --tp {args.tp} needs {ranks} GPUs, found {torch.cuda.device_count()} "
              "(use --smoke on a CPU)", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.started = time.time()
    report = spawn(worker, ranks, args, backend="gloo" if args.smoke else "nccl")[0]
    doc = write_doc(args, report, complete=True)
    print(json.dumps(doc["summary"]))
    print(f"wrote {Path(args.out) / 'gpu_tp.json'}")
    return 0 if doc["all_degrees_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
