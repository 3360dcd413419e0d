"""Multi-GPU checks on 2, 4 or 8 GPUs of one host (NCCL, NVLink multicast off): what the CPU cannot show.

    python scripts/multi_gpu_check.py --out DIR                              # every stage, every GPU torch sees
    python scripts/multi_gpu_check.py --out DIR --stages tp,collectives,train # the first three stages only
    python scripts/multi_gpu_check.py --out DIR --stages train8b --tp8b 2 --dp8b 2 --layers 18
    python scripts/multi_gpu_check.py --out DIR --smoke --gpus 2             # CPU rehearsal: gloo, tiny shapes

G GPUs (``--gpus``, default: all that torch sees; ``CUDA_VISIBLE_DEVICES`` may pick them); the TP degrees are
those of 1, 2, 4, 8 that divide G. The stages (``--stages``, comma-separated, in this order), each run to its end:

``tp``
    ``scripts/gpu_tp.py --tp <degrees> --layers L`` (``--layers``, default 36: the full Qwen3-8B shape,
    151,936-token vocabulary, random init, bf16): log-probs, entropies, loss and every gathered gradient of
    TP=t vs TP=1 in raw bits; TP=1's forward vs the unsharded model; strict and native step time per degree
    -> ``gpu_tp.json``.
``collectives``
    ``benchmarks/collectives.py``: the fixed all-gather + tree merge vs NCCL's all-reduce and reduce-scatter
    at a step's sizes, groups of the degrees above 1 -> ``collectives.json``.
``train``
    strict GRPO (``configs/gpu-grpo-200.yaml``: the Qwen3-0.6B body, default vocabulary) for ``--steps``
    steps at ``parallel.tp=1`` on one GPU and ``parallel.tp=2``; with G >= 4 also ``parallel.dp=2
    parallel.tp=2`` and ``parallel.dp=2 parallel.tp=1``; side by side where the GPUs allow. Verdicts:
    mismatch/count at every step, and ``python -m rlalign.integrations.ray.compare`` (metrics and exported
    weights, bits): tp=2 vs the one-GPU tp=1 run, dp2 x tp2 vs dp2 x tp1
    -> ``metrics_tp2.jsonl``, ``metrics_dp2tp2.jsonl``.
``parity``
    ``rlalign parity --tp <degrees> --device cuda`` on a Qwen3-8B-shaped checkpoint of ``--parity-layers``
    layers (default ``--layers``) made here -> ``parity_tp.json``.
``train8b``
    strict GRPO on that shape with ``configs/qwen3-8b-h200-device.yaml``, ``parallel.tp=--tp8b`` (default the
    largest of 2, 4, 8 that divides G) and ``parallel.dp=--dp8b`` (default 1), ``--train8b-layers`` layers (default ``--layers``),
    ``--steps`` steps -> ``metrics_8b_tp.jsonl``.

Results under ``--out``: ``summary.txt`` (machine, versions, each stage's verdict), ``log.txt`` (every stage's
output) and the files named above. The exit status is 0 when every check passed, 1 otherwise.

Models and run directories live under ``--work`` (default ``OUT/work``). A training run checkpoints every
``--checkpoint-every`` steps (the newest one kept); rerunning the same command after a run was cut short
continues it from its checkpoint (``run.resume=true``) and skips runs that finished; ``--fresh`` starts over.
The work folder is removed when every check passed (``--keep-work`` keeps it). Disk: the 0.6B runs need a few
GB each; the 8B stage at 36 layers needs ~16 GB for the model and ~92 GiB per checkpoint of its training
state (fp32 masters and AdamW: 12 bytes per parameter), about 200 GiB with the one being replaced. On 2 GPUs
the 8B run at tp=2 holds about 120 of 139 GiB per GPU by our count (an unsharded engine copy, half the
weights, masters and AdamW state, the gathered full gradients and weights); ``--train8b-layers 18`` roughly
halves it.

``--smoke`` rehearses it on the CPU: gloo processes, tiny shapes, ``model.device=cpu`` (``--gpus`` defaults
to 2; tests/distributed/test_gpu_multi_script.py runs its training stage).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("tp", "collectives", "train", "parity", "train8b")
# NVLink multicast off for NCCL, torch's symmetric memory and NVSHMEM: the hosts this was built on require it
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# the 8B config's training features on the embedded default model: bf16 with fp32 masters, the optimizer step in
# chunks, activation checkpointing
SMOKE_TRAIN = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "run.eval_every=2", "task.eval_size=2",
               "run.eval_samples=1", "optim.micro_batch_tokens=64", "model.device=cpu", "model.dtype=bfloat16",
               "optim.master_weights=true", "optim.step_chunk_elements=10000", "optim.activation_checkpointing=true"]
SMOKE_8B = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "task.eval_size=2",
            "run.eval_samples=1", "optim.micro_batch_tokens=64", "model.device=cpu"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the results (summary.txt, log.txt, JSON, metrics)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)} (default: all)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all that torch sees; 2 with --smoke)")
    p.add_argument("--layers", type=int, default=36, help="decoder layers of the Qwen3-8B shape (36 = full depth)")
    p.add_argument("--parity-layers", type=int, default=None, help="layers of the parity stage's model (default --layers)")
    p.add_argument("--train8b-layers", type=int, default=None, help="layers of the train8b stage's model (default --layers)")
    p.add_argument("--steps", type=int, default=20, help="training steps of each run (train, train8b)")
    p.add_argument("--tp8b", type=int, default=None, help="parallel.tp of the 8B run (default: the largest of 2, 4, 8 dividing the GPUs)")
    p.add_argument("--dp8b", type=int, default=1, help="parallel.dp of the 8B run (tp8b x dp8b GPUs)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="training runs checkpoint every N steps (resume)")
    p.add_argument("--work", default=None, help="models and run directories (default OUT/work)")
    p.add_argument("--fresh", action="store_true", help="discard the work folder's earlier runs and models first")
    p.add_argument("--keep-work", action="store_true", help="keep the work folder when every check passed")
    p.add_argument("--smoke", action="store_true", help="CPU rehearsal: gloo processes, tiny shapes")
    args = p.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        p.error(f"--stages {args.stages!r}: use a comma-separated list of {', '.join(STAGES)}")
    args.stages = [s for s in STAGES if s in stages]
    for name in ("layers", "steps", "checkpoint_every", "dp8b"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def degrees_for(gpus: int) -> list[int]:
    """The TP degrees of 1, 2, 4, 8 that divide ``gpus``."""
    return [t for t in (1, 2, 4, 8) if t <= gpus and gpus % t == 0]


def plan_run(run_dir: Path, argv: list[str]) -> str:
    """What a training run of this command line does with its run directory: ``"done"`` (an earlier invocation
    finished it with the same arguments), ``"resume"`` (it began with the same arguments and left a checkpoint) or
    ``"fresh"`` (anything else: the directory is cleared)."""
    record = run_dir.with_name(run_dir.name + ".json")
    try:
        state = json.loads(record.read_text())
    except (OSError, ValueError):
        return "fresh"
    if state.get("argv") != argv:
        return "fresh"
    if state.get("done"):
        return "done"
    return "resume" if (run_dir / "checkpoints" / "latest.json").exists() else "fresh"


def record_run(run_dir: Path, argv: list[str], done: bool) -> None:
    run_dir.with_name(run_dir.name + ".json").write_text(json.dumps({"argv": argv, "done": done}))


WORK_MARK = ".rlalign-multi-gpu-check"   # in a work folder this script created (or found empty): it may delete it


def prepare_work(work: Path, fresh: bool) -> None:
    """The work folder: created (and marked) when missing or empty; an existing one is used only if this script
    marked it -- a folder of the user's given as --work is refused, never deleted. ``fresh``: start it over."""
    if work.exists() and any(work.iterdir()) and not (work / WORK_MARK).exists():
        raise SystemExit(f"multi_gpu_check: --work {work} holds files this script did not write; give a new or "
                         "empty folder")
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_MARK).touch()


class Check:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out).resolve()
        self.work = Path(args.work).resolve() if args.work else self.out / "work"
        self.out.mkdir(parents=True, exist_ok=True)
        prepare_work(self.work, args.fresh)
        self.summary = self.out / "summary.txt"
        self.log = self.out / "log.txt"
        self.summary.write_text("")
        self.log.write_text("")
        self.start = time.monotonic()
        self.failures = 0
        self.env = dict(os.environ, **MULTICAST_OFF, PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.py = sys.executable
        self.rlalign = [self.py, "-m", "rlalign.cli.main"]

    # ---- output ------------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.start:.0f}s] {text}"
        print(line, flush=True)
        for path in (self.summary, self.log):
            with path.open("a") as f:
                f.write(line + "\n")

    def note(self, text: str) -> None:   # a summary line without a timestamp
        print(text, flush=True)
        with self.summary.open("a") as f:
            f.write(text + "\n")

    def fail(self, text: str) -> None:
        self.failures += 1
        self.say(f"FAILED: {text}")

    def run(self, name: str, cmd: list[str], env: "dict | None" = None, stdout: "Path | None" = None) -> int:
        """Run ``cmd`` to its end in the repository root; its output goes to log.txt (stdout to ``stdout`` if given)."""
        with self.log.open("a") as log:
            log.write(f"== {name}: {' '.join(cmd)}\n")
            log.flush()
            out = stdout.open("w") if stdout else log
            try:
                return subprocess.run(cmd, cwd=REPO, env=env or self.env, stdout=out, stderr=log).returncode
            finally:
                if stdout:
                    out.close()

    def run_captured(self, name: str, cmd: list[str], meaning: str) -> tuple[int, str]:
        """Run ``cmd`` with its stdout kept (and appended to log.txt); say its exit status and what 0 means, count a
        non-zero one as a failure. Returns (exit status, stdout)."""
        raw = self.work / f"{name}.out"
        rc = self.run(name, cmd, stdout=raw)
        text = raw.read_text() if raw.exists() else ""
        self.append_log(text)
        self.say(f"{name}: exit {rc} (0: {meaning})")
        if rc != 0:
            self.fail(f"{name}: exit {rc}")
        return rc, text

    def append_log(self, text: str) -> None:
        with self.log.open("a") as f:
            f.write(text)

    def header(self) -> None:
        self.note(f"# rlalign multi-GPU check  {time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True)
            for line in q.stdout.splitlines()[:2]:
                self.note(line)
        v = subprocess.run([self.py, "-c", "import sys, torch\ntry:\n import triton; t = triton.__version__\n"
                            "except ImportError:\n t = None\nprint('python', sys.version.split()[0], '| torch', "
                            "torch.__version__, '| triton', t, '| cuda', torch.version.cuda)"],
                           capture_output=True, text=True, env=self.env)
        self.note((v.stdout or v.stderr).strip())
        g = subprocess.run(["git", "log", "-1", "--format=commit %h %s"], cwd=REPO, capture_output=True, text=True)
        if g.returncode == 0:
            self.note(g.stdout.strip())

    # ---- GPUs --------------------------------------------------------------------------------------------------
    def count_gpus(self) -> None:
        if self.args.gpus is not None:
            self.g = self.args.gpus
        elif self.args.smoke:
            self.g = 2
        else:
            q = subprocess.run([self.py, "-c", "import torch; print(torch.cuda.device_count())"],
                               capture_output=True, text=True, env=self.env)
            self.g = int(q.stdout.strip() or 0) if q.returncode == 0 else 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.ids = visible.split(",") if visible else [str(i) for i in range(self.g)]
        self.degrees = degrees_for(self.g)

    def devices(self, first: int, n: int) -> str:
        return ",".join(self.ids[first:first + n])

    # ---- stages ------------------------------------------------------------------------------------------------
    def stage_tp(self) -> None:
        extra = ["--smoke"] if self.args.smoke else ["--layers", str(self.args.layers)]
        degrees = ",".join(map(str, self.degrees))
        self.say(f"tp: scripts/gpu_tp.py --tp {degrees} {' '.join(extra)}")
        rc = self.run("tp", [self.py, "scripts/gpu_tp.py", "--out", str(self.out), "--tp", degrees, *extra])
        self.say(f"tp: exit {rc} (0: every degree bitwise equal to TP=1; 1: a difference; 2: refused)")
        if rc != 0:
            self.fail(f"tp: exit {rc}")
        path = self.out / "gpu_tp.json"
        if not path.exists():
            return
        d = json.loads(path.read_text())
        self.note(f"  {d['model']['layers']} layers, {d['batch']['tokens']} tokens, complete={d['complete']}")
        for t in d["degrees"]:
            m = d.get(f"tp{t}_vs_tp1") or {}
            times = {p: (d.get(f"time_tp{t}_{p}") or {}).get("median_s") for p in ("strict", "native")}
            bits = "reference" if t == 1 else (
                f"lp {m['lp']['differ']} ent {m['ent']['differ']} loss {m['loss']['differ']} differing grad "
                f"elements {m.get('grads_differ_total')} of {m.get('grads_compared')} tensors" if m else "not compared")
            self.note(f"  TP={t}: {bits}; step strict {times['strict']} s native {times['native']} s")
        errors = [f"{k}: {v['error']}" for k, v in d.items() if isinstance(v, dict) and "error" in v]
        self.note("  errors: " + ("; ".join(errors) or "none"))

    def stage_collectives(self) -> None:
        ranks = ",".join(str(t) for t in self.degrees if t > 1)
        extra = ["--smoke"] if self.args.smoke else []
        self.say(f"collectives: benchmarks/collectives.py --ranks {ranks} {' '.join(extra)}")
        _, text = self.run_captured("collectives", [self.py, "benchmarks/collectives.py", "--out", str(self.out),
                                                    "--ranks", ranks, *extra],
                                    "every fixed result checked equal to the local tree merge")
        # a row per group size, kind and size: the smallest and largest sizes shown
        shown = re.compile(r"^ranks .* tokens (1|4096|8192) |^ranks .* (1048576|268435456) ")
        for line in [l for l in text.splitlines() if shown.match(l)][-24:]:
            self.note(f"  {line}")

    def train_runs(self, jobs: list[tuple[str, int, list[str]]], base: list[str]) -> None:
        """``rlalign train`` for each (name, GPUs, arguments) job, as many side by side as the GPUs hold, wave after
        wave; each run to its end, resumed from its checkpoint where an earlier invocation was cut short."""
        pending = list(jobs)
        while pending:
            first, wave, deferred = 0, [], []
            for name, n, extra in pending:
                if first + n > self.g and wave:
                    deferred.append((name, n, extra))
                    continue
                run_dir = self.work / f"run_{name}"
                argv = [*base, *extra, f"run.dir={run_dir}"]
                plan = plan_run(run_dir, argv)
                if plan == "done":
                    self.say(f"train {name}: finished by an earlier invocation with the same arguments")
                    continue
                if plan == "fresh":
                    shutil.rmtree(run_dir, ignore_errors=True)
                    record_run(run_dir, argv, done=False)
                cmd = [*self.rlalign, "train", *argv, *(["run.resume=true"] if plan == "resume" else [])]
                env = dict(self.env, CUDA_VISIBLE_DEVICES=self.devices(first, n))
                self.say(f"train {name} on GPUs {env['CUDA_VISIBLE_DEVICES']}{' (resumed)' if plan == 'resume' else ''}")
                log = open(self.work / f"run_{name}.log", "a")
                log.write(f"== train {name}: {' '.join(cmd)}\n")
                log.flush()
                wave.append((name, run_dir, argv, log, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                                                        stderr=subprocess.STDOUT)))
                first += n
            for name, run_dir, argv, log, proc in wave:
                rc = proc.wait()
                log.write(f"exit status {rc}\n")
                log.close()
                if rc == 0:
                    record_run(run_dir, argv, done=True)
            pending = deferred

    def verdict(self, name: str) -> None:
        """Exit status (and the log's last lines when it is not 0), steps, mismatches (all must be 0), step time."""
        log = self.work / f"run_{name}.log"
        text = log.read_text() if log.exists() else ""
        self.append_log(text)
        statuses = [line for line in text.splitlines() if line.startswith("exit status")]
        record = self.work / f"run_{name}.json"
        done = record.exists() and json.loads(record.read_text()).get("done")
        status = statuses[-1] if statuses else ("exit status 0" if done else "no exit status")
        self.say(f"run {name}: {status}")
        if status != "exit status 0":
            for line in [l for l in text.splitlines() if l.strip()][-4:]:
                self.note(f"  | {line}")
            self.fail(f"run {name}: {status}")
        path = self.work / f"run_{name}" / "metrics.jsonl"
        rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
        steps = [r for r in rows if "mismatch/tokens" in r]
        if not steps:
            self.note(f"  run_{name}: no training step recorded")
            self.fail(f"run {name}: no step recorded")
            return
        bad = [r["step"] for r in steps if r["mismatch/count"] != 0]
        nan = float("nan")
        self.note(f"  run_{name}: {len(steps)} steps, {sum(r['mismatch/tokens'] for r in steps):,} log-probs compared, "
                  f"mismatches {sum(r['mismatch/count'] for r in steps)} (steps with any: {bad or 'none'}); median step "
                  f"{statistics.median(r['time/rollout_s'] + r['time/train_s'] for r in steps):.2f} s; reward "
                  f"{steps[0].get('reward/mean', nan):.3f} -> {steps[-1].get('reward/mean', nan):.3f}")
        if bad:
            self.fail(f"run {name}: log-prob mismatches")

    def compare(self, a: str, b: str, info: bool = False) -> None:
        """The metrics and exported weights of two runs, bitwise (``info``: a difference is no failure)."""
        self.say(f"compare {a} vs {b} (metrics + exported weights){', for information' if info else ''}:")
        q = subprocess.run([self.py, "-m", "rlalign.integrations.ray.compare", str(self.work / f"run_{a}"),
                            str(self.work / f"run_{b}")], cwd=REPO, env=self.env, capture_output=True, text=True)
        for line in (q.stdout + q.stderr).splitlines()[-6:]:
            self.note(f"  {line}")
        if q.returncode != 0 and not info:
            self.fail(f"compare {a} vs {b}: not identical (or a run is missing)")

    def copy_metrics(self, name: str, dest: str) -> None:
        src = self.work / f"run_{name}" / "metrics.jsonl"
        if src.exists():
            shutil.copyfile(src, self.out / dest)

    def stage_train(self) -> None:
        common = ["run.progress=false", f"run.steps={self.args.steps}",
                  f"run.checkpoint_every={self.args.checkpoint_every}", "run.keep_checkpoints=1"]
        if self.args.smoke:
            base = [*SMOKE_TRAIN, *common]
        else:
            model = self.work / "m06"
            if not (model / "config.json").exists():
                self.say(f"train: model qwen3-0.6b body (default vocabulary) -> {model}")
                shutil.rmtree(model, ignore_errors=True)
                self.run("make_m06", [self.py, "scripts/shaped_model.py", "qwen3-0.6b", str(model), "--tokenizer",
                                      "default"])
            # micro-batches of 2,048 tokens: a step's ~6k tokens in several, so each DP rank back-propagates its own
            base = ["configs/gpu-grpo-200.yaml", f"model.path={model}", "run.eval_every=10",
                    "optim.micro_batch_tokens=2048", *common]
        jobs = [("tp2", 2, ["parallel.tp=2"]), ("tp1", 1, ["parallel.tp=1"])]
        if self.g >= 4:
            jobs = [("dp2tp2", 4, ["parallel.dp=2", "parallel.tp=2"]), *jobs,
                    ("dp2tp1", 2, ["parallel.dp=2", "parallel.tp=1"])]
        self.say(f"train: {len(jobs)} runs of {self.args.steps} steps ({', '.join(j[0] for j in jobs)})")
        self.train_runs(jobs, base)
        for name, _, _ in jobs:
            self.verdict(name)
        self.compare("tp1", "tp2")
        if self.g >= 4:
            self.compare("dp2tp1", "dp2tp2")
            # DP sums each rank's accumulated gradients by the tree: bitwise across TP at a fixed DP degree, not
            # promised against one process accumulating every micro-batch (docs/distributed.md)
            self.compare("tp1", "dp2tp2", info=True)
        self.copy_metrics("tp2", "metrics_tp2.jsonl")
        if self.g >= 4:
            self.copy_metrics("dp2tp2", "metrics_dp2tp2.jsonl")

    def make_8b(self, layers: int) -> "Path | None":
        """A random-init Qwen3-8B-shaped checkpoint (full vocabulary) of ``layers`` layers, made once."""
        model = self.work / "q8b"
        record = self.work / "q8b.json"
        want = {"layers": layers, "smoke": self.args.smoke}
        have = json.loads(record.read_text()) if record.exists() else None
        if have != want or not (model / "config.json").exists():
            shutil.rmtree(model, ignore_errors=True)
            record.unlink(missing_ok=True)
            extra = ["--test-body", "--vocab", "3000", "--device", "cpu"] if self.args.smoke else []
            self.say(f"model: Qwen3-8B shape, {layers} layers -> {model}")
            self.run("make_8b", [self.py, "scripts/make_qwen3_8b.py", str(model), "--layers", str(layers), *extra])
            if (model / "config.json").exists():
                record.write_text(json.dumps(want))
        return model if (model / "config.json").exists() else None

    def stage_parity(self) -> None:
        layers = self.args.parity_layers or self.args.layers
        degrees = ",".join(map(str, self.degrees))
        self.say(f"parity: Qwen3-8B shape, {layers} layers, --tp {degrees}")
        model = self.make_8b(layers)
        if model is None:
            self.fail("parity: no checkpoint")
            return
        _, text = self.run_captured("parity", [*self.rlalign, "parity", "--model", str(model), "--device",
                                               "cpu" if self.args.smoke else "cuda", "--tp", degrees, "--prompts", "4",
                                               "--samples", "2", "--max-new-tokens", "16", "--json"],
                                    "every degree's log-probs equal TP=1's and the rollout's")
        lines = [l for l in text.splitlines() if l.startswith("{")]   # the --json object's line
        if not lines:
            self.note("  no JSON from rlalign parity (its output is in log.txt)")
            return
        (self.out / "parity_tp.json").write_text(lines[-1] + "\n")
        d = json.loads(lines[-1])
        self.note(f"  ok={d['ok']}: rollout vs train {d['mismatches']} of {d['tokens_compared']} differ")
        for t, r in sorted(d.get("tp", {}).items(), key=lambda kv: int(kv[0])):
            self.note(f"  TP={t}: {r['mismatches']} of {r['tokens_compared']} differ from TP=1, "
                      f"{r['rollout_mismatches']} from the rollout")

    def stage_train8b(self) -> None:
        tp = self.args.tp8b or max(self.degrees)   # the largest of 1, 2, 4, 8 that divides the GPUs
        dp = self.args.dp8b
        layers = self.args.train8b_layers or self.args.layers
        self.say(f"train 8B: parallel.tp={tp} parallel.dp={dp}, {layers} layers, {self.args.steps} steps")
        if tp * dp > self.g:
            self.fail(f"train 8B: tp8b x dp8b = {tp * dp} GPUs, {self.g} here")
            return
        model = self.make_8b(layers)
        if model is None:
            self.fail("train 8B: no checkpoint")
            return
        config = SMOKE_8B if self.args.smoke else ["configs/qwen3-8b-h200-device.yaml"]
        base = [*config, f"model.path={model}", f"parallel.tp={tp}", f"parallel.dp={dp}", f"run.steps={self.args.steps}",
                "run.progress=false", "run.eval_every=10", f"run.checkpoint_every={self.args.checkpoint_every}",
                "run.keep_checkpoints=1"]
        self.train_runs([("8b", tp * dp, [])], base)
        self.verdict("8b")
        self.copy_metrics("8b", "metrics_8b_tp.jsonl")

    # ---- all ---------------------------------------------------------------------------------------------------
    def main(self) -> int:
        self.header()
        self.count_gpus()
        self.say(f"GPUs: {self.g} (ids {' '.join(self.ids) or 'none'}); TP degrees {','.join(map(str, self.degrees))}; "
                 f"stages {','.join(self.args.stages)}; {' '.join(f'{k}={v}' for k, v in MULTICAST_OFF.items())}")
        if self.g < 2:
            self.fail(f"needs at least 2 GPUs (found {self.g})")
            return 1
        for stage in self.args.stages:
            getattr(self, f"stage_{stage}")()
        if self.failures == 0 and not self.args.keep_work:
            shutil.rmtree(self.work, ignore_errors=True)   # ours: prepare_work marked it
        files = " ".join(sorted(p.name for p in self.out.iterdir()))
        self.say(f"done, {self.failures} failed checks; files: {files}")
        return 0 if self.failures == 0 else 1


def main(argv=None) -> int:
    return Check(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
