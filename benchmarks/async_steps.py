"""Synchronous vs asynchronous steps (``rollout.async_steps``) on the embedded default task: step time, memory and
the learning curve.

    python benchmarks/async_steps.py --steps 12 --async 0 1 2 --repeats 2 --json --out async.json
    python benchmarks/async_steps.py --config configs/qwen3-0.6b-gpu.yaml --set model.path=/dev/shm/m06 --steps 8
    python benchmarks/async_steps.py --curves RUN_K0 RUN_K1 RUN_K2          # eval/accuracy of finished runs

Timing: each run is ``rlalign train`` with the default config (or ``--config`` with ``--set`` overrides) (``run.steps`` stays 120, so the lr schedule is the
default run's) stopped after ``--steps`` steps (``run.stop_at_step``), without evaluations (``task.eval_size=0``), in
a fresh directory and a process of its own; the runs are interleaved (0 1 2 2 1 0 ...) so a change of the machine's load hits every setting alike. A
step's time is ``time/rollout_s + time/train_s`` (asynchronous: the rollout part is the trainer's wait for samples
generated ahead, the weight copy into the engine included; evaluations are left out); the figure is the median
over steps 2..N of every run of a setting (step 1 of an asynchronous run also generates the first k steps ahead).
Also the process's CPU time (user + system, all threads, start-up included) divided by its steps: asynchronous steps do more
work (a proximal forward the synchronous strict step folds into its update pass), and on a machine whose cores
other work keeps busy a process with more runnable threads gets a larger share of them, so read the wall times
with the CPU times and the load average (printed). Memory: ``memory/engine_weight_copy_mb`` (the engine's own
weights: 0 when it shares the policy's), the process's peak RSS and the run's ``memory/peak_mb`` (on CUDA the
device's peak allocation). The metrics of every setting are
deterministic; the times are not.

``--curves`` prints ``eval/accuracy`` (and the greedy one) by step, side by side, of finished run directories
(the learning curves of docs/async.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUNNER = ("import resource, sys; from rlalign.cli.main import main; rc = main(sys.argv[1:]); "
          "u = resource.getrusage(resource.RUSAGE_SELF); "
          "print('PEAK_RSS_KB', u.ru_maxrss, 'CPU_S', u.ru_utime + u.ru_stime); sys.exit(rc)")


def read(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def one_run(k: int, steps: int, run_dir: Path, config: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", RUNNER, "train", *config, f"run.dir={run_dir}", "run.progress=false",
                          f"rollout.async_steps={k}", f"run.stop_at_step={steps}", "task.eval_size=0",
                          "run.save_checkpoints=false"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"async_steps={k}: rlalign train failed:\n{out.stderr[-2000:]}")
    fields = next(line.split() for line in out.stdout.splitlines() if line.startswith("PEAK_RSS_KB"))
    peak, cpu_s = int(fields[1]), float(fields[3])
    records = [r for r in read(run_dir) if r["step"] >= 1]
    return {"step_s": [r["time/rollout_s"] + r["time/train_s"] for r in records[1:]],
            "rollout_wait_s": [r["time/rollout_s"] for r in records[1:]],
            "engine_copy_mb": records[-1]["memory/engine_weight_copy_mb"], "peak_rss_mb": peak / 1024,
            "peak_device_mb": max(r.get("memory/peak_mb", 0.0) for r in records),
            "cpu_s_per_step": cpu_s / len(records), "load_avg_1m": os.getloadavg()[0],
            "mismatches": sum(r["mismatch/count"] for r in records)}


def timing(settings: list[int], steps: int, repeats: int, config: list[str]) -> dict:
    order = [k for i in range(repeats) for k in (settings if i % 2 == 0 else settings[::-1])]
    runs: dict[int, list[dict]] = {k: [] for k in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for i, k in enumerate(order):
            runs[k].append(one_run(k, steps, Path(tmp) / f"run{i}", config))
    out = {}
    for k, rs in runs.items():
        step_s = [s for r in rs for s in r["step_s"]]
        out[f"async_steps={k}"] = {
            "median_step_s": statistics.median(step_s), "median_rollout_wait_s":
                statistics.median([s for r in rs for s in r["rollout_wait_s"]]),
            "steps_timed": len(step_s), "engine_weight_copy_mb": rs[0]["engine_copy_mb"],
            "process_cpu_s_per_step": statistics.median(r["cpu_s_per_step"] for r in rs),
            "load_avg_1m_at_end": [r["load_avg_1m"] for r in rs],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
            "peak_device_mb": max(r["peak_device_mb"] for r in rs), "mismatches": sum(r["mismatches"] for r in rs)}
    base = out[f"async_steps={settings[0]}"]["median_step_s"]
    for v in out.values():
        v["speedup_vs_first"] = base / v["median_step_s"]
    return out


def curves(run_dirs: list[Path]) -> str:
    tables = [{r["step"]: r for r in read(d) if "eval/accuracy" in r} for d in run_dirs]
    steps = sorted(set().union(*tables))
    lines = ["step | " + " | ".join(f"{d.name} acc (greedy)" for d in run_dirs)]
    for s in steps:
        cells = [f"{t[s]['eval/accuracy']:.4f} ({t[s].get('eval/accuracy_greedy', float('nan')):.3f})" if s in t else "-"
                 for t in tables]
        lines.append(f"{s} | " + " | ".join(cells))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--async", dest="settings", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--curves", type=Path, nargs="+")
    p.add_argument("--config", help="a config file (default: the embedded default run)")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides, as rlalign train takes them")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the JSON to this file")
    args = p.parse_args()
    if args.curves:
        print(curves(args.curves))
        return 0
    if args.steps < 2 or args.repeats < 1 or any(k < 0 for k in args.settings):
        p.error("--steps must be >= 2, --repeats >= 1 and every --async value >= 0")
    config = ([args.config] if args.config else []) + list(args.overrides)
    result = timing(args.settings, args.steps, args.repeats, config)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else "\n".join(f"{k}: {v['median_step_s']:.3f} s/step ({v['speedup_vs_first']:.2f}x), "
                                            f"engine copy {v['engine_weight_copy_mb']:.1f} MiB, peak RSS "
                                            f"{v['peak_rss_mb']:.0f} MiB, process CPU {v['process_cpu_s_per_step']:.2f} s/step, load "
                                            f"{v['load_avg_1m_at_end']}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
