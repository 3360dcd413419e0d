"""One training micro-step on Qwen3-8B shapes: strict vs native vs stock transformers, in one run.

    python benchmarks/train_step.py --device cuda [--layers 6 --tokens 8192] [--json] [--out FILE]   # the H200 figure
    python benchmarks/train_step.py --shape tiny --device cpu --iters 2 --json             # seconds, for CI
    python benchmarks/train_step.py --device cuda --variants strict,strict_keep              # recompute on vs off

The micro-step (what one micro-batch of a GRPO update costs), same weights and same tokens for all:

    strict        rlalign CausalLM, strict profile: packed varlen forward -> ops.logprob_entropy (fused,
                  chunked, no [T, V] logits) -> loss -> backward; the norm outputs and silu_mul's output
                  are rebuilt in the backward instead of saved (rlalign.models.recompute, same bits)
    strict_keep   the same with recomputation off (every activation saved): not in the default list
    native        the same model in the native profile: cuBLAS linears, flash varlen attention on CUDA,
                  the token-chunked fused log-prob (rlalign/ops/attention.py, logprob.py)
    transformers  Qwen3ForCausalLM (attn_implementation="sdpa") on the sequences right-padded into one
                  [S, L_max] batch with an attention mask, materialised logits, log_softmax(float) + gather,
                  as a TRL-style trainer runs it

loss = -(advantage * logprob).sum() / tokens over the real (unpadded) tokens. The sequences are ragged
(lengths uniform in [mean/4, 7 mean/4], seeded, the last one the remainder) and total ``--tokens``. Weights are bf16
(``--dtype``), random-init (N(0, 0.02), norms 1), copied into the transformers model by name.

Each variant runs in a fresh subprocess (a clean peak-memory reading; an out-of-memory variant is
reported as such, the others still run): ``--warmup`` steps, then ``--iters`` timed steps, median
reported. Peak memory: CUDA ``max_memory_allocated`` over the timed steps (weights and gradients
included); CPU the peak RSS over the timed steps minus the RSS just before them (what the step adds;
indicative: allocator caching and thread pools count). ``saved_gib``: the distinct storages saved for the
backward in one more step (counted by a ``saved_tensors_hooks`` pair; parameters included), exact on any device.
``--peak-breakdown`` (CUDA): one more step with the caching allocator's history recorded, replayed to the step's
peak: what was allocated before the step (weights, ...) and the step's allocations live at the peak, grouped by the
line of rlalign / bench code that made them.

Model FLOPs per step (the usual MFU convention: recomputation is not counted):
    6 * N * T + sum over layers and sequences of 6 * Hq * D * L^2
with N the parameters of every matmul (the decoder's linears and the LM head; not the embedding,
a gather) and the attention term causal (QK^T and PV, forward 2 * Hq * D * L^2, backward twice that).
MFU is reported against ``--peak-tflops`` (default on CUDA: the card's dense bf16 datasheet figure,
rlalign/bench/cards.py -- 989 on an H100 SXM or an H200; a card not listed there needs the flag) and against
``--ceiling-tflops`` (default on an H200: 780, the best bf16 cuBLAS GEMM measured on it, the ceiling any kernel of
ours can reach; no default on other cards, where none was measured); the JSON names the card, both figures and
where each came from (``peak_source``: "spec" or "flag"; ``ceiling_source``: "measured" or "flag").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

VARIANTS = ("strict", "strict_keep", "native", "transformers")
DEFAULT_VARIANTS = ("strict", "native", "transformers")
# the best bf16 cuBLAS GEMM measured per card (rlalign.bench.cards product name): the second MFU reference
MEASURED_CUBLAS_TFLOPS = {"H200 SXM": 780.0}
CEILING_NOTE = "best bf16 cuBLAS GEMM measured on the H200 (docs/performance.md)"
_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu", attention_bias=False,
              rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, eos_token_id=2,
              pad_token_id=0, bos_token_id=1)
SHAPES = {
    "qwen3-8b": dict(_QWEN3, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(_QWEN3, vocab_size=1000, hidden_size=64, intermediate_size=192, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
}


# ---- workload ------------------------------------------------------------------------------------

def sequence_lengths(tokens: int, mean: int, seed: int = 0) -> list[int]:
    """Ragged lengths uniform in [mean/4, 7*mean/4] (seeded) summing to exactly ``tokens``: the last
    one is what is left (it may be shorter than mean/4)."""
    import random
    rng, lens = random.Random(seed), []
    lo, hi = max(1, mean // 4), max(1, 7 * mean // 4)
    while sum(lens) < tokens:
        lens.append(min(rng.randint(lo, hi), tokens - sum(lens)))
    return lens


def hf_config(args) -> dict:
    return dict(SHAPES[args.shape], num_hidden_layers=args.layers)


def model_flops(cfg: dict, lens: list[int]) -> dict:
    """Model FLOPs of one training step (forward + backward) over sequences of ``lens`` tokens."""
    h, hq, hkv, d, ff = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                          "intermediate_size"))
    per_layer = h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * ff       # q, k, v, o, gate/up/down
    matmul_params = cfg["num_hidden_layers"] * per_layer + cfg["vocab_size"] * h   # + LM head
    tokens = sum(lens)
    dense = 6 * matmul_params * tokens
    attention = 6 * hq * d * cfg["num_hidden_layers"] * sum(n * n for n in lens)
    return {"matmul_params": matmul_params, "tokens": tokens, "dense_flops": dense, "attention_flops": attention,
            "total_flops": dense + attention}


# ---- one variant (in its own process) --------------------------------------------------------------

def _init_weights_(model, seed: int) -> None:
    """N(0, 0.02) matrices, norms 1: drawn on the model's device (fast for 8B shapes)."""
    import torch
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(0.02))


def _batch(args, vocab: int, lens: list[int], device):
    import torch
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lens]
    targets = torch.cat([torch.roll(s, -1) for s in seqs]).to(device)
    advantages = torch.randn(sum(lens), generator=gen).to(device)
    return seqs, targets, advantages


def _rlalign_model(args):
    import torch
    from rlalign.models.config import ModelConfig
    from rlalign.models.decoder import CausalLM
    model = CausalLM(ModelConfig.from_hf_dict(hf_config(args)), dtype=getattr(torch, args.dtype), device=args.device)
    _init_weights_(model, args.seed)
    return model.train()


def _rlalign_step(profile: str, args, lens, keep: bool = False):
    """``keep``: every activation saved (rlalign.models.recompute off), the strict_keep variant."""
    import contextlib

    from rlalign import ops
    from rlalign.contract import use_profile
    from rlalign.models import recompute
    from rlalign.models.batch import ForwardBatch
    model = _rlalign_model(args)
    seqs, targets, adv = _batch(args, model.config.vocab_size, lens, args.device)
    batch = ForwardBatch.packed([s.tolist() for s in seqs], device=args.device)

    def step() -> float:
        with use_profile(profile), (recompute.disabled() if keep else contextlib.nullcontext()):
            hidden = model.forward_hidden(batch)
            lp, _ = ops.logprob_entropy(hidden, model.lm_head_weight, targets, with_entropy=False)
            loss = -(adv * lp).sum() / lp.shape[0]
            loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())
    return model, step


def _transformers_step(args, lens):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(**{k: v for k, v in hf_config(args).items() if k not in ("architectures", "model_type")})
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):      # built in place: no host copy of an 8B-shaped model
        model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa", torch_dtype=dtype)
    source = _rlalign_model(args)        # the same weights as the other variants (Hugging Face names)
    model.load_state_dict(source.state_dict(), strict=True)
    del source
    model.train()
    seqs, targets, adv = _batch(args, cfg.vocab_size, lens, args.device)
    l_max = max(lens)
    ids = torch.zeros(len(lens), l_max, dtype=torch.long)
    mask = torch.zeros(len(lens), l_max, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    ids, mask = ids.to(args.device), mask.to(args.device)
    valid = mask.bool()
    padded_targets = torch.zeros_like(ids)
    padded_targets[valid] = targets
    padded_adv = torch.zeros(ids.shape, device=args.device)
    padded_adv[valid] = adv

    def step() -> float:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits      # [S, L, V]
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, padded_targets.unsqueeze(-1)).squeeze(-1)
        loss = -(padded_adv * lp * valid).sum() / valid.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())
    return model, step


def run_variant(variant: str, args) -> dict:
    """Build the variant, warm it up, time ``args.iters`` steps; -> one result row."""
    import torch
    from logprob_memory import peak_rss_bytes, reset_peak_rss, rss_bytes
    cuda = args.device == "cuda"
    lens = sequence_lengths(args.tokens, args.mean_seq, args.seed)
    if variant == "transformers":
        _, step = _transformers_step(args, lens)
    else:
        _, step = _rlalign_step("strict" if variant == "strict_keep" else variant, args, lens,
                                keep=variant == "strict_keep")
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_rss = rss_bytes()
    reset_peak_rss()              # the kernel's high-water mark restarts at the current RSS
    times, loss = [], None
    for _ in range(args.iters):
        t0 = time.perf_counter()
        loss = step()                       # float(loss) synchronises the device
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    # CPU: when the step allocates nothing beyond what was resident, RSS accounting noise (a few pages)
    # can make the difference slightly negative; that is reported as 0
    peak = torch.cuda.max_memory_allocated() if cuda else max(0, peak_rss_bytes() - base_rss)
    row = {"variant": variant, "ms": 1e3 * statistics.median(times), "ms_all": [1e3 * t for t in times],
           "loss": loss, "peak_gib": peak / 2**30,
           "peak_kind": "cuda max_memory_allocated" if cuda else "peak RSS over the timed steps minus RSS before them",
           "saved_gib": saved_bytes(step) / 2**30}
    if args.profile_kernels:   # one more step, after the timed ones: where its kernel time goes
        from rlalign.bench.kernel_profile import profile_breakdown
        row["kernel_profile"] = profile_breakdown(step, args.device, steps=1, stacks=True)
    if args.host_profile:
        row["host_profile"] = _host_profile(step, cuda)
    if args.peak_breakdown and cuda:
        row["peak_breakdown"] = _peak_breakdown(step)
    return row


def saved_bytes(step) -> int:
    """Bytes of the distinct storages saved for the backward during one ``step()`` (after the timed ones)."""
    import torch
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def peak_from_trace(events: list[dict], baseline: int, top: int = 12) -> dict:
    """Replay a CUDA caching-allocator trace (``torch.cuda.memory._snapshot()["device_traces"][d]``: ``alloc`` /
    ``free_completed`` events with addr, size and Python frames) on top of ``baseline`` bytes allocated before it;
    -> the peak, and the allocations live at that moment grouped by where they were made (the innermost frame
    in rlalign/ or benchmarks/, else the innermost frame), largest first."""
    live, total, peak, at_peak = {}, baseline, baseline, {}
    for e in events:
        if e.get("action") == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames") or []))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e.get("action") == "free_completed" and e.get("addr") in live:
            total -= live.pop(e["addr"])[0]
    groups: dict[str, list[int]] = {}
    for size, where in at_peak.values():
        g = groups.setdefault(where, [0, 0])
        g[0] += size
        g[1] += 1
    rows = sorted(({"where": w, "gib": b / 2**30, "count": n} for w, (b, n) in groups.items()),
                  key=lambda r: -r["gib"])
    return {"baseline_gib": baseline / 2**30, "peak_gib": peak / 2**30,
            "step_allocations_at_peak_gib": (peak - baseline) / 2**30, "at_peak": rows[:top]}


def _where(frames: list[dict]) -> str:
    ours = [f for f in frames if "/rlalign/" in f.get("filename", "") or "/bench/" in f.get("filename", "")]
    f = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{Path(f['filename']).name}:{f['line']} {f['name']}"


def _peak_breakdown(step) -> dict:
    """One more step with the allocator's history recorded: what is allocated at the step's peak, and by whom."""
    import torch
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][torch.cuda.current_device()]
    return peak_from_trace(events, baseline)


def _host_profile(step, cuda: bool, lines: int = 30) -> str:
    """One more step under cProfile: where the host's time goes (Python, launches) and how long it waited
    for the device (the time inside tolist / item / synchronize is the wait of a host sync)."""
    import cProfile
    import io
    import pstats

    import torch
    prof = cProfile.Profile()
    prof.enable()
    step()
    if cuda:
        torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    return text.getvalue()


def _row_with_rates(row: dict, flops: dict, args) -> dict:
    if "ms" not in row:
        return row
    seconds = row["ms"] / 1e3
    row["tokens_per_s"] = flops["tokens"] / seconds
    row["model_tflops_per_s"] = flops["total_flops"] / seconds / 1e12
    for key, peak in (("mfu", args.peak_tflops), ("mfu_vs_cublas_ceiling", args.ceiling_tflops)):
        row[key] = None if peak is None else row["model_tflops_per_s"] / peak
    return row


# ---- driver ----------------------------------------------------------------------------------------

def _run_in_subprocess(variant: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, *_forwarded(args)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = out.stdout.strip().splitlines()
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    err = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"variant": variant, "error": "out of memory" if "out of memory" in out.stderr.lower() else err}


def _forwarded(args) -> list[str]:
    keys = ("shape", "layers", "tokens", "mean_seq", "dtype", "device", "warmup", "iters", "seed")
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys] + \
        (["--profile-kernels"] if args.profile_kernels else []) + (["--host-profile"] if args.host_profile else []) + \
        (["--peak-breakdown"] if args.peak_breakdown else [])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 6; 2 for --shape tiny)")
    p.add_argument("--tokens", type=int, default=None, help="packed tokens per micro-step (default 8192; 256 tiny)")
    p.add_argument("--mean-seq", type=int, default=None, help="mean sequence length (default 1024; 48 tiny)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak for MFU (default on CUDA: the card's dense bf16 datasheet figure, rlalign/bench/cards.py; "
                        "a card not listed there needs this flag; none on CPU)")
    p.add_argument("--ceiling-tflops", type=float, default=None,
                   help="second MFU reference (default on an H200: 780, the measured cuBLAS bf16 ceiling; none elsewhere)")
    p.add_argument("--in-process", action="store_true", help="run the variants in this process (tests; peak "
                                                             "memory readings then overlap)")
    p.add_argument("--profile-kernels", action="store_true",
                   help="one more step per variant under torch.profiler: kernel time by family and the top kernels "
                        "(row field kernel_profile; rlalign/bench/kernel_profile.py)")
    p.add_argument("--host-profile", action="store_true",
                   help="one more step per variant under cProfile: the host's top functions by own and by cumulative "
                        "time (row field host_profile; printed after the table)")
    p.add_argument("--peak-breakdown", action="store_true",
                   help="CUDA: one more step per variant with the allocator's history recorded: the step's peak and "
                        "the allocations live at it, grouped by the code that made them (row field peak_breakdown)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object instead of a table")
    p.add_argument("--out", help="also write the JSON result to this file")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    fill_shape_defaults(args)
    if args.peak_breakdown and args.device != "cuda":
        p.error("--peak-breakdown needs --device cuda (it replays the CUDA caching allocator's history)")
    for name in ("peak_tflops", "ceiling_tflops"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    from rlalign.bench.cards import UnknownCardError
    try:
        _card_peaks(args)
    except UnknownCardError as exc:
        p.error(str(exc))
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or min(args.layers, args.tokens, args.mean_seq, args.iters) < 1 or args.warmup < 0:
        p.error(f"unknown variants {bad}" if bad else "--layers, --tokens, --mean-seq and --iters must be >= 1")
    return args


def fill_shape_defaults(args) -> None:
    """The defaults of --layers / --tokens / --mean-seq by --shape (tiny: 2 / 256 / 48, else 6 / 8192 / 1024) and of
    --device (cuda when available). ``is None``, not ``or``: an explicit 0 is refused later, not replaced."""
    tiny = args.shape == "tiny"
    args.layers = (2 if tiny else 6) if args.layers is None else args.layers
    args.tokens = (256 if tiny else 8192) if args.tokens is None else args.tokens
    args.mean_seq = (48 if tiny else 1024) if args.mean_seq is None else args.mean_seq
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"


def _card_peaks(args) -> None:
    """Fill args.card, args.peak_tflops / ceiling_tflops and their sources: a flag wins; on CUDA (not in a
    variant's worker, which needs no peak) the card's datasheet figure and its measured cuBLAS ceiling
    (rlalign.bench.cards; an unknown card without --peak-tflops raises UnknownCardError)."""
    from rlalign.bench.cards import FLAG, card_spec, cuda_card, resolve_peaks
    args.card = cuda_card() if args.device == "cuda" and not args.worker else None
    peaks = resolve_peaks(args.card, None, args.peak_tflops, need=("peak_tflops",))
    args.peak_tflops, args.peak_source, args.datasheet = peaks.peak_tflops, peaks.peak_tflops_source, peaks.datasheet
    spec = card_spec(args.card) if args.card is not None else None
    measured = MEASURED_CUBLAS_TFLOPS.get(spec.product) if spec is not None else None
    if args.ceiling_tflops is not None:
        args.ceiling_source = FLAG
    elif measured is not None:
        args.ceiling_tflops, args.ceiling_source = measured, "measured"
    else:
        args.ceiling_source = None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_variant(args.worker, args)))
        return 0
    import torch
    lens = sequence_lengths(args.tokens, args.mean_seq, args.seed)
    flops = model_flops(hf_config(args), lens)
    rows = [_row_with_rates(run_variant(v, args) if args.in_process else _run_in_subprocess(v, args), flops, args)
            for v in args.variants]
    result = {"name": "train_step", "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or
                                                                                    platform.machine()),
              "shape": {**{k: getattr(args, k) for k in ("shape", "layers", "dtype")}, "sequences": len(lens),
                        "tokens": sum(lens), "longest": max(lens)},
              "flops": flops, "card": args.card, "peak_tflops": args.peak_tflops, "peak_source": args.peak_source,
              "datasheet": args.datasheet, "ceiling_tflops": args.ceiling_tflops, "ceiling_source": args.ceiling_source,
              "ceiling_note": CEILING_NOTE if args.ceiling_source == "measured" else None,
              "rows": rows, "ratios": _ratios(rows)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else _table(result))
    for r in result["rows"]:
        if "host_profile" in r and not args.json:
            print(f"\n== host profile, {r['variant']}\n{r['host_profile']}")
    return 0 if all("ms" in r for r in rows) else 1


def _ratios(rows) -> dict:
    by = {r["variant"]: r for r in rows if "ms" in r}
    out = {}
    for a, b in (("strict", "native"), ("strict", "transformers"), ("native", "transformers"), ("strict", "strict_keep")):
        if a in by and b in by:
            out[f"time_{a}_over_{b}"] = by[a]["ms"] / by[b]["ms"]
            out[f"memory_{a}_over_{b}"] = by[a]["peak_gib"] / by[b]["peak_gib"] if by[b]["peak_gib"] > 0 else None
    return out


def _table(result) -> str:
    s = result["shape"]
    lines = [f"train step, {s['shape']} x {s['layers']} layers, {s['tokens']} tokens in {s['sequences']} sequences "
             f"(longest {s['longest']}), {s['dtype']}, {result['device']}; model TFLOP/step "
             f"{result['flops']['total_flops'] / 1e12:.2f}"]
    for r in result["rows"]:
        if "ms" not in r:
            lines.append(f"{r['variant']:>12}: FAILED ({r['error']})")
            continue
        mfu = "" if r["mfu"] is None else f"  MFU {100 * r['mfu']:.1f}% of {result['peak_tflops']:g}"
        if r["mfu_vs_cublas_ceiling"] is not None:
            mfu += f" ({100 * r['mfu_vs_cublas_ceiling']:.1f}% of {result['ceiling_tflops']:g})"
        lines.append(f"{r['variant']:>12}: {r['ms']:9.1f} ms  {r['tokens_per_s']:10.0f} tok/s  peak {r['peak_gib']:7.2f}"
                     f" GiB  saved {1024 * r['saved_gib']:9.2f} MiB{mfu}  loss {r['loss']:.5f}")
        if "kernel_profile" in r:
            kp = r["kernel_profile"]
            lines.append(f"{'':>12}  kernels {kp['kernel_ms']:.1f} ms: " + ", ".join(
                f"{name} {f['ms']:.1f} ms ({f['share']:.0%})" for name, f in kp["families"].items()))
            if "idle" in kp:   # CUDA: where the device waited for the host (kernel_profile.idle_gaps)
                idle = kp["idle"]
                lines.append(f"{'':>12}  device idle {idle['idle_ms']:.1f} of {idle['span_ms']:.1f} ms; "
                             f"{idle['gaps']} gaps >= {idle['gap_min_us']:g} us: " + "; ".join(
                                 f"{c['cause']} {c['ms']:.2f} ms x{c['gaps']}" for c in idle["by_cause"][:6]))
        if "peak_breakdown" in r:
            pb = r["peak_breakdown"]
            lines.append(f"{'':>12}  peak {pb['peak_gib']:.2f} GiB = {pb['baseline_gib']:.2f} before the step + "
                         f"{pb['step_allocations_at_peak_gib']:.2f} allocated in it, live at the peak: " + "; ".join(
                             f"{g['where']} {g['gib']:.3f} GiB x{g['count']}" for g in pb["at_peak"]))
    lines += [f"{k}: {v:.3f}" for k, v in result["ratios"].items() if v is not None]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
