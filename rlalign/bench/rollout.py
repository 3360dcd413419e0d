"""Rollout throughput: the rlalign engine (strict and native profiles) vs transformers ``generate``.

    rlalign bench rollout [--device cpu|cuda] [--workload NAME] [--model DIR | --preset NAME] [--layers N]
                          [--prompts 64] [--samples 8] [--new-tokens 64] [--prompt-len 32:128]
                          [--engines strict,native,transformers] [--peak-gbps GB/s] [--peak-tflops TFLOP/s]
                          [--verify] [--json]

``--workload`` names a preset (WORKLOADS: ``tiny`` for CI, ``0.6b-ctx512``, ``0.6b-ctx4096``, ``8b-ctx512``,
``8b-ctx4096``: Qwen3 shapes with the full vocabulary, random init, 256-512 distinct running sequences, contexts
of about 512 or 4,096 tokens during decode); explicit options override its fields; ``--layers`` keeps the
first N decoder layers of a preset shape (so that a large shape fits a short job and its KV cache fits).

Workload (GRPO-shaped): ``--prompts`` random prompts (token ids drawn with a fixed seed, lengths
uniform in ``--prompt-len``), ``--samples`` samples each, exactly ``--new-tokens`` new tokens per
sample (eos ignored: every engine generates the same number of tokens), temperature 1, no top-k/p.

* rlalign: ``RolloutEngine(model, RolloutConfig(profile=...))`` driven by ``add_request`` / ``step`` as
  ``generate`` does (prompt prefilled once per group, pages shared, per-token logprobs computed); on CUDA
  both profiles replay decode steps from CUDA graphs that also sample, with overlapped scheduling
  (``--decode-graphs``, ``--overlap``; every batch bucket is captured at the first decode step -- where
  native gathers K/V, not on CUDA, each (batch, block-table width) bucket at its first use -- and the
  CUDA workloads warm up on the whole workload: no capture falls in a timed call, and the row's
  ``graph_captures_timed`` says so); native is the same machinery with the fast non-deterministic ops
  (the Triton paged kernel without the contract's checks, cuBLAS, an exponential-race sampler): the
  baseline that measures the cost of the contract. The engine's ``max_model_len`` is the workload's longest
  prompt + new tokens (``--max-model-len``; verl sets it so, prompt length + response length): it sizes the
  block table, which decides the decode attention's launch (docs/design/attention-blocks-and-splits.md);
* transformers: the same weights saved as a Hugging Face checkpoint and loaded with
  ``AutoModelForCausalLM``; ``generate(do_sample=True, num_return_sequences=n, top_k=0,
  min_new_tokens=max_new_tokens=...)`` on left-padded prompts, all prompts in one call on the CPU
  and 64 per call on CUDA (``--hf-batch-prompts``; its dense per-sequence KV cache would not fit
  otherwise); logprobs are not requested from it.

tokens/s = generated tokens / wall seconds of the generate call (model load, engine construction
and a warm-up excluded: on the CPU the whole workload once, so that the engine measured first does not
pay for the process's allocator settling; on CUDA 2 prompts x 4 tokens), the median of ``--repeat`` timed
calls per engine (default 3 on the CPU, whose shared machines are noisy, 1 on CUDA); each row lists every
call's seconds. On the CPU the engines' calls are interleaved (strict, native, transformers, strict, ...),
so that a slow phase of a shared machine falls on all of them; on CUDA one engine at a time. The engine's
prefix cache is emptied before each call, so no call reuses an earlier one's prompts. ``--verify`` also
recomputes every logprob of each rlalign engine with the trainer's packed forward in the same profile and
counts the tokens whose bits differ (strict: must be 0; native promises nothing).

Decode steps (every running sequence feeds one token; the last timed call's) are measured one by one:
``decode_step_ms`` (wall time of ``engine.step()``, which returns after the sampled tokens reached the
host; with overlapped scheduling the next step is already queued then, so this is the period between
two completed steps; ``decode_step_ms_median`` / ``_max``: its median and longest, a long tail is host
stalls; the steps run with the garbage collector paused, as ``engine.generate()`` runs them),
``forward_gpu_ms`` (CUDA events around the graph replay: the GPU time of the captured forward and the sampler and logprob op captured with it; graph steps only),
``host_ms_per_step`` = decode_step_ms - forward_gpu_ms (scheduling, batch building, copies,
bookkeeping: the host time on the critical path; with ``--overlap on`` the part of it not hidden behind
the device, and the row's ``overlap`` / ``overlapped_steps`` say whether and how often steps overlapped),
``host_busy_ms_per_step`` (decode step wall minus the time it blocked waiting for the device's results:
the host's own work per step, overlapped or not; on the CPU the forward runs inside it),
``bytes_per_decode_step`` (weights + K/V read + K/V written, the minimum a step must move:
:mod:`rlalign.bench.roofline`, from the model config and the step's actual context lengths),
``achieved_gbps`` = bytes / wall, ``roofline_fraction`` = achieved / ``--peak-gbps`` (default on CUDA: the
card's datasheet HBM bandwidth, :mod:`rlalign.bench.cards`, e.g. 4800 on an H200, 3350 on an H100 SXM; a card
not in that table needs the flag; none on the CPU unless given), ``forward_roofline_fraction`` the same
against the forward's GPU time only; ``op_floor_ms``: the per-op roofline of a step (each op at the slower of
its bandwidth and ``--peak-tflops`` ceilings, default the card's dense BF16 datasheet figure, summed:
:mod:`rlalign.bench.roofline`; at hundreds of rows the
GEMMs are compute bound, so this floor is above bytes / bandwidth), ``op_roofline_fraction`` = floor / wall
(``forward_op_roofline_fraction``: / forward GPU time); ``graph_finite_checks_per_step``: the finiteness
checks captured in the replayed graphs (docs/gpu.md, "Finiteness checks": a run with ``RLALIGN_CHECKS=per-op``
against the default prices one check, hence the default's share of a step).

Model: ``--model DIR``; else ``--preset``; by default the embedded default model
(rlalign/assets/default_model) when it exists on the CPU, the ``cpu-small`` preset otherwise, and
``qwen3-0.6b`` (random init, bf16) on CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlalign.bench.args import positive_int, seed_int
from rlalign.bench.cards import Peaks, cuda_card, resolve_peaks
from rlalign.bench.roofline import (decode_step_bytes, decode_step_floor, kv_bytes_per_token, parameter_counts,
                                    step_shapes)
from rlalign.bench.kernel_profile import KernelProfile
from rlalign.contract import use_profile
from rlalign.contract.bits import count_differences
from rlalign.contract.errors import RLAlignError
from rlalign.doctor import environment
from rlalign.models.batch import ForwardBatch
from rlalign.models.checkpoint import load_model, load_model_config, resolve_dtype, save_model
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.rollout.engine import collector_paused

HELP = "rollout tokens/s: rlalign engine (strict, native) vs transformers generate"


class BenchError(RLAlignError):
    """A benchmark option or workload that cannot run; the CLI prints it as one line (exit 2)."""
ENGINES = ("strict", "native", "transformers")

_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu", attention_bias=False,
              rms_norm_eps=1e-6)
PRESETS = {
    # a small Qwen3-shaped model for CPU runs
    "cpu-small": dict(_QWEN3, vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0),
    # for tests and smoke runs
    "tiny": dict(_QWEN3, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                 rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0),
    # Qwen3-0.6B's shape (random init)
    "qwen3-0.6b": dict(_QWEN3, vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=151645, pad_token_id=151643),
    # Qwen3-8B's shape (random init)
    "qwen3-8b": dict(_QWEN3, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1000000.0, tie_word_embeddings=False, eos_token_id=151645, pad_token_id=151643),
}
# Named workloads: the roofline shapes. samples=1: every sequence has its own context, so the K/V
# bytes counted are distinct bytes (shared prompt pages could be served from L2). Prompt lengths put the
# decode contexts around 512 / 4,096 tokens. 8b-ctx4096's 256 sequences need ~157 GB of K/V at full length (147 KB
# per token), more than an H200 holds beside the weights: the cache is capped at the free memory
# (_kv_cache_bytes), so fewer sequences run at once and the rest wait (the row reports decode_rows_mean).
WORKLOADS = {
    "tiny": dict(preset="tiny", prompts=3, samples=2, prompt_len="3:6", new_tokens=4),
    "0.6b-ctx512": dict(preset="qwen3-0.6b", prompts=512, samples=1, prompt_len="384:448", new_tokens=128,
                        warmup="full"),
    "0.6b-ctx4096": dict(preset="qwen3-0.6b", prompts=256, samples=1, prompt_len="3968:4032", new_tokens=128,
                         warmup="full"),
    "8b-ctx512": dict(preset="qwen3-8b", prompts=512, samples=1, prompt_len="384:448", new_tokens=128,
                      warmup="full"),
    "8b-ctx4096": dict(preset="qwen3-8b", prompts=256, samples=1, prompt_len="3968:4032", new_tokens=128,
                       warmup="full"),
}
DEFAULTS = {
    "cpu": dict(prompts=64, samples=8, new_tokens=64, prompt_len="32:128", dtype="float32", repeat=3, warmup="full"),
    # transformers keeps a dense KV cache per sequence: its generate calls take 64 prompts (512 sequences) each
    "cuda": dict(prompts=256, samples=8, new_tokens=512, prompt_len="64:192", dtype="bfloat16", preset="qwen3-0.6b",
                 hf_batch_prompts=64, repeat=1, warmup="short"),
}
# the KV cache of a CUDA run is sized to the workload (plus this margin), not to 80% of the free memory:
# the rest is left to activations, the sampler's [batch, vocab] buffers and the graphs' pool
KV_CACHE_MARGIN = 1.10


def workload_defaults(args) -> dict:
    """The device's defaults, overridden by ``--workload``'s fields (explicit options override both)."""
    if args.workload is not None and args.workload not in WORKLOADS:
        raise BenchError(f"unknown workload {args.workload!r} (choose from {sorted(WORKLOADS)})")
    return dict(DEFAULTS[args.device], **WORKLOADS.get(args.workload, {}))


# models with a short context (the embedded default model has 64 positions) get a shorter workload
SHORT_CONTEXT_LIMIT = 256
SHORT_CONTEXT_DEFAULTS = dict(prompt_len="8:16", new_tokens=32)


def default_model_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "assets" / "default_model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--workload", metavar="NAME", help=f"named workload: {', '.join(WORKLOADS)} (module docstring)")
    p.add_argument("--layers", type=positive_int, help="keep the first N decoder layers of the preset shape")
    p.add_argument("--peak-gbps", type=float,
                   help="memory bandwidth peak (GB/s) for the roofline fraction (default on CUDA: the card's datasheet "
                        "HBM bandwidth, rlalign/bench/cards.py; a card not listed there needs this flag)")
    p.add_argument("--peak-tflops", type=float,
                   help="matmul throughput ceiling for the per-op roofline (default on CUDA: the card's dense BF16 "
                        "datasheet figure, e.g. 989 on an H100 SXM or H200; 780 is what cuBLAS reached on the H200)")
    p.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (default: see --preset)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="random-init model shape (default: the embedded default model if present on the CPU, else "
                        "cpu-small; qwen3-0.6b on CUDA)")
    p.add_argument("--prompts", type=positive_int, help="number of prompts (default 64 on the CPU, 256 on CUDA)")
    p.add_argument("--samples", type=positive_int, help="samples per prompt (default 8)")
    p.add_argument("--new-tokens", type=positive_int,
                   help="new tokens per sample (default 64 on the CPU, 512 on CUDA, 32 for models of < 256 positions)")
    p.add_argument("--prompt-len", metavar="MIN:MAX",
                   help="prompt length range (default 32:128 CPU, 64:192 CUDA, 8:16 for models of < 256 positions)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {','.join(ENGINES)}")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--max-num-seqs", type=positive_int, default=1024, help="engine decode batch (default 1024)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, help="engine token budget per step")
    p.add_argument("--max-model-len", default="workload", metavar="N|workload|model",
                   help="the engine's max_model_len: 'workload' (default) the longest prompt + new tokens, as verl "
                        "sets it (prompt length + response length); 'model' the model's max_position_embeddings; "
                        "or a number. It sizes the block table, so the decode graphs' attention launch (a streamed "
                        "launch's work entries grow with the table's width)")
    p.add_argument("--decode-graphs", default="auto", choices=("auto", "on", "off", "padded"),
                   help="replay decode steps from CUDA graphs, both profiles (auto: on CUDA; RolloutConfig.decode_graphs; "
                        "padded: the graphs' static batches run eagerly, any device)")
    p.add_argument("--overlap", default="auto", choices=("auto", "on", "off"),
                   help="overlapped scheduling of decode steps (auto: on with CUDA graphs; RolloutConfig.overlap); the "
                        "row's 'overlap' field says whether it ran: compare host_ms_per_step of on and off")
    p.add_argument("--kv-cache-gb", type=float, help="engine KV cache size (default: 1 GiB CPU, 80%% of free GPU memory)")
    p.add_argument("--hf-batch-prompts", type=positive_int,
                   help="prompts per transformers generate call (default all on the CPU, 64 on CUDA)")
    p.add_argument("--hf-prompts", type=positive_int, help="run transformers on the first N prompts only (default all)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default torch's)")
    p.add_argument("--repeat", type=positive_int, help="timed calls per engine, the median reported (default 3 CPU, 1 CUDA)")
    p.add_argument("--warmup", choices=("full", "short"),
                   help="untimed warm-up per engine: the whole workload once (default on the CPU: the process's "
                        "allocator and caches settle, whichever engine runs first; and for the --workload presets "
                        "on CUDA: every decode graph is captured before the timed call; transformers on CUDA "
                        "always warms up short) or 2 prompts x 4 tokens (CUDA default)")
    p.add_argument("--verify", action="store_true",
                   help="check every engine logprob against the trainer's forward in the same profile")
    p.add_argument("--profile-kernels", action="store_true",
                   help="after the timed calls, one more call of each rlalign engine under torch.profiler: kernel time "
                        "per decode step by family (attention, gemm, logprob_sample, checks, ...) and the top kernels "
                        "(row field kernel_profile; rlalign/bench/kernel_profile.py)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    samples: int
    new_tokens: int

    @property
    def generated_tokens(self) -> int:
        return len(self.prompts) * self.samples * self.new_tokens


def run_cli(args: argparse.Namespace) -> int:
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def run(args: argparse.Namespace) -> dict:

    defaults = workload_defaults(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but no CUDA device is visible")
    _check_positive(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise BenchError(f"unknown engines {sorted(unknown)} (choose from {ENGINES})")
    dtype = args.dtype or defaults["dtype"]
    peaks = run_peaks(args)   # before any work: a card without spec figures and no flags stops here
    # a preset's checkpoint is written and read back once: in memory when the machine has a tmpfs (16.4 GB for 8B)
    shm = "/dev/shm" if args.device != "cpu" and os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="rlalign-bench-", dir=shm) as tmp:
        model_dir, model_name = _model_dir(args, defaults, dtype, Path(tmp))
        workload = _workload(args, defaults, model_dir)
        rows = _measure(engines, model_dir, workload, args, dtype, peaks)
    by_name = {r["profile"] if r["engine"] == "rlalign" else r["engine"]: r["tokens_per_s"] for r in rows}
    ratios = {f"{a}_vs_{b}": round(by_name[a] / by_name[b], 3)
              for a, b in (("strict", "native"), ("strict", "transformers"), ("native", "transformers"))
              if a in by_name and b in by_name}
    return {"name": "rollout", "rows": rows, "ratios": ratios,
            "workload": {"name": args.workload, "model": model_name, "dtype": dtype, "device": args.device,
                         **peaks.as_json(),
                         "prompts": len(workload.prompts),
                         "samples": workload.samples, "new_tokens": workload.new_tokens,
                         "prompt_tokens": sum(len(p) for p in workload.prompts),
                         "prompt_len": f"{min(map(len, workload.prompts))}:{max(map(len, workload.prompts))}"},
            "environment": _environment(args.device)}


def _progress(message: str) -> None:
    print(f"[bench rollout] {message}", file=sys.stderr, flush=True)


# ---- model and workload --------------------------------------------------------------------------

def _model_dir(args, defaults, dtype: str, tmp: Path) -> tuple[Path, str]:
    if args.model:
        if args.layers:
            raise BenchError("--layers cuts a preset shape; it cannot be combined with --model")
        return Path(args.model), str(args.model)
    preset = args.preset or defaults.get("preset")
    if preset is None and default_model_dir().joinpath("config.json").is_file():
        return default_model_dir(), "rlalign/assets/default_model"
    preset = preset or "cpu-small"
    hf = dict(PRESETS[preset])
    if args.layers:
        if not 1 <= args.layers <= hf["num_hidden_layers"]:
            raise BenchError(f"--layers must be in 1..{hf['num_hidden_layers']} for {preset}")
        hf["num_hidden_layers"] = args.layers
    config = ModelConfig.from_hf_dict(hf)
    # drawn where the bench runs: the CPU generator takes minutes for the 8B's 8.2B normals (the 8b-* workloads took
    # over 130 s before their first token); a GPU draws them in under a second (other values than the
    # CPU's: the label says which -- tokens/s do not depend on them, every completion runs its new tokens)
    model = CausalLM(config, dtype=resolve_dtype(dtype), device=args.device)
    model.init_random_(seed=args.seed, on_device=args.device != "cpu")
    path = save_model(model, tmp / preset)
    del model
    torch.manual_seed(args.seed)
    layers = f", first {args.layers} of {PRESETS[preset]['num_hidden_layers']} layers" if args.layers else ""
    drawn = "" if args.device == "cpu" else f" drawn on {args.device}"
    return path, f"preset {preset} (random init{drawn}, seed {args.seed}{layers})"


def _workload(args, defaults, model_dir: Path) -> Workload:

    config = load_model_config(model_dir)
    if config.max_position_embeddings < SHORT_CONTEXT_LIMIT:   # e.g. the embedded default model (64 positions)
        defaults = dict(defaults, **SHORT_CONTEXT_DEFAULTS)
    low, high = (int(x) for x in (args.prompt_len or defaults["prompt_len"]).split(":"))
    count = args.prompts or defaults["prompts"]
    new_tokens = args.new_tokens or defaults["new_tokens"]
    if high + new_tokens > config.max_position_embeddings:
        raise BenchError(f"prompts up to {high} tokens + {new_tokens} new tokens exceed the "
                         f"model's max_position_embeddings={config.max_position_embeddings}")
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    return Workload(prompts, args.samples or defaults["samples"], new_tokens)


# ---- the engines ---------------------------------------------------------------------------------

def _full_warmup(args) -> bool:
    return (args.warmup or workload_defaults(args)["warmup"]) == "full"


def _repeats(args) -> int:
    return max(1, args.repeat or workload_defaults(args)["repeat"])


# the options that count or size something: each must be > 0 when given (a zero peak would divide, a negative
# one print a negative fraction, a zero count run nothing and report it)
# the float options (the integer ones are refused by their argparse type, rlalign.bench.args.positive_int)
POSITIVE_OPTIONS = ("peak_gbps", "peak_tflops", "kv_cache_gb")


def _check_positive(args) -> None:
    for name in POSITIVE_OPTIONS:
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            raise BenchError(f"--{name.replace('_', '-')} must be > 0, got {value}")


def run_peaks(args) -> Peaks:
    """The peaks of this run: the flags, else on CUDA the card's spec figures (rlalign.bench.cards; an unknown
    card without both flags raises its one line); on the CPU only the flags."""
    card = cuda_card() if args.device == "cuda" else None
    return resolve_peaks(card, args.peak_gbps, args.peak_tflops)


def _overlap_setting(args, profile: str, model) -> str:
    """--overlap for the engine: "on" applies to both profiles, except a native MoE model on CUDA (where its
    experts fall back to the per-expert loop it decodes eagerly and cannot overlap: auto for it, which
    overlaps whenever its graphs sample)."""
    setting = getattr(args, "overlap", "auto")
    eager_native = profile == "native" and model.config.ffn_kind == "moe" and args.device == "cuda"
    return "auto" if setting == "on" and eager_native else setting


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(engines: list[str], model_dir: Path, workload: Workload, args, dtype: str, peaks: Peaks) -> list[dict]:
    """Each engine set up and warmed up, then ``--repeat`` timed calls. On the CPU the engines are all
    kept and their calls interleaved (strict, native, transformers, strict, ...): a shared machine's
    slow phases then fall on every engine alike (unless their weights would take over a third of the
    memory). On CUDA one engine at a time (each takes most of the GPU's memory)."""
    make = lambda name: _TransformersRun(model_dir, workload, args, dtype) if name == "transformers" else \
        _EngineRun(model_dir, workload, args, dtype, name, peaks)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    rows = []
    if args.device == "cpu" and _fits_all_at_once(model_dir, len(engines)):
        runners = {}
        for name in engines:
            _progress(f"{name}: set-up and warm-up ...")
            runners[name] = make(name)
        for _ in range(_repeats(args)):
            for name in engines:
                runs[name].append(runners[name].timed())
        for name in engines:
            rows.append(runners[name].row(runs[name]))
            runners[name].close()
            _progress(f"{name}: {rows[-1]['tokens_per_s']:.1f} tokens/s (median of {runs[name]})")
        return rows
    for name in engines:
        _progress(f"{name} ...")
        runner = make(name)
        runs[name] = [runner.timed() for _ in range(_repeats(args))]
        rows.append(runner.row(runs[name]))
        runner.close()
        _progress(f"{name}: {rows[-1]['tokens_per_s']:.1f} tokens/s in {rows[-1]['seconds']:.1f} s")
    return rows


def _fits_all_at_once(model_dir: Path, count: int) -> bool:
    """Whether ``count`` copies of the checkpoint's weights (one per engine kept at once) stay under a
    third of this machine's memory (else the engines run one at a time)."""
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return count * weights < memory / 3


def max_model_len(args, workload: Workload, config) -> int | None:
    """RolloutConfig.max_model_len for ``--max-model-len``: the workload's longest prompt + its new tokens
    ('workload'), None (the model's max_position_embeddings: 'model'), or the number given."""
    choice = str(getattr(args, "max_model_len", "workload"))
    longest = max(len(p) for p in workload.prompts) + workload.new_tokens
    if choice == "model":
        return None
    if choice == "workload":
        return longest
    try:
        value = int(choice)
    except ValueError:
        raise BenchError(f"--max-model-len {choice!r} is not a number, 'workload' or 'model'")
    if not longest <= value <= config.max_position_embeddings:
        raise BenchError(f"--max-model-len {value} must hold the workload's longest sequence "
                         f"({longest} tokens) and be at most max_position_embeddings={config.max_position_embeddings}")
    return value


class _EngineRun:
    """The rlalign engine in one profile: set up and warmed up on creation; :meth:`timed` is one call."""

    def __init__(self, model_dir: Path, workload: Workload, args, dtype: str, profile: str, peaks: Peaks):

        self.args, self.workload, self.profile, self.peaks = args, workload, profile, peaks
        self.model, _ = load_model(model_dir, dtype=dtype, device=args.device)
        config = RolloutConfig(profile=profile, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               max_model_len=max_model_len(args, workload, self.model.config),
                               kv_cache_bytes=_kv_cache_bytes(self.model, workload, args),
                               decode_graphs=args.decode_graphs, overlap=_overlap_setting(args, profile, self.model))
        self.engine = RolloutEngine(self.model, config)
        self.sampling = SamplingParams(n=workload.samples, max_new_tokens=workload.new_tokens, seed=args.seed,
                                       ignore_eos=True)
        self.counts = parameter_counts(self.model.config)
        self.shapes = step_shapes(self.model.config)
        # warm-up: compiles kernels and, with decode graphs, captures them (as an engine's start-up does)
        t0 = time.perf_counter()
        if _full_warmup(args):
            self.engine.generate(workload.prompts, self.sampling)
        else:
            self.engine.generate(workload.prompts[:2], dataclasses.replace(self.sampling, max_new_tokens=4))
        _sync(args.device)
        self.warmup = time.perf_counter() - t0
        self.completions, self.steps, self.captures_timed = None, [], 0

    def timed(self, profile: KernelProfile | None = None) -> float:
        """One call of the workload; ``profile``: profiled from its first decode step (_generate_step_by_step)."""
        engine, graphs = self.engine, self.engine.decode_graphs
        engine.blocks.reset_prefix_cache()   # no call reuses an earlier call's prompt pages
        engine.counters.update(steps=0, forward_tokens=0, sampled_tokens=0, compute_seconds=0.0, graph_steps=0,
                               overlapped_steps=0)
        if graphs is not None:
            graphs.time_replays = graphs.mode == "graphs"
        captures = graphs.captures if graphs is not None else 0
        _sync(self.args.device)
        t0 = time.perf_counter()
        self.completions, self.steps = _generate_step_by_step(engine, self.workload.prompts, self.sampling,
                                                              profile=profile)
        _sync(self.args.device)
        seconds = time.perf_counter() - t0
        self.captures_timed = (graphs.captures if graphs is not None else 0) - captures
        return seconds

    def row(self, runs: list[float]) -> dict:
        seconds = statistics.median(runs)
        generated = sum(len(c.tokens) for c in self.completions)
        stats = self.engine.stats()
        graphs = self.engine.decode_graphs
        row = {"engine": "rlalign", "profile": self.profile, "tokens_per_s": round(generated / seconds, 2),
               "seconds": round(seconds, 3), "generated_tokens": generated, "steps": stats["steps"],
               "forward_tokens": stats["forward_tokens"], "preemptions": stats["preemptions"],
               "kv_pages": stats["num_pages"], "page_size": self.args.page_size,
               "max_model_len": self.engine.max_model_len, "graph_steps": stats["graph_steps"],
               "decode_graphs": graphs.mode if graphs is not None else "off",
               "graph_captures": graphs.captures if graphs is not None else 0,
               "graph_captures_timed": self.captures_timed,
               "overlap": self.engine.overlap, "overlapped_steps": stats["overlapped_steps"],
               "warmup_seconds": round(self.warmup, 2), "runs_seconds": [round(r, 3) for r in runs]}
        row.update(decode_metrics(self.steps, self.model.config, self.model.dtype, self.peaks.peak_gbps, self.counts,
                                  self.peaks.peak_tflops, self.shapes))
        if getattr(self.args, "profile_kernels", False):
            # one more call after the measured ones (the profiler's overhead is in none of them), profiled from
            # its first decode step to its end: the decode steps' kernels, prefill left out
            prof = KernelProfile(self.args.device)
            self.timed(profile=prof)
            row["kernel_profile"] = prof.breakdown(steps=sum(1 for step in self.steps if step.profiled))
        if self.args.verify:
            row.update(_verify(self.model, self.completions, self.profile))
        return row

    def close(self) -> None:
        _release(self, self.args.device)


@dataclasses.dataclass
class DecodeStep:
    """One measured decode step: its rows, their summed context (new token included), its wall seconds,
    and the CUDA events around its graph replay (None for an eager step)."""
    rows: int
    context_tokens: int
    seconds: float
    events: tuple | None = None
    graph_checks: int = 0
    wait_seconds: float = 0.0     # of ``seconds``, blocked waiting for the device's results
    profiled: bool = False        # ran inside a --profile-kernels window

    @property
    def forward_ms(self) -> float | None:
        return None if self.events is None else self.events[0].elapsed_time(self.events[1])


def _generate_step_by_step(engine: RolloutEngine, prompts, sampling,
                           profile: KernelProfile | None = None) -> tuple[list, list[DecodeStep]]:
    """``engine.generate(prompts, sampling)`` through the public step API, timing every decode step. With
    ``profile``: started once the first decode step has completed, stopped at the end (those steps say
    ``profiled``)."""
    graphs = engine.decode_graphs
    ids = [engine.add_request(p, sampling, prompt_index=i) for i, p in enumerate(prompts)]
    done, steps = {}, []
    try:
        with collector_paused():   # as engine.generate() runs its steps
            _step_loop(engine, graphs, steps, done, profile)
    except BaseException:
        engine.abort_all()
        raise
    finally:
        if profile is not None and profile.running:
            profile.stop()
    return [done[(rid, j)] for rid in ids for j in range(sampling.n)], steps


def _step_loop(engine: RolloutEngine, graphs, steps: list[DecodeStep], done: dict, profile) -> None:
    """Step the engine until it is idle, recording each decode step (DecodeStep) and each finished sample."""
    while engine.has_unfinished():
        t0 = time.perf_counter()
        # returns once the step's sampled tokens are on the host (with overlap the next step is then
        # already queued on the device: the wall time is the period between two completed steps)
        outputs = engine.step()
        seconds = time.perf_counter() - t0
        info, events = engine.last_forward, engine.last_step_events   # of the step step() completed
        if info is not None and info["decode"]:
            steps.append(DecodeStep(info["rows"], info["context_tokens"], seconds, events,
                                    graphs.last_checks if events is not None else 0,
                                    engine.last_step_wait_seconds, profiled=profile is not None and profile.running))
            if profile is not None and not profile.running:
                profile.start()
        for out in outputs:
            if out.completion is not None:
                done[(out.request_id, out.sample_index)] = out.completion


def decode_metrics(steps: list[DecodeStep], config, dtype, peak_gbps: float | None, counts=None,
                   peak_tflops: float | None = None, shapes=None) -> dict:
    """Per-decode-step figures of one call (module docstring); None where not measurable (no decode step,
    no graph replay for GPU times, no peak for fractions; the per-op roofline needs both peaks). ``counts`` /
    ``shapes``: parameter_counts / step_shapes of ``config`` when already known."""
    if not steps:
        return {"decode_steps": 0}
    moved = [decode_step_bytes(config, dtype, s.rows, s.context_tokens, counts) for s in steps]
    wall = sum(s.seconds for s in steps)
    total = sum(b.total for b in moved)
    timed = [(s, b) for s, b in zip(steps, moved) if s.events is not None]
    gpu_ms = [s.forward_ms for s, _ in timed]
    achieved = total / wall / 1e9
    out = {"decode_steps": len(steps),
           "decode_rows_mean": round(sum(s.rows for s in steps) / len(steps), 1),
           "decode_context_mean": round(sum(s.context_tokens for s in steps) / sum(s.rows for s in steps), 1),
           "decode_step_ms": round(1e3 * wall / len(steps), 3),
           "decode_step_ms_median": round(1e3 * statistics.median(s.seconds for s in steps), 3),
           "decode_step_ms_max": round(1e3 * max(s.seconds for s in steps), 3),
           "decode_tokens_per_s": round(sum(s.rows for s in steps) / wall, 1),
           "host_busy_ms_per_step": round(1e3 * sum(s.seconds - s.wait_seconds for s in steps) / len(steps), 3),
           "bytes_per_decode_step": round(total / len(steps)),
           "weight_bytes_per_decode_step": round(sum(b.weights for b in moved) / len(steps)),
           "kv_bytes_per_decode_step": round(sum(b.kv_read + b.kv_write for b in moved) / len(steps)),
           "achieved_gbps": _sig(achieved),
           "roofline_fraction": None if not peak_gbps else _sig(achieved / peak_gbps),
           "forward_gpu_ms": None, "host_ms_per_step": None, "forward_roofline_fraction": None,
           "timed_forward_steps": len(timed),
           "graph_finite_checks_per_step": None,
           "op_floor_ms": None, "op_roofline_fraction": None, "forward_op_roofline_fraction": None}
    floors = None
    if peak_gbps and peak_tflops:
        shapes = shapes or step_shapes(config)
        elem = torch.empty((), dtype=dtype).element_size()
        floors = [decode_step_floor(shapes, b, s.rows, s.context_tokens, elem, peak_gbps, peak_tflops)
                  for s, b in zip(steps, moved)]
        out.update(op_floor_ms=round(1e3 * sum(floors) / len(steps), 3), op_roofline_fraction=_sig(sum(floors) / wall))
    if timed:
        gpu_s = sum(gpu_ms) / 1e3
        out.update(graph_finite_checks_per_step=round(sum(s.graph_checks for s, _ in timed) / len(timed), 1),
                   forward_gpu_ms=round(1e3 * gpu_s / len(timed), 3),
                   host_ms_per_step=round(1e3 * (sum(s.seconds for s, _ in timed) - gpu_s) / len(timed), 3))
        if peak_gbps:
            out["forward_roofline_fraction"] = _sig(sum(b.total for _, b in timed) / gpu_s / 1e9 / peak_gbps)
        if floors is not None:
            out["forward_op_roofline_fraction"] = _sig(sum(f for f, s in zip(floors, steps) if s.events is not None)
                                                       / gpu_s)
    return out


def _sig(x: float) -> float:
    """4 significant digits (bandwidths and fractions span many decades between a CPU toy and an H200)."""
    return float(f"{x:.4g}")


def _kv_cache_bytes(model, workload: Workload, args) -> int | None:
    """--kv-cache-gb; else on CUDA what the workload needs (every sequence at its full length, pages of
    shared prompts counted once per sample: an upper bound) times KV_CACHE_MARGIN, at most the engine's
    default (RolloutConfig.gpu_memory_fraction of the free memory); else the engine's default."""
    if args.kv_cache_gb:
        return int(args.kv_cache_gb * 2**30)
    if args.device != "cuda":
        return None
    ps = args.page_size
    pages = sum(-(-(len(p) + workload.new_tokens) // ps) for p in workload.prompts) * workload.samples
    need = int(pages * ps * kv_bytes_per_token(model.config, model.dtype) * KV_CACHE_MARGIN)
    free, _ = torch.cuda.mem_get_info()
    return min(need, int(free * RolloutConfig().gpu_memory_fraction))


def _release(runner, device: str) -> None:

    runner.__dict__.clear()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _verify(model, completions, profile: str = "strict", token_budget: int = 8192) -> dict:
    """Recompute each completion's logprobs with the trainer's packed forward in ``profile``; count the
    tokens whose logprob bits differ."""

    mismatches = checked = 0
    batch: list = []
    for c in completions + [None]:
        if c is not None and (not batch or sum(len(b.prompt_tokens) + len(b.tokens) for b in batch)
                              + len(c.prompt_tokens) + len(c.tokens) <= token_budget):
            batch.append(c)
            continue
        seqs = [b.prompt_tokens + b.tokens for b in batch]
        targets = torch.tensor([t for s in seqs for t in s[1:] + [0]], device=model.device)
        with use_profile(profile), torch.no_grad():
            lp, _ = model.logprobs(ForwardBatch.packed(seqs, device=model.device), targets)
        offset = 0
        for b, s in zip(batch, seqs):
            first = offset + len(b.prompt_tokens) - 1
            ref = lp[first:first + len(b.tokens)].cpu()
            got = torch.tensor(b.logprobs, dtype=torch.float32)
            mismatches += count_differences(ref, got)
            checked += len(b.tokens)
            offset += len(s)
        batch = [c]
    return {"logprob_tokens_checked": checked, "logprob_mismatches": mismatches}


class _TransformersRun:
    """transformers ``generate`` on the same weights: set up and warmed up on creation; :meth:`timed` is
    one pass over every prompt."""

    def __init__(self, model_dir: Path, workload: Workload, args, dtype: str):
        from transformers import AutoModelForCausalLM   # lazy: transformers is heavy and only this engine needs it

        torch_dtype = getattr(torch, dtype)
        try:
            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype)
        except TypeError:  # transformers 4.x
            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch_dtype)
        self.hf = hf.to(args.device).eval()
        self.args, self.workload = args, workload
        self.pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
        self.eos = hf.config.eos_token_id if hf.config.eos_token_id is not None else self.pad
        self.prompts = workload.prompts[:args.hf_prompts] if args.hf_prompts else workload.prompts
        self.per_call = args.hf_batch_prompts or workload_defaults(args).get("hf_batch_prompts") or len(self.prompts)
        if _full_warmup(args) and args.device == "cpu":   # CUDA: nothing to capture or compile, a short warm-up
            self._all()
        else:
            self._call(self.prompts[:2], 4)
        self.generated = 0

    def _call(self, batch_prompts, new_tokens) -> int:
        dev, pad = self.args.device, self.pad
        width = max(len(p) for p in batch_prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts], device=dev)
        with torch.no_grad():
            out = self.hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                   top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   num_return_sequences=self.workload.samples, pad_token_id=pad, eos_token_id=self.eos)
        return (out.shape[1] - width) * out.shape[0]

    def _all(self) -> int:
        n = self.workload.new_tokens
        return sum(self._call(self.prompts[i:i + self.per_call], n) for i in range(0, len(self.prompts), self.per_call))

    def timed(self) -> float:
        _sync(self.args.device)
        t0 = time.perf_counter()
        self.generated = self._all()
        _sync(self.args.device)
        return time.perf_counter() - t0

    def row(self, runs: list[float]) -> dict:
        import transformers   # lazy: heavy, optional outside the test extra
        seconds = statistics.median(runs)
        return {"engine": "transformers", "profile": "native", "tokens_per_s": round(self.generated / seconds, 2),
                "seconds": round(seconds, 3), "generated_tokens": self.generated, "prompts": len(self.prompts),
                "prompts_per_call": self.per_call, "version": transformers.__version__,
                "runs_seconds": [round(r, 3) for r in runs]}

    def close(self) -> None:
        _release(self, self.args.device)


# ---- output --------------------------------------------------------------------------------------

def _environment(device: str) -> dict:
    env = environment(device)
    env.update(date=datetime.date.today().isoformat(), machine=platform.machine(), cpus=os.cpu_count())
    try:
        import transformers   # lazy: heavy, optional outside the test extra
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    env["threads"] = torch.get_num_threads()
    return env


def print_table(result: dict) -> None:
    w = result["workload"]
    print(f"rollout benchmark: {w['model']}, {w['dtype']} on {w['device']}; {w['prompts']} prompts x {w['samples']} "
          f"samples x {w['new_tokens']} new tokens (prompt tokens {w['prompt_tokens']}, lengths {w['prompt_len']})")
    if w.get("peak_gbps") or w.get("peak_tflops"):
        print(f"peaks: {w['peak_gbps']} GB/s ({w['peak_gbps_source']}), {w['peak_tflops']} TFLOP/s "
              f"({w['peak_tflops_source']}); card {w['card']}" + (f", {w['datasheet']}" if w.get("datasheet") else ""))
    print(f"{'engine':<14}{'profile':<9}{'tokens/s':>12}{'seconds':>10}{'tokens':>10}  notes")
    for r in result["rows"]:
        notes = {k: v for k, v in r.items() if k not in ("engine", "profile", "tokens_per_s", "seconds",
                                                          "generated_tokens")}
        print(f"{r['engine']:<14}{r['profile']:<9}{r['tokens_per_s']:>12.1f}{r['seconds']:>10.2f}"
              f"{r['generated_tokens']:>10}  {json.dumps(notes)}")
    for r in result["rows"]:
        if r.get("decode_steps"):
            print(f"decode {r['profile']:<7} {r['decode_steps']} steps of {r['decode_rows_mean']} rows x "
                  f"{r['decode_context_mean']} context: step {r['decode_step_ms']} ms (forward on the GPU "
                  f"{r['forward_gpu_ms']} ms, host {r['host_ms_per_step']} ms), {r['bytes_per_decode_step'] / 1e9:.4g} GB "
                  f"moved -> {r['achieved_gbps']} GB/s, roofline fraction {r['roofline_fraction']} "
                  f"(forward only {r['forward_roofline_fraction']}); per-op roofline {r.get('op_floor_ms')} ms a "
                  f"step, fraction {r.get('op_roofline_fraction')} (forward only {r.get('forward_op_roofline_fraction')})")
    for r in result["rows"]:
        if "kernel_profile" in r:
            kp = r["kernel_profile"]
            print(f"kernels {r['profile']:<7} {kp['kernel_ms']} ms per {kp['per']}: " + ", ".join(
                f"{name} {f['ms']} ms ({f['share']:.0%})" for name, f in kp["families"].items()))
    print("ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()))
    env = result["environment"]
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if v is not None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlalign bench rollout", description=HELP)
    add_arguments(parser)
    try:
        return run_cli(parser.parse_args(argv))
    except RLAlignError as exc:   # one line, exit 2, as rlalign.cli.main does
        print(f"rlalign bench rollout: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
