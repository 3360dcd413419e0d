"""Rerun the README's published numbers and print each beside the value README.md publishes.

    python benchmarks/reproduce.py [--device cpu|cuda] [--only ID,...] [--repeats N] [--json OUT]
                                   [--save-outputs DIR] [--list]

The rule for a published number: it names the committed command that produces it; it is measured through the
public op or engine; it names its card and date; and the raw output it came from is kept under
``benchmarks/evidence/`` (``Claim.recorded``; ``benchmarks/evidence/README.md`` lists every kept file and the claim
or document that cites it). ``CLAIMS`` below is README.md's results table: for each row, the sentence it appears
in, the published value, the command a user runs, the device it needs, how the value is read from the command's
output and how many runs it takes. Deterministic results (accuracy, mismatch counts) take one run: the strict
profile makes them bit-identical from run to run, so repeating measures nothing. A timing published from one
recorded run says so in its sentence; reproducing it takes three runs, compared by their median.

For every claim whose device is present (or those named by ``--only``), each distinct command is run
``max(repeats)`` times in a fresh temporary directory, with the 1-minute load average read before and after; the
claim prints published vs reproduced median [min - max] and a verdict:

* ``reproduced``: every element of the median is within the claim's tolerance of the published value;
* ``NOT reproduced``: it is not (the published number must be corrected or withdrawn);
* ``not published``: the claim has no published value yet;
* ``command failed``: the command exited non-zero (its stderr tail is printed).

Exit status 1 when any claim run is not reproduced or its command failed. ``--save-outputs DIR`` keeps each run's
raw output (what to put under benchmarks/evidence/ as the recorded output of a new measurement).
tests/test_reproduce.py checks the table without running anything heavy: every command names an existing script or
CLI subcommand and parses, every claim's sentence is in the README, and every reader parses its recorded output.
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

def rollout_ratio(key: str, text: str) -> tuple[float, ...]:
    """``rlalign bench rollout --json``: ratios[key] (tokens/s of one engine over another's)."""
    return (float(_json_tail(text)["ratios"][key]),)


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


def accuracy_and_mismatches(text: str) -> tuple[float, ...]:
    """A run's metrics.jsonl: the first and last held-out accuracy, then :func:`train_mismatches`."""
    return train_first_last("eval/accuracy", text) + train_mismatches(text)


def train_verified(text: str) -> tuple[float, ...]:
    """An asynchronous run's metrics.jsonl with run.verify_behaviour: (behaviour log-probs that differ from their
    recompute under the recorded version's weights, summed over steps; behaviour log-probs compared)."""
    steps = [m for m in _metrics(text) if "verify/behaviour_tokens" in m]
    if not steps:
        raise ValueError("no verify/behaviour_* metrics in the output (run.verify_behaviour was off)")
    return (float(sum(m["verify/behaviour_mismatch"] for m in steps)),
            float(sum(m["verify/behaviour_tokens"] for m in steps)))


def train_routing(text: str) -> tuple[float, ...]:
    """A MoE run's metrics.jsonl: (moe/routing_mismatch summed over steps, moe/routing_tokens summed): the
    (token, sparse layer) top-k expert sets that differ between rollout and trainer, and those compared."""
    steps = [m for m in _metrics(text) if "moe/routing_tokens" in m]
    if not steps:
        raise ValueError("no moe/routing_* metrics in the output (not a MoE run, or routing not recorded)")
    return float(sum(m["moe/routing_mismatch"] for m in steps)), float(sum(m["moe/routing_tokens"] for m in steps))


def parity_counts(text: str) -> tuple[float, ...]:
    """``rlalign parity --json``: (token logprobs that differ, tokens compared)."""
    d = _json_tail(text)
    return float(d["mismatches"]), float(d["tokens_compared"])


def tp_differences(text: str) -> tuple[float, ...]:
    """``scripts/gpu_tp.py`` JSON: (logprobs differing TP=N vs TP=1, gradient elements differing)."""
    d = _json_tail(text)
    key = next(k for k in d if k.startswith("tp") and k.endswith("_vs_tp1"))
    return float(d[key]["lp"]["differ"]), float(d[key]["grads_differ_total"])


def _json_tail(text: str) -> dict:
    """The JSON object a command printed after its progress lines (a recorded log holds both)."""
    return json.loads(text[text.index("{"):])


def rollout_strict(text: str) -> tuple[float, ...]:
    """``rlalign bench rollout --verify --json``: the strict engine's (roofline fraction, strict log-probs that differ
    from the trainer's, log-probs compared)."""
    row = next(r for r in _json_tail(text)["rows"] if r["engine"] == "rlalign" and r["profile"] == "strict")
    return float(row["roofline_fraction"]), float(row["logprob_mismatches"]), float(row["logprob_tokens_checked"])


def train_step(text: str) -> tuple[float, ...]:
    """``benchmarks/train_step.py --json``: (strict MFU in percent, stock transformers time / strict time, strict peak
    memory / stock transformers peak memory)."""
    d = _json_tail(text)
    strict = next(r for r in d["rows"] if r["variant"] == "strict")
    return (100.0 * float(strict["mfu"]), 1.0 / float(d["ratios"]["time_strict_over_transformers"]),
            float(d["ratios"]["memory_strict_over_transformers"]))


def async_steps_sync(text: str) -> tuple[float, ...]:
    """``benchmarks/async_steps.py --json``: the synchronous setting's median step seconds and device peak (GiB),
    and the log-probs that differ in every setting's runs."""
    d = _json_tail(text)
    sync = d["async_steps=0"]
    return (float(sync["median_step_s"]), float(sync["peak_device_mb"]) / 1024.0,
            float(sum(v["mismatches"] for v in d.values())))


def train_mismatches_and_peak(text: str) -> tuple[float, ...]:
    """A run's metrics.jsonl: :func:`train_mismatches` and the run's device peak (``memory/peak_mb``, GiB)."""
    peak = max(m.get("memory/peak_mb", 0.0) for m in _metrics(text))
    return train_mismatches(text) + (peak / 1024.0,)


def portable_cross_device(text: str) -> tuple[float, ...]:
    """``benchmarks/portable_check.py``: (log-probs that differ when a rollout recorded on one device is scored on the
    other, both directions summed; log-probs compared in each direction; sequences whose tokens differ between the
    two devices' recordings)."""
    d = _json_tail(text)["cross_device"]
    gpu_on_cpu, cpu_on_gpu = d["recorded_cuda_scored_cpu"], d["recorded_cpu_scored_cuda"]
    return (float(gpu_on_cpu["mismatches"] + cpu_on_gpu["mismatches"]), float(gpu_on_cpu["tokens"]),
            float(d["records_cpu_vs_cuda"]["token_sequences_differing"]))


def portable_train_equal(text: str) -> tuple[float, ...]:
    """``benchmarks/portable_check.py --train-steps N``: (steps, fingerprints equal on the CPU and the GPU of the
    two compared: the metrics records' and the final weights' sha256)."""
    d = _json_tail(text)["train"]
    equal = sum(d["cpu"][k] == d["cuda"][k] for k in ("metrics_sha256", "weights_sha256"))
    return float(d["cpu"]["steps"]), float(equal), 2.0


def doctor_checks(text: str) -> tuple[float, ...]:
    """``rlalign doctor --json``: (checks that hold, checks run)."""
    d = _json_tail(text)
    return float(sum(c["holds"] for c in d["checks"])), float(len(d["checks"]))


# ---- the claims: README.md's results table, one row per claim ----------------------------------------

EVIDENCE = "benchmarks/evidence"
DEFAULT_TRAIN = "rlalign train run.dir={out}/run run.progress=false"
MULTI_TURN_TRAIN = "rlalign train configs/multi-turn-cpu.yaml run.dir={out}/run run.progress=false"
ASYNC_TRAIN = "rlalign train rollout.async_steps=1 run.verify_behaviour=true run.dir={out}/run run.progress=false"
PARITY_CPU_NATIVE = "rlalign parity --profile native --train transformers --prompts 16 --samples 4 --json"
PARITY_06B_NATIVE = ("python scripts/shaped_model.py qwen3-0.6b {out}/m && rlalign parity --model {out}/m "
                     "--device cuda --profile native --train transformers --prompts 16 --samples 4 "
                     "--max-new-tokens 16 --json")
# the H200 rollout claims were published against a 4.3 TB/s roofline (and a 780 TFLOP/s per-op ceiling); the
# benchmark's defaults now follow the card (rlalign/bench/cards.py: 4.8 TB/s and 989 on an H200), so the commands
# name the published peaks
H200_PUBLISHED_PEAKS = "--peak-gbps 4300 --peak-tflops 780"
ROLLOUT_06B = ("rlalign bench rollout --device cuda --workload 0.6b-ctx512 --engines strict --verify --json "
               + H200_PUBLISHED_PEAKS)
ROLLOUT_8B = ("rlalign bench rollout --device cuda --workload 8b-ctx512 --prompts 256 --engines strict --verify --json "
              + H200_PUBLISHED_PEAKS)
ROLLOUT_VS_GENERATE = ("rlalign bench rollout --device cuda --json --hf-prompts 64 --engines strict,transformers "
                       "--verify " + H200_PUBLISHED_PEAKS)
TRAIN_STEP = "python benchmarks/train_step.py --device cuda --layers 6 --variants strict,native,transformers --json"
Q8B_200 = ("python scripts/make_qwen3_8b.py {out}/q8b --lm-head-std 0 && rlalign train "
           "configs/qwen3-8b-h200-device.yaml model.path={out}/q8b run.dir={out}/run run.save_checkpoints=false "
           "run.progress=false")
MOE_H200 = ("python scripts/make_moe_model.py {out}/moe --shape qwen3-30b-a3b --layers 4 && rlalign train "
            "configs/moe-h200.yaml model.path={out}/moe run.dir={out}/run run.steps=50 run.eval_every=25 "
            "run.checkpoint_every=50 run.keep_checkpoints=1 run.progress=false")
TP2 = "python scripts/gpu_tp.py --tp 2 --out {out}"
DOCTOR_CUDA = "rlalign doctor --device cuda --json"
MULTI_TURN_GPU = ("python scripts/shaped_model.py qwen3-0.6b {out}/m06 --tokenizer default --device cpu && rlalign train "
                  "configs/multi-turn-gpu.yaml model.path={out}/m06 run.dir={out}/run run.progress=false")
PORTABLE_CHECK = "python benchmarks/portable_check.py"
LORA_TARGETS = "model.lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
LORA_8B = ("python scripts/make_qwen3_8b.py {out}/q8b --lm-head-std 0 && python benchmarks/async_steps.py --config "
           "configs/qwen3-8b-h200-device.yaml --set model.path={out}/q8b run.save_checkpoints=false model.lora.rank=16 "
           f"model.lora.alpha=32 {LORA_TARGETS} --steps 6 --repeats 1 --async 0 1 2 --json")
OFFLOAD_8B = ("python scripts/make_qwen3_8b.py {out}/q8b --lm-head-std 0 && rlalign train configs/qwen3-8b-h200.yaml "
              "model.path={out}/q8b run.dir={out}/run run.save_checkpoints=false run.progress=false task.eval_size=0 "
              "run.stop_at_step=5")
GPU_REL = Check("rel", 0.10)     # one card's runs spread about 3%; fresh machines up to ~7%
ROUNDED_2 = Check("abs", 0.005)  # a deterministic value published to 2 decimals
GPU_TIMING = "a timing, published from one recorded run (the sentence says so); reproduce runs it 3 times"

CLAIMS: tuple[Claim, ...] = (
    Claim("default-run", "README.md", "held-out accuracy **0.18 → 0.95**, **0 of 117,933** log-probs differ",
          (0.18, 0.95, 0, 117933), ("accuracy at step 0", "accuracy at step 120", "differing", "compared"),
          DEFAULT_TRAIN, "run/metrics.jsonl",
          accuracy_and_mismatches, "cpu", 1, DETERMINISTIC,
          ROUNDED_2, f"{EVIDENCE}/default-run-cpu/metrics.jsonl",
          note="the embedded default: 120 GRPO steps, held-out accuracy and the log-prob agreement of every step"),
    Claim("multi-turn-cpu", "README.md", "held-out first-turn accuracy **0.155 → 0.355**, **0 of 81,116**",
          (0.155, 0.355, 0, 81116), ("accuracy at step 0", "accuracy at step 30", "differing", "compared"),
          MULTI_TURN_TRAIN, "run/metrics.jsonl",
          accuracy_and_mismatches, "cpu", 1, DETERMINISTIC,
          EXACT, f"{EVIDENCE}/multi-turn-cpu/metrics.jsonl",
          note="retry arithmetic on the default model: 30 GRPO steps of up-to-3-turn episodes, every generated token"),
    Claim("async-cpu", "README.md", "accuracy **0.18 → 0.95** one step off-policy, **0 of 118,093**",
          (0.18, 0.95, 0, 118093), ("accuracy at step 0", "accuracy at step 120", "differing", "compared"),
          ASYNC_TRAIN, "run/metrics.jsonl",
          lambda text: train_first_last("eval/accuracy", text) + train_verified(text), "cpu", 1, DETERMINISTIC,
          ROUNDED_2, f"{EVIDENCE}/async-cpu/metrics.jsonl",
          note="the default run with rollout.async_steps=1: held-out accuracy and every behaviour log-prob recomputed"),
    Claim("cpu-native-parity", "README.md", "differ on **638 of 646** sampled tokens", (638, 646),
          ("differing", "compared"), PARITY_CPU_NATIVE, "stdout", parity_counts, "cpu", 1, DETERMINISTIC, EXACT,
          f"{EVIDENCE}/parity/cpu-native.json", exit_ok=(0, 1),
          note="the native profile (torch's stock CPU kernels) vs a transformers training forward"),
    Claim("h200-native-parity", "README.md", "**1,024 of 1,024** on an H200", (1024, 1024), ("differing", "compared"),
          PARITY_06B_NATIVE, "stdout", parity_counts, "cuda", 1, DETERMINISTIC, EXACT,
          f"{EVIDENCE}/parity/h200-06b-native.json", exit_ok=(0, 1), note="Qwen3-0.6B shape, bf16, native profile vs transformers"),
    Claim("h200-rollout-06b", "README.md", "**0.576** of the roofline, 0 of 65,536 differ", (0.576, 0, 65536),
          ("roofline fraction", "differing", "compared"), ROLLOUT_06B, "stdout", rollout_strict, "cuda", 3, GPU_TIMING,
          GPU_REL, f"{EVIDENCE}/rollout-h200/0.6b-ctx512.log",
          note="512 sequences, 384-448-token prompts, 128 new tokens; bandwidth roofline at 4.3 TB/s"),
    Claim("h200-rollout-8b", "README.md", "**0.509** of the roofline, 0 of 32,768 differ", (0.509, 0, 32768),
          ("roofline fraction", "differing", "compared"), ROLLOUT_8B, "stdout", rollout_strict, "cuda", 3, GPU_TIMING,
          GPU_REL, f"{EVIDENCE}/rollout-h200/8b-ctx512-256seq-a.log", note="256 sequences; 4.3 TB/s"),
    Claim("h200-rollout-vs-generate", "README.md", "**13.5x** Hugging Face `generate`", (13.5,),
          ("strict / transformers tokens per second",), ROLLOUT_VS_GENERATE, "stdout",
          partial(rollout_ratio, "strict_vs_transformers"), "cuda", 3, GPU_TIMING, GPU_REL,
          f"{EVIDENCE}/rollout-h200/vs-generate-256x8x512.json", note="256 prompts x 8 samples x 512 tokens"),
    Claim("h200-train-step", "README.md", "MFU **52.3%**, **1.64x** faster than stock transformers in **0.244x** "
          "its memory", (52.3, 1.64, 0.244), ("strict MFU (%)", "stock time / strict time", "strict / stock peak memory"),
          TRAIN_STEP, "stdout", train_step, "cuda", 3, GPU_TIMING, GPU_REL,
          f"{EVIDENCE}/train-step-h200/train_step_6l.json",
          note="one micro-step, Qwen3-8B shape cut to 6 layers, 8,192 tokens, full vocabulary, bf16"),
    Claim("h200-qwen3-8b-200-steps", "README.md", "**0 of 1,024,000** log-probs differ", (0, 1024000),
          ("differing", "compared"), Q8B_200, "run/metrics.jsonl", train_mismatches, "cuda", 1, DETERMINISTIC, EXACT,
          f"{EVIDENCE}/qwen3-8b-200-steps-h200/metrics.jsonl",
          note="200 strict GRPO steps on the full Qwen3-8B shape, every training state on one H200"),
    Claim("h200-moe-routing", "README.md", "**0 of 204,794** log-probs and **0 of 1,225,576** expert choices differ",
          (0, 204794, 0, 1225576), ("log-probs differing", "compared", "expert choices differing", "compared"),
          MOE_H200, "run/metrics.jsonl", lambda text: train_mismatches(text) + train_routing(text), "cuda", 1,
          DETERMINISTIC, EXACT, f"{EVIDENCE}/moe-h200/grpo-30b-a3b-4l-metrics.jsonl",
          note="Qwen3-30B-A3B shape cut to 4 layers (128 experts, top-8), 50 strict GRPO steps"),
    Claim("h200-tp2", "README.md", "TP=2 equals TP=1 in every log-prob and gradient element (0 and 0 differ)", (0, 0),
          ("log-probs differing", "gradient elements differing"), TP2, "gpu_tp.json", tp_differences, "cuda:2", 1,
          DETERMINISTIC, EXACT, f"{EVIDENCE}/tp-h200/tp2.json", note="Qwen3-8B shape cut to 8 layers, 4,096 tokens"),
    Claim("h100-lora-8b", "README.md", "**3.75 s** per step in **20.3 GiB** of GPU memory, 0 differ",
          (3.75, 20.3, 0), ("seconds per step", "peak GiB", "differing"), LORA_8B, "stdout", async_steps_sync, "cuda", 3,
          GPU_TIMING, GPU_REL, f"{EVIDENCE}/lora-8b-h100/async-steps.json",
          note="Qwen3-8B shape, LoRA rank 16 on all seven projections, configs/qwen3-8b-h200-device.yaml's workload; "
               "the mismatch count sums the synchronous and both asynchronous settings"),
    Claim("h100-offload-8b", "README.md", "**0 of 40,911** log-probs differ, **36.5 GiB** peak", (0, 40911, 36.5),
          ("differing", "compared", "peak GiB"), OFFLOAD_8B, "run/metrics.jsonl", train_mismatches_and_peak, "cuda", 1,
          DETERMINISTIC, Check("abs", 0.05), f"{EVIDENCE}/offload-8b-h100/metrics.jsonl",
          note="full fine-tuning of the Qwen3-8B shape, fp32 masters and AdamW state in host memory, 5 steps"),
    Claim("h100-multi-turn", "README.md", "**0 of 253,575** generated-token log-probs differ", (0, 253575),
          ("differing", "compared"), MULTI_TURN_GPU, "run/metrics.jsonl", train_mismatches, "cuda", 1, DETERMINISTIC,
          EXACT, f"{EVIDENCE}/multi-turn-h100/metrics.jsonl",
          note="configs/multi-turn-gpu.yaml: the Qwen3-0.6B body, random-init, 30 GRPO steps of up-to-3-turn episodes, "
               "CUDA-graph decode"),
    Claim("h100-portable", "README.md", "**0 of 192** log-probs differ in either direction", (0, 192, 0),
          ("differing", "compared", "sequences with other tokens"), PORTABLE_CHECK, "stdout", portable_cross_device,
          "cuda", 1, DETERMINISTIC, EXACT, f"{EVIDENCE}/portable-h100/portable.json",
          note="the portable profile: a seeded rollout of a 4-layer Qwen3-shaped fp32 model recorded on the GPU and scored "
               "on the CPU, and the reverse"),
    Claim("h100-portable-train", "README.md", "its first **3** training steps: **2 of 2** fingerprints equal",
          (3, 2, 2), ("steps", "fingerprints equal", "fingerprints"), f"{PORTABLE_CHECK} --train-steps 3", "stdout",
          portable_train_equal, "cuda", 1, DETERMINISTIC, EXACT, f"{EVIDENCE}/portable-h100/portable-train.json",
          note="the portable profile trains: the embedded default run (fp32) on the CPU and on the GPU, the sha256 of "
               "every logged value but timings and memory, and of the final weights"),
    Claim("h100-doctor", "README.md", "**13 of 13** invariances hold", (13, 13), ("holding", "checked"), DOCTOR_CUDA,
          "stdout", doctor_checks, "cuda", 1, DETERMINISTIC, EXACT, f"{EVIDENCE}/h100-doctor/doctor-2026-12-07.json",
          note="rlalign doctor on an H100 80GB: every op's invariances and the model's three paths per family and dtype"),
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
                   help="keep each run's raw output here, as <claim id>_<run>.<ext> (to record under benchmarks/evidence/)")
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
