"""Portable profile check: a rollout recorded on the GPU scores bit for bit on the CPU, and the reverse; timings.

Builds a small seeded Qwen3-shaped fp32 checkpoint (rlalign.models.testing; nothing downloaded), then:

* records a portable rollout on CUDA and scores it on the CPU (``rlalign parity --replay``), and records one on
  the CPU and scores it on CUDA: mismatches must be 0 both ways;
* compares the two records raw: the same tokens and the same logprob bits from either device;
* compares every portable op's output bits CPU vs CUDA on random inputs;
* times each op (median of a few calls) and the whole parity run, portable vs strict, on both devices.

Prints one JSON object (and writes it to --out when given). Without CUDA it runs the CPU half (and says so).

    python benchmarks/portable_check.py [--out FILE] [--layers 4] [--hidden 256] [--new-tokens 24]
    python benchmarks/portable_check.py --train-steps 3 [--out FILE]

``--train-steps N`` checks training instead: the embedded default run (``rlalign train run.profile=portable``, fp32)
stopped after N steps on the CPU and on CUDA; the two runs' fingerprints (benchmarks/run_fingerprint.py: every
logged value but timings and memory, and the final weights) must be equal.

Budget: well under 4 minutes on one H100 with 16 CPU cores at the defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlalign import ops  # noqa: E402
from rlalign.contract import use_profile  # noqa: E402
from rlalign.contract.bits import describe_difference  # noqa: E402
from rlalign.models.testing import make_tiny_checkpoint  # noqa: E402
from rlalign.parity.replay import RolloutRecord  # noqa: E402
from rlalign.parity.run import ParityOptions, run_parity  # noqa: E402


def build_model(directory: Path, args) -> Path:
    """A Qwen3-shaped fp32 checkpoint (GQA, q/k norms, tied embeddings off), seeded."""
    heads = args.hidden // args.head_dim
    return make_tiny_checkpoint(directory, "qwen3", seed=args.seed, dtype="float32", init_std=0.05,
                                hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                num_hidden_layers=args.layers, num_attention_heads=heads,
                                num_key_value_heads=max(1, heads // 2), head_dim=args.head_dim,
                                vocab_size=args.vocab, tie_word_embeddings=False)


def parity(model: Path, device: str, profile: str, args, **kw) -> tuple[object, float]:
    start = time.perf_counter()
    result = run_parity(ParityOptions(model=str(model), device=device, profile=profile, prompts=args.prompts,
                                      samples=args.samples, max_new_tokens=args.new_tokens, temperature=0.8,
                                      top_k=20, top_p=0.95, seed=args.seed, **kw))
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def _bits(values) -> list[bytes]:
    return [struct.pack("<f", v) for v in values]


def compare_records(a: RolloutRecord, b: RolloutRecord) -> dict:
    """Tokens and raw logprob bits of two records of the same prompts and seeds."""
    tokens = sum(s.tokens != t.tokens for s, t in zip(a.sequences, b.sequences))
    bits = sum(_bits(s.logprobs) != _bits(t.logprobs) for s, t in zip(a.sequences, b.sequences))
    return {"sequences": len(a.sequences), "token_sequences_differing": tokens, "logprob_sequences_differing": bits}


def op_cases(t: int, h: int, heads: int, kv: int, d: int, vocab: int):
    """(name, inputs on the CPU, call) for every portable op; inputs seeded."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    lens = [t // 2, t - t // 2]
    cu = torch.tensor([0, lens[0], t])
    page = 16
    pages = -(-max(lens) // page)
    table = torch.arange(2 * pages).reshape(2, pages)
    slots = torch.cat([table[s].repeat_interleave(page)[:n] * page + torch.arange(n) % page for s, n in enumerate(lens)])
    inv_freq = ops.rope_inv_freq(d, 1e6)
    yield "linear", (r(t, h), r(3 * h, h, scale=0.05)), lambda x, w: ops.linear(x, w)
    yield "rms_norm", (r(t, h), r(h)), lambda x, w: ops.rms_norm(x, w, 1e-6)
    yield "rope_tables", (torch.arange(t) * 37,), lambda p: ops.rope_cos_sin(p, inv_freq.to(p.device))
    yield "rope", (r(t, heads, d), *ops.rope_cos_sin(torch.arange(t), inv_freq, profile="portable")), ops.rope
    yield "silu_mul", (r(t, 3 * h), r(t, 3 * h)), ops.silu_mul
    yield "attention_varlen", (r(t, heads, d), r(t, kv, d), r(t, kv, d), cu), ops.attention_varlen

    def paged(q, k, v, table, slots, cu):
        kc = torch.zeros(table.numel(), page, kv, d, device=q.device)
        vc = torch.zeros_like(kc)
        ops.write_kv_cache(k, v, kc, vc, slots)
        return ops.attention_paged(q, kc, vc, table, torch.tensor(lens, device=q.device), cu)

    yield "attention_paged", (r(t, heads, d), r(t, kv, d), r(t, kv, d), table, slots, cu), paged
    yield "logprob_entropy", (r(t, h), r(vocab, h, scale=0.05), torch.arange(t) % vocab), \
        lambda x, w, y: ops.logprob_entropy(x, w, y, temperature=0.8)
    yield "sample", (r(t, vocab, scale=3.0), ), lambda z: ops.sample(
        z, seeds=5, seq_ids=torch.arange(t, device=z.device), positions=7, temperature=0.8, top_k=20, top_p=0.9)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn, device: str, reps: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def op_checks(args, devices: list[str], profiles: tuple[str, ...]) -> dict:
    """Per op: CPU vs CUDA bits (portable), and ms per call portable vs strict on each device."""
    out = {}
    heads = args.hidden // args.head_dim
    for name, inputs, call in op_cases(args.op_tokens, args.hidden, heads, max(1, heads // 2), args.head_dim,
                                       args.vocab):
        row = {}
        results = {}
        for device in devices:
            moved = tuple(x.to(device) for x in inputs)
            for profile in profiles:
                with use_profile(profile), torch.no_grad():
                    row[f"{profile}_{device}_ms"] = round(time_call(lambda: call(*moved), device, args.reps), 3)
                    if profile == "portable":
                        res = call(*moved)
                        results[device] = tuple(x.cpu() for x in (res if isinstance(res, tuple) else (res, ))
                                                if x is not None)
        if "cuda" in results:
            diffs = [describe_difference(a, b) for a, b in zip(results["cpu"], results["cuda"])]
            row["cpu_vs_cuda"] = "identical" if all(d == "identical" for d in diffs) else "; ".join(diffs)
        out[name] = row
    return out


def train_run(run_dir: Path, device: str, steps: int) -> tuple[dict, float]:
    """The default run in the portable profile on ``device``, stopped after ``steps`` steps: (fingerprint, seconds)."""
    from benchmarks.run_fingerprint import fingerprint
    from rlalign.configlib import load_config
    from rlalign.train.config import TrainConfig
    from rlalign.train.loop import run_training
    cfg = load_config(TrainConfig, None, [f"run.dir={run_dir}", "run.profile=portable", f"run.stop_at_step={steps}",
                                          "run.progress=false", f"model.device={device}"])
    start = time.perf_counter()
    run_training(cfg)
    return fingerprint(run_dir, steps), time.perf_counter() - start


def train_check(steps: int, devices: list[str]) -> dict:
    """``--train-steps``: the default portable run's first ``steps`` steps on each device, fingerprints compared."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for device in devices:
            fp, seconds = train_run(Path(tmp) / f"train-{device}", device, steps)
            out[device] = {**fp, "seconds": round(seconds, 1)}
    if "cuda" in out:
        out["cpu_equals_cuda"] = all(out["cpu"][k] == out["cuda"][k] for k in ("metrics_sha256", "weights_sha256"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--op-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-strict", action="store_true", help="skip the strict timings (no Triton compilation)")
    p.add_argument("--train-steps", type=int, default=0,
                   help="check training instead: the default portable run's first N steps, CPU vs CUDA fingerprints")
    args = p.parse_args(argv)
    if args.train_steps > 0:
        return _report_training(args)
    profiles = ("portable", ) if args.no_strict else ("portable", "strict")
    torch.manual_seed(args.seed)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    report = {"devices": devices, "cpu_threads": torch.get_num_threads(),
              "gpu": torch.cuda.get_device_name() if "cuda" in devices else None,
              "model": {"layers": args.layers, "hidden": args.hidden, "head_dim": args.head_dim, "vocab": args.vocab,
                        "dtype": "float32"},
              "rollout": {"prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens,
                          "temperature": 0.8, "top_k": 20, "top_p": 0.95}}
    report["ops"] = op_checks(args, devices, profiles)   # first: the strict Triton kernels compile here, not below
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", args)
        records, e2e = {}, {}
        for device in devices:
            path = Path(tmp) / f"rollout-{device}.jsonl"
            result, seconds = parity(model, device, "portable", args, record=str(path))
            records[device] = RolloutRecord.load(path)
            e2e[f"portable_{device}_s"] = round(seconds, 2)
            e2e[f"portable_{device}_same_device_mismatches"] = result.tokens.mismatches
            if not args.no_strict:
                _, seconds = parity(model, device, "strict", args)
                e2e[f"strict_{device}_s"] = round(seconds, 2)
        report["end_to_end"] = e2e
        if "cuda" in devices:
            cross = {}
            for rec_dev, score_dev in (("cuda", "cpu"), ("cpu", "cuda")):
                result, seconds = parity(model, score_dev, "portable", args,
                                         replay=str(Path(tmp) / f"rollout-{rec_dev}.jsonl"))
                cross[f"recorded_{rec_dev}_scored_{score_dev}"] = {
                    "tokens": result.tokens.tokens_compared, "mismatches": result.tokens.mismatches,
                    "max_abs_diff": result.tokens.max_abs_diff, "seconds": round(seconds, 2)}
            cross["records_cpu_vs_cuda"] = compare_records(records["cpu"], records["cuda"])
            report["cross_device"] = cross
    ok = all(report["end_to_end"][f"portable_{d}_same_device_mismatches"] == 0 for d in devices)
    if "cuda" in devices:
        cross = report["cross_device"]
        ok = ok and all(v["mismatches"] == 0 for k, v in cross.items() if k.startswith("recorded"))
        ok = ok and cross["records_cpu_vs_cuda"]["token_sequences_differing"] == 0
        ok = ok and cross["records_cpu_vs_cuda"]["logprob_sequences_differing"] == 0
        ok = ok and all(row.get("cpu_vs_cuda") == "identical" for row in report["ops"].values())
    report["ok"] = ok
    text = json.dumps(report, sort_keys=True)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if ok else 1


def _report_training(args) -> int:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    report = {"devices": devices, "cpu_threads": torch.get_num_threads(),
              "gpu": torch.cuda.get_device_name() if "cuda" in devices else None,
              "train": train_check(args.train_steps, devices)}
    report["ok"] = report["train"].get("cpu_equals_cuda", True)
    text = json.dumps(report, sort_keys=True)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
