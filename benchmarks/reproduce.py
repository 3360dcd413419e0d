"""Rerun the published numbers and print each beside the value README.md / benchmarks/RESULTS.md publish.

    python benchmarks/reproduce.py [--device cpu|cuda] [--only ID,...] [--repeats N] [--json OUT]
                              [--save-outputs DIR] [--list]

The rule for a published number (README.md, benchmarks/RESULTS.md): it names the committed command that
produces it; it is measured through the public op or engine (a kernel-only figure may appear beside,
labelled "kernel only"); a timing is the median of >= 3 runs of that command, published with the
spread [min - max] and the machine's load. ``CLAIMS`` below is that list for the README: for each
number, the sentence it appears in, the published value, the command a user runs, the device it
needs, how the value is read from the command's output and how many runs it takes. Deterministic
results (the default run's accuracy, mismatch counts) take one run: the strict profile makes them
bit-identical from run to run, so repeating measures nothing.

For every claim whose device is present (or those named by ``--only``), each distinct command is run
``max(repeats)`` times in a fresh temporary directory, with the 1-minute load average read before
and after; the claim prints published vs reproduced median [min - max] and a verdict:

* ``reproduced``: every element of the median is within the claim's tolerance of the published value;
* ``NOT reproduced``: it is not (the published number must be corrected or withdrawn);
* ``not published``: the claim has no published value yet (a marked place in the README that the
  next run on that device fills in);
* ``command failed``: the command exited non-zero (its stderr tail is printed).

Exit status 1 when any claim run is not reproduced or its command failed. ``--save-outputs DIR``
keeps each run's raw output (the files to commit under benchmarks/runs/ as the recorded output of a new
measurement). tests/test_reproduce.py checks the table without running anything heavy: every command
names an existing script / CLI subcommand and parses, every claim's sentence is in the README, and
every reader parses its recorded output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
TIMING = "a timing: the median of >= 3 runs, with the spread"
DETERMINISTIC = ("deterministic: the strict profile gives the same bits every run (fixed seeds), so one run is "
                 "the result")


@dataclasses.dataclass(frozen=True)
class Check:
    """How a reproduced median is compared with the published value, element by element.

    ``abs``: |median - published| <= tol (counts: tol 0; values rounded when published: half the last
    digit); ``rel``: |median / published - 1| <= tol (timings and their ratios)."""
    kind: str
    tol: float

    def holds(self, published: float, median: float) -> bool:
        if self.kind == "abs":
            return abs(median - published) <= self.tol + 1e-12
        if published == 0:
            return median == 0
        return abs(median / published - 1.0) <= self.tol + 1e-12

    def describe(self) -> str:
        if self.kind == "abs":
            return "exact" if self.tol == 0 else f"within {self.tol:g}"
        return f"within {self.tol:.0%}"


EXACT = Check("abs", 0.0)


@dataclasses.dataclass(frozen=True)
class Claim:
    id: str
    source: str                      # the file that publishes it (README.md)
    sentence: str                    # verbatim text of that file the number appears in
    published: tuple[float, ...] | None   # None: a marked place, not published yet
    labels: tuple[str, ...]          # what each element of the value is
    command: str                     # what a user types (``rlalign`` = the CLI); {out}: a fresh folder
    output: str                      # "stdout", or a file under {out} the command writes
    read: Callable[[str], tuple[float, ...]]   # the output's text -> the value
    device: str                      # cpu | cuda | cuda:2 (two GPUs)
    repeats: int
    why: str                         # why this many runs
    check: Check
    recorded: str                    # a recorded output of this command in the repository (tests parse it)
    recorded_matches: bool = True    # the recorded output is where the published value came from
    note: str = ""                   # what the value is, in words (kernel only, workload, ...)
    exit_ok: tuple[int, ...] = (0,)  # the last step's exit statuses that still mean "here is the output"


# ---- readers: the command's output text -> the value ---------------------------------------------

def _json(text: str) -> dict:
    return json.loads(text)


def rollout_ratio(key: str, text: str) -> tuple[float, ...]:
    """``rlalign bench rollout --json``: ratios[key] (tokens/s of one engine over another's)."""
    return (float(_json(text)["ratios"][key]),)


def rollout_mismatches(text: str) -> tuple[float, ...]:
    """``rlalign bench rollout --verify --json``: (strict logprobs that differ from the trainer's, checked)."""
    row = next(r for r in _json(text)["rows"] if r["engine"] == "rlalign" and r["profile"] == "strict")
    return float(row["logprob_mismatches"]), float(row["logprob_tokens_checked"])


def _metrics(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def train_first_last(key: str, text: str) -> tuple[float, ...]:
    """A run's metrics.jsonl: the first and the last logged value of ``key`` (e.g. held-out accuracy)."""
    values = [m[key] for m in _metrics(text) if key in m]
    return float(values[0]), float(values[-1])


def train_mismatches(text: str) -> tuple[float, ...]:
    """A run's metrics.jsonl: (mismatch/count summed over steps, mismatch/tokens summed)."""
    steps = [m for m in _metrics(text) if "mismatch/count" in m]
    return float(sum(m["mismatch/count"] for m in steps)), float(sum(m["mismatch/tokens"] for m in steps))


def train_routing(text: str) -> tuple[float, ...]:
    """A MoE run's metrics.jsonl: (moe/routing_mismatch summed over steps, moe/routing_tokens summed): the
    (token, sparse layer) top-k expert sets that differ between rollout and trainer, and those compared."""
    steps = [m for m in _metrics(text) if "moe/routing_tokens" in m]
    if not steps:
        raise ValueError("no moe/routing_* metrics in the output (not a MoE run, or routing not recorded)")
    return float(sum(m["moe/routing_mismatch"] for m in steps)), float(sum(m["moe/routing_tokens"] for m in steps))


def parity_counts(text: str) -> tuple[float, ...]:
    """``rlalign parity --json``: (token logprobs that differ, tokens compared)."""
    d = _json(text)
    return float(d["mismatches"]), float(d["tokens_compared"])


def tp_differences(text: str) -> tuple[float, ...]:
    """``scripts/gpu_tp.py`` JSON: (logprobs differing TP=N vs TP=1, gradient elements differing)."""
    d = _json(text)
    key = next(k for k in d if k.startswith("tp") and k.endswith("_vs_tp1"))
    return float(d[key]["lp"]["differ"]), float(d[key]["grads_differ_total"])


def _rows(text: str) -> list[dict]:
    return [r for r in _json(text)["rows"] if "error" not in r]


def _span(values: list[float], what: str) -> tuple[float, ...]:
    if not values:
        raise ValueError(f"no rows for {what} in the output")
    return min(values), max(values)


# the 4096-wide linears of a Qwen3-8B layer (k_proj/v_proj, 1,024 outputs, and the LM head are not)
WIDE_LAYERS = ("q_proj", "o_proj", "gate_proj", "down_proj")


def linear_layers(m_min: int, m_max: int, text: str) -> tuple[float, ...]:
    """``benchmarks/gpu_linear.py --set layers``: (min, max) of op_vs_flinear over the 4096-wide layers
    (ops.linear as the model calls it vs F.linear) at m_min <= M <= m_max."""
    values = [r["op_vs_flinear"] for r in _rows(text)
              if r.get("kind") == "layer" and r["layer"] in WIDE_LAYERS and m_min <= r["M"] <= m_max]
    return _span(values, f"layers at {m_min} <= M <= {m_max}")


def linear_kernel(m_min: int, text: str) -> tuple[float, ...]:
    """``benchmarks/gpu_linear.py --set kernel``: (min, max) kernel-only ratio (cuBLAS time / strict kernel
    time) over the plain (k_segments=1) shapes at M >= m_min."""
    values = [r["ratio"] for r in _rows(text) if r.get("kind", "shape") == "shape" and not r.get("sweep")
              and r["k_segments"] == 1 and r["M"] >= m_min]
    return _span(values, f"plain shapes at M >= {m_min}")


def attention(kind: str, batch: int, hkv: tuple[int, ...], field: str, text: str) -> tuple[float, ...]:
    """``benchmarks/gpu_attention.py``: (min, max) of ``field`` (ratio: kernel only; op_ratio: the public op)
    over the rows of this kind, batch and kv-head counts (seq 4,096, 32 query heads)."""
    values = [r[field] for r in _rows(text)
              if r["kind"] == kind and r["batch"] == batch and r["hq"] == 32 and r["hkv"] in hkv and r["seq"] == 4096]
    return _span(values, f"{kind} batch {batch}")


def attention_row(kind: str, batch: int, hkv: int, field: str, text: str) -> tuple[float, ...]:
    """``benchmarks/gpu_attention.py``: ``field`` of the one row of this kind, batch and 32/hkv heads."""
    lo, hi = attention(kind, batch, (hkv,), field, text)
    if lo != hi:
        raise ValueError(f"more than one {kind} row for batch {batch}, 32/{hkv} heads")
    return (lo,)


def logprob(case: str, text: str) -> tuple[float, ...]:
    """``benchmarks/gpu_logprob.py``: (time, peak memory) of ``case`` as fractions of the naive forward's."""
    row = next(r for r in _rows(text) if r.get("case") == case)
    return float(row["time_ratio"]), float(row["mem_ratio"])


# ---- the claims ------------------------------------------------------------------------------------

ROLLOUT_CPU = "rlalign bench rollout --device cpu --json"
ROLLOUT_CPU_PROMPT_HEAVY = "rlalign bench rollout --device cpu --json --prompt-len 32:48 --new-tokens 16"
ROLLOUT_H200 = "rlalign bench rollout --device cuda --json --prompts 64 --new-tokens 256 --verify"
ROLLOUT_H200_FULL = "rlalign bench rollout --device cuda --json --hf-prompts 64 --engines strict,transformers --verify"
DEFAULT_TRAIN = "rlalign train run.dir={out}/run run.progress=false"
# The default run's own metrics (benchmarks/evidence/default-run-cpu/metrics.jsonl, cited by the README) were never
# committed; until they are, its readers are checked on `rlalign train`'s metrics.jsonl of the H200
# 200-step run: the same writer, the same keys.
DEFAULT_TRAIN_RECORDED = "benchmarks/evidence/default-run-cpu/metrics.jsonl"
GRPO_200 = ("python scripts/shaped_model.py qwen3-0.6b {out}/m06 --tokenizer default && rlalign train "
            "configs/gpu-grpo-200.yaml model.path={out}/m06 run.dir={out}/run run.progress=false")
PARITY_06B = ("python scripts/shaped_model.py qwen3-0.6b {out}/m && rlalign parity --model {out}/m --device cuda "
              "--prompts 16 --samples 4 --max-new-tokens 64 --json")
PARITY_8B = ("python scripts/shaped_model.py qwen3-8b {out}/m && rlalign parity --model {out}/m --device cuda "
             "--prompts 8 --samples 4 --max-new-tokens 32 --json")
PARITY_06B_NATIVE = ("python scripts/shaped_model.py qwen3-0.6b {out}/m && rlalign parity --model {out}/m "
                     "--device cuda --profile native --train transformers --prompts 16 --samples 4 "
                     "--max-new-tokens 16 --json")
MOE_CPU = ("python scripts/make_moe_model.py {out}/moe && rlalign train configs/moe-cpu.yaml model.path={out}/moe "
           "run.dir={out}/run run.progress=false")
# what scripts/gpu_moe.sh runs (STEPS=50 TRAIN_ARGS="run.eval_every=25"); the final checkpoint is ~40 GB
MOE_H200 = ("python scripts/make_moe_model.py {out}/moe --shape qwen3-30b-a3b --layers 4 && rlalign train "
            "configs/moe-h200.yaml model.path={out}/moe run.dir={out}/run run.steps=50 run.eval_every=25 "
            "run.checkpoint_every=50 run.keep_checkpoints=1 run.progress=false")
PARITY_CPU_NATIVE = "rlalign parity --profile native --train transformers --prompts 16 --samples 4 --json"
TIMING_REL = Check("rel", 0.15)   # a shared CPU's runs spread about this much; the GPU's less
GPU_REL = Check("rel", 0.10)
ROUNDED_2 = Check("abs", 0.005)   # a deterministic value published to 2 decimals

CLAIMS: tuple[Claim, ...] = (
    # -- the embedded default run (CPU): deterministic
    Claim("default-accuracy", "README.md", "held-out accuracy **0.18 → 0.95**", (0.18, 0.95),
          ("step 0", "step 120"), DEFAULT_TRAIN, "run/metrics.jsonl", partial(train_first_last, "eval/accuracy"),
          "cpu", 1, DETERMINISTIC, ROUNDED_2, DEFAULT_TRAIN_RECORDED, recorded_matches=False,
          note="held-out accuracy, 2 samples per problem at T=1, first and last evaluation"),
    Claim("default-greedy", "README.md", "(greedy 0.005 → 0.98)", (0.005, 0.98), ("step 0", "step 120"),
          DEFAULT_TRAIN, "run/metrics.jsonl", partial(train_first_last, "eval/accuracy_greedy"), "cpu", 1,
          DETERMINISTIC, ROUNDED_2, DEFAULT_TRAIN_RECORDED, recorded_matches=False),
    Claim("default-mismatches", "README.md", "**0 mismatches in 117,933 token log-probs compared**", (0, 117933),
          ("differing", "compared"), DEFAULT_TRAIN, "run/metrics.jsonl", train_mismatches, "cpu", 1,
          DETERMINISTIC, EXACT, DEFAULT_TRAIN_RECORDED, recorded_matches=False,
          note="rollout vs trainer log-prob of every sampled token of every step"),
    Claim("cpu-native-parity", "README.md", "differ on **614 of 618** sampled tokens", (614, 618),
          ("differing", "compared"), PARITY_CPU_NATIVE, "stdout", parity_counts, "cpu", 1,
          "deterministic at a fixed thread count on one machine (stock kernels do not change from run to run; "
          "they change with the batch): one run", EXACT, "benchmarks/evidence/parity/cpu-native.json",
          note="native profile: the engine's log-probs vs transformers' training forward, embedded model",
          exit_ok=(0, 1)),   # rlalign parity exits 1 when log-probs differ: here that is the finding
    Claim("h200-native-parity", "README.md",
          "**1,024 of 1,024** differ (one run, 2026-12-01)", (1024, 1024),
          ("differing", "compared"), PARITY_06B_NATIVE, "stdout", parity_counts, "cuda", 1,
          "deterministic at a fixed machine and batch (stock kernels repeat themselves run to run): one run", EXACT,
          "benchmarks/evidence/parity/h200-06b-native.json", recorded_matches=True, exit_ok=(0, 1),
          note="native profile: the engine's log-probs vs transformers' training forward, Qwen3-0.6B shape, bf16"),
    # -- CPU rollout (timings)
    Claim("cpu-rollout-vs-generate", "README.md", "strict / `generate` **1.27x**", (1.27,), ("strict / generate",),
          ROLLOUT_CPU, "stdout", partial(rollout_ratio, "strict_vs_transformers"), "cpu", 3, TIMING, TIMING_REL,
          "benchmarks/runs/rollout_cpu_default_kernels_1.json", recorded_matches=False,
          note="embedded default model, 64 prompts x 8 samples x 32 new tokens; published: 3 runs, 2026-12-01 "
               "(1.02-1.39); issue 22's 4 runs the same day gave 0.94-1.03"),
    Claim("cpu-rollout-vs-native", "README.md", "strict / native profile **1.36x**", (1.36,), ("strict / native",),
          ROLLOUT_CPU, "stdout", partial(rollout_ratio, "strict_vs_native"), "cpu", 3, TIMING, TIMING_REL,
          "benchmarks/runs/rollout_cpu_default_kernels_1.json", recorded_matches=False),
    Claim("cpu-rollout-prompt-heavy", "README.md", "strict / `generate` prompt-heavy: **2.43x**",
          (2.43,), ("strict / generate",), ROLLOUT_CPU_PROMPT_HEAVY, "stdout",
          partial(rollout_ratio, "strict_vs_transformers"), "cpu", 3, TIMING, TIMING_REL,
          "benchmarks/runs/rollout_cpu_kernels_prompt_heavy.json", recorded_matches=False),
    # -- H200 rollout
    Claim("h200-rollout-vs-generate", "README.md", "strict / `generate` **4.86x** (64 x 8 x 256", (4.86,),
          ("strict / generate",), ROLLOUT_H200, "stdout", partial(rollout_ratio, "strict_vs_transformers"), "cuda",
          3, TIMING, GPU_REL, "benchmarks/runs/rollout_h200_64x8x256_2026-12-01_1.json", recorded_matches=False,
          note="Qwen3-0.6B shape, bf16, decode from CUDA graphs; published: median of 3 runs, 2026-12-01"),
    Claim("h200-rollout-vs-native", "README.md", "strict / native profile **7.71x**", (7.71,), ("strict / native",),
          ROLLOUT_H200, "stdout", partial(rollout_ratio, "strict_vs_native"), "cuda", 3, TIMING, GPU_REL,
          "benchmarks/runs/rollout_h200_64x8x256_2026-12-01_1.json", recorded_matches=False,
          note="published: median of 3 runs, 2026-12-01, before the native profile had CUDA-graph decode; "
               "a rerun now measures native with graphs (the fair baseline), so expect a smaller ratio"),
    Claim("h200-rollout-mismatches", "README.md", "0 of 131,072 log-probs differ", (0, 131072),
          ("differing", "checked"), ROLLOUT_H200, "stdout", rollout_mismatches, "cuda", 1, DETERMINISTIC, EXACT,
          "benchmarks/runs/rollout_h200_64x8x256_session5.json"),
    Claim("h200-rollout-full-vs-generate", "README.md", "256 x 8 x 512: strict / `generate` **13.5x**", (13.5,),
          ("strict / generate",), ROLLOUT_H200_FULL, "stdout", partial(rollout_ratio, "strict_vs_transformers"),
          "cuda", 3, TIMING, GPU_REL, "benchmarks/runs/rollout_h200_256x8x512_2026-12-02.json",
          note="published: one run, 2026-12-02 (RESULTS session 12); transformers on the first 64 prompts; "
               "session 4's run gave 7.10x (benchmarks/runs/rollout_h200_256x8x512.json)"),
    # -- H200 GEMM, attention, logprob
    Claim("h200-linear-op-m1024", "README.md", "M = 1,024: **0.29-0.85x**", (0.29, 0.85), ("min", "max"),
          "python benchmarks/gpu_linear.py --set layers --out {out}", "bench_linear.json",
          partial(linear_layers, 1024, 1024), "cuda", 3, TIMING, GPU_REL, "", recorded_matches=False,
          note="ops.linear as the models call it vs F.linear, Qwen3-8B q/o/gate/down, bf16; published: 3 runs, 2026-12-01"),
    Claim("h200-linear-op-m4096", "README.md", "M ≥ 4,096: **0.33-0.91x**", (0.33, 0.91), ("min", "max"),
          "python benchmarks/gpu_linear.py --set layers --out {out}", "bench_linear.json",
          partial(linear_layers, 4096, 1 << 30), "cuda", 3, TIMING, GPU_REL, "", recorded_matches=False),
    Claim("h200-linear-op-decode", "README.md", "M ≤ 64 (decode): **0.14-0.33x**", (0.14, 0.33), ("min", "max"),
          "python benchmarks/gpu_linear.py --set layers --out {out}", "bench_linear.json",
          partial(linear_layers, 1, 64), "cuda", 3, TIMING, GPU_REL, ""),
    Claim("h200-linear-kernel", "README.md", "kernel only, without the op: 0.91-1.06x", (0.91, 1.06), ("min", "max"),
          "python benchmarks/gpu_linear.py --set kernel --out {out}", "bench_linear.json", partial(linear_kernel, 1024),
          "cuda", 3, TIMING, GPU_REL, "benchmarks/gpu_2026-11-30b/bench_linear.json",
          note="kernel only: the strict GEMM kernel vs torch.matmul at M >= 1,024, plain shapes incl. the LM head"),
    Claim("h200-attention-prefill-op", "README.md", "8 x 4,096 tokens, 32/8 heads: **0.97x**", (0.97,),
          ("op / SDPA speed",), "python benchmarks/gpu_attention.py --out {out}", "bench_attention.json",
          partial(attention_row, "prefill", 8, 8, "op_ratio"), "cuda", 3, TIMING, GPU_REL, "",
          recorded_matches=False, note="ops.attention_varlen vs SDPA flash; published: 3 runs, 2026-12-01"),
    Claim("h200-attention-prefill-kernel", "README.md", "kernel only: 1.17-1.20x", (1.17, 1.20), ("min", "max"),
          "python benchmarks/gpu_attention.py --out {out}", "bench_attention.json",
          partial(attention, "prefill", 4, (8, 32), "ratio"), "cuda", 3, TIMING, GPU_REL,
          "benchmarks/gpu_2026-11-30/bench_attention.json",
          note="kernel only: 4 x 4,096 tokens, 32/8 and 32/32 heads"),
    Claim("h200-logprob-op", "README.md", "fused log-prob through the op: **0.72x** the time and **0.017x**", (0.72, 0.017), ("time", "memory"),
          "python benchmarks/gpu_logprob.py --out {out}", "bench_logprob.json", partial(logprob, "op logprob"), "cuda",
          3, TIMING, GPU_REL, ""),
    Claim("h200-logprob-kernel", "README.md", "kernel only: 0.69x the time and 0.0039x the peak memory",
          (0.69, 0.0039), ("time", "memory"), "python benchmarks/gpu_logprob.py --out {out}", "bench_logprob.json",
          partial(logprob, "ours logprob"), "cuda", 3, TIMING, Check("rel", 0.10),
          "benchmarks/gpu_2026-11-30b/bench_logprob.json"),
    # -- Qwen3-MoE runs: deterministic
    Claim("cpu-moe-mismatches", "README.md", "with **0 of 99,644** log-probs", (0, 99644), ("differing", "compared"),
          MOE_CPU, "run/metrics.jsonl", train_mismatches, "cpu", 1, DETERMINISTIC, EXACT,
          "benchmarks/evidence/moe-cpu/metrics.jsonl", note="configs/moe-cpu.yaml, 100 steps"),
    Claim("cpu-moe-routing", "README.md", "and **0 of 1,014,544** (token, layer) expert choices differing",
          (0, 1014544), ("differing", "compared"), MOE_CPU, "run/metrics.jsonl", train_routing, "cpu", 1,
          DETERMINISTIC, EXACT, "benchmarks/evidence/moe-cpu/metrics.jsonl"),
    Claim("h200-moe-mismatches", "README.md", "50 strict GRPO steps with **0 of 204,794** log-probs", (0, 204794),
          ("differing", "compared"), MOE_H200, "run/metrics.jsonl", train_mismatches, "cuda", 1, DETERMINISTIC,
          EXACT, "benchmarks/evidence/moe-h200/grpo-30b-a3b-4l-metrics.jsonl",
          note="Qwen3-30B-A3B shape cut to 4 layers, full vocabulary, configs/moe-h200.yaml"),
    Claim("h200-moe-routing", "README.md", "**0 of 1,225,576** (token, layer) expert choices", (0, 1225576),
          ("differing", "compared"), MOE_H200, "run/metrics.jsonl", train_routing, "cuda", 1, DETERMINISTIC,
          EXACT, "benchmarks/evidence/moe-h200/grpo-30b-a3b-4l-metrics.jsonl"),
    # -- H200 end to end: deterministic
    Claim("h200-grpo-200-mismatches", "README.md", "**0 mismatches in 183,353 token log-probs**", (0, 183353),
          ("differing", "compared"), GRPO_200, "run/metrics.jsonl", train_mismatches, "cuda", 1, DETERMINISTIC,
          EXACT, "benchmarks/runs/gpu200_h200_graphs_metrics.jsonl"),
    Claim("h200-parity-06b", "README.md", "0 differing log-probs on a Qwen3-0.6B-shaped model (0 of 4,096)",
          (0, 4096), ("differing", "compared"), PARITY_06B, "stdout", parity_counts, "cuda", 1, DETERMINISTIC, EXACT,
          "benchmarks/gpu_2026-11-30c/parity_06b.json"),
    Claim("h200-parity-8b", "README.md", "on a Qwen3-8B-shaped one (0 of 1,024)", (0, 1024), ("differing", "compared"),
          PARITY_8B, "stdout", parity_counts, "cuda", 1, DETERMINISTIC, EXACT, "benchmarks/gpu_2026-11-30c/parity_8b.json"),
    Claim("h200-tp2", "README.md", "TP=2 equals TP=1 bit for bit, gradients included (0 differing", (0, 0),
          ("logprobs differing", "gradient elements differing"), "python scripts/gpu_tp.py --out {out}",
          "gpu_tp.json", tp_differences, "cuda:2", 1, DETERMINISTIC, EXACT, "benchmarks/evidence/tp-h200/tp2.json"),
)


# ---- running ---------------------------------------------------------------------------------------

def claims_by_id() -> dict[str, Claim]:
    return {c.id: c for c in CLAIMS}


def devices_present() -> set[str]:
    present = {"cpu"}
    try:
        import torch
        if torch.cuda.is_available():
            present.add("cuda")
            if torch.cuda.device_count() >= 2:
                present.add("cuda:2")
    except ImportError:
        pass
    return present


def argv_steps(command: str, out: Path) -> list[list[str]]:
    """The command as argv lists (``a && b`` is two steps): ``rlalign`` runs this checkout's CLI and
    ``python`` this interpreter; {out} is the run's fresh folder."""
    steps = []
    for part in command.format(out=out).split("&&"):
        argv = shlex.split(part)
        if argv[0] == "rlalign":
            argv = [sys.executable, "-m", "rlalign.cli.main", *argv[1:]]
        elif argv[0] == "python":
            argv = [sys.executable, *argv[1:]]
        steps.append(argv)
    return steps


@dataclasses.dataclass
class Run:
    text: str | None
    seconds: float
    load_before: float
    load_after: float
    error: str | None = None


def run_command(command: str, output: str, exit_ok: tuple[int, ...] = (0,), timeout: float | None = None) -> Run:
    """One run of ``command`` in a fresh folder; its output's text (stdout or the named file)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="rlalign-reproduce-") as tmp:
        out = Path(tmp)
        load_before, t0, stdout = os.getloadavg()[0], time.perf_counter(), ""
        steps = argv_steps(command, out)
        for i, argv in enumerate(steps):
            try:
                proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return Run(None, time.perf_counter() - t0, load_before, os.getloadavg()[0],
                           f"timed out after {timeout:g} s in `{shlex.join(argv)}`")
            if proc.returncode not in (exit_ok if i == len(steps) - 1 else (0,)):
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
                return Run(None, time.perf_counter() - t0, load_before, os.getloadavg()[0],
                           f"rc={proc.returncode} in `{shlex.join(argv)}`: " + " | ".join(tail))
            stdout = proc.stdout
        seconds, load_after = time.perf_counter() - t0, os.getloadavg()[0]
        path = out / output
        if output != "stdout" and not path.is_file():
            return Run(None, seconds, load_before, load_after, f"the command wrote no {output}")
        return Run(stdout if output == "stdout" else path.read_text(), seconds, load_before, load_after)


def save_output(folder: Path, claim: Claim, index: int, text: str) -> None:
    """The raw output of run ``index`` of ``claim``'s command, as <claim id>_<index>.<ext>."""
    folder.mkdir(parents=True, exist_ok=True)
    suffix = "".join(Path(claim.output).suffixes) if claim.output != "stdout" else ".json"
    (folder / f"{claim.id}_{index}{suffix}").write_text(text)


def summarize(claim: Claim, runs: list[Run]) -> dict:
    """Per element: median, min, max over the runs; the verdict against the published value."""
    result = {"id": claim.id, "command": claim.command, "device": claim.device, "published": claim.published,
              "labels": claim.labels, "runs": [], "loads": [(round(r.load_before, 2), round(r.load_after, 2))
                                                           for r in runs]}
    failed = [r.error for r in runs if r.error]
    if failed:
        return {**result, "verdict": "command failed", "error": failed[0]}
    try:
        values = [claim.read(r.text) for r in runs]
    except (KeyError, ValueError, StopIteration, IndexError, TypeError) as exc:
        return {**result, "verdict": "command failed", "error": f"could not read the output: {exc!r}"}
    columns = list(zip(*values))
    result.update(runs=values, median=tuple(statistics.median(c) for c in columns),
                  min=tuple(min(c) for c in columns), max=tuple(max(c) for c in columns))
    if claim.published is None:
        result["verdict"] = "not published"
    elif all(claim.check.holds(p, m) for p, m in zip(claim.published, result["median"])):
        result["verdict"] = f"reproduced ({claim.check.describe()})"
    else:
        result["verdict"] = f"NOT reproduced (tolerance: {claim.check.describe()})"
    return result


def _fmt(values) -> str:
    return "/".join(f"{v:,.0f}" if float(v).is_integer() and abs(v) >= 10 else f"{v:.4g}" for v in values)


def print_result(claim: Claim, r: dict) -> None:
    published = _fmt(claim.published) if claim.published is not None else "(not published)"
    print(f"{claim.id}  [{claim.device}]  {' / '.join(claim.labels)}")
    if claim.note:
        print(f"    what:       {claim.note}")
    print(f"    command:    {claim.command}")
    if "median" in r:
        print(f"    published:  {published}")
        print(f"    reproduced: {_fmt(r['median'])} [{_fmt(r['min'])} - {_fmt(r['max'])}] "
              f"(median [min - max] of {len(r['runs'])} run{'s' if len(r['runs']) > 1 else ''})")
    else:
        print(f"    published:  {published}\n    error:      {r['error']}")
    loads = ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in r["loads"])
    print(f"    load average (1 min) before -> after each run: {loads}")
    print(f"    verdict:    {r['verdict']}", flush=True)


def select(only: str | None, device: str | None) -> list[Claim]:
    table = claims_by_id()
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n not in table]
        if unknown:
            raise SystemExit(f"reproduce: unknown claim(s) {unknown}; --list shows the ids")
        chosen = [table[n] for n in names]
    else:
        chosen = list(CLAIMS)
    if device:
        chosen = [c for c in chosen if c.device.split(":")[0] == device]
    present = devices_present()
    missing = [c.id for c in chosen if c.device not in present]
    if missing:
        print(f"reproduce: skipped (device not present here): {', '.join(missing)}", file=sys.stderr)
    return [c for c in chosen if c.device in present]


def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "python": platform.python_version(),
           "machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip()
    except OSError:
        pass
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="rerun the README's published numbers; print published vs reproduced")
    p.add_argument("--device", choices=("cpu", "cuda"), help="only the claims for this device (default: all present)")
    p.add_argument("--only", metavar="ID,...", help="only these claims (--list shows the ids)")
    p.add_argument("--repeats", type=int, help="runs per timing claim (default: each claim's own, >= 3); "
                                               "deterministic claims always run once")
    p.add_argument("--json", metavar="OUT", help="also write every claim's result to this JSON file")
    p.add_argument("--save-outputs", metavar="DIR",
                   help="keep each run's raw output here, as <claim id>_<run>.<ext> (to record under benchmarks/runs/)")
    p.add_argument("--timeout", type=float, metavar="S", help="give up on a command run after S seconds")
    p.add_argument("--list", action="store_true", help="print the claims table and exit")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        raise SystemExit("reproduce: --repeats must be >= 1")
    if args.list:
        for c in CLAIMS:
            published = _fmt(c.published) if c.published else "-"
            print(f"{c.id:32} {c.device:7} x{c.repeats}  {published:>16}  {c.command}")
        return 0
    chosen = select(args.only, args.device)
    if not chosen:
        raise SystemExit("reproduce: no claim to run here (their device is not present); --list shows the table")
    print(f"reproduce: {len(chosen)} claims; {environment()}", flush=True)
    results, runs_of = [], {}
    for claim in chosen:
        wanted = claim.repeats if claim.repeats == 1 or args.repeats is None else args.repeats
        key = (claim.command, claim.output)
        runs = runs_of.setdefault(key, [])
        while len(runs) < wanted:   # claims on one command share its runs
            runs.append(run_command(claim.command, claim.output, claim.exit_ok, args.timeout))
            if args.save_outputs and runs[-1].text is not None:
                save_output(Path(args.save_outputs), claim, len(runs), runs[-1].text)
        result = summarize(claim, runs[:wanted])
        print_result(claim, result)
        results.append(result)
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment(), "claims": results}, indent=1))
    bad = [r["id"] for r in results if r["verdict"].startswith(("NOT", "command failed"))]
    print(f"reproduce: {len(results) - len(bad)} of {len(results)} claims reproduced or not yet published"
          + (f"; not reproduced / failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
