"""CPU measurement of the rollout engine's host time per decode step.

Tiny random-init model (so the forward is cheap), many sequences, decode_graphs "padded" or "off".
Per decode step: wall time of ``engine.step()``, time inside ``model.forward_hidden`` and inside
``ops.sample_and_score`` (wrapped), by default in this thread's CPU time (``--clock cpu``, with one torch
thread the forward runs on this thread too); ``host_ms`` = step - forward - sample_and_score: scheduling, block
management, building the step's inputs, appending tokens, stop checks, completions. Prints medians over
the decode steps of each run and a hash of every token and logprob (outputs must not change).

    PYTHONPATH=$PWD python benchmarks/rollout_host_cpu.py --seqs 512 --new 128 --runs 3
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import struct
import time

import torch

import rlalign.rollout.engine as engine_mod
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams


def run_once(args) -> tuple[dict, str]:
    # the host work is this thread's: its CPU time does not count the time other processes on a shared
    # machine take from it (--clock wall for wall time)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    model = tiny_model("qwen3", seed=3, init_std=0.1, num_hidden_layers=1)
    cfg = RolloutConfig(max_num_seqs=args.seqs, decode_graph_max_batch=args.seqs, decode_graphs=args.graphs,
                        max_num_batched_tokens=args.seqs * 32, page_size=16, profile="strict",
                        max_model_len=256, overlap=args.overlap)
    engine = RolloutEngine(model, cfg)
    timers = {"forward": 0.0, "sample": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                timers[name] += clock() - t
        return wrapper

    model.forward_hidden = timed("forward", model.forward_hidden)
    real_sample = engine_mod.ops.sample_and_score
    engine_mod.ops.sample_and_score = timed("sample", real_sample)
    prompts = [[3 + (i * 7 + j) % 300 for j in range(8 + i % 24)] for i in range(args.seqs)]
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.new, seed=1, ignore_eos=True,
                              stop_token_ids=tuple(range(40, 41)) if args.stops else ())
    for i, p in enumerate(prompts):
        engine.add_request(p, sampling, prompt_index=i)
    steps, done = [], []
    try:
        while engine.has_unfinished():
            decode_before = engine.last_forward
            for k in timers:
                timers[k] = 0.0
            t = clock()
            if args.api == "step":
                outs = engine.step()
            else:   # what engine.generate() runs per step: only finished samples' outputs
                with torch.no_grad():
                    outs = engine._step(emit_unfinished=False)
            wall = clock() - t
            if engine.last_forward["decode"]:
                steps.append((wall, timers["forward"], timers["sample"]))
            done += [o.completion for o in outs if o.completion is not None]
    finally:
        engine_mod.ops.sample_and_score = real_sample
    h = hashlib.sha256()
    for c in sorted(done, key=lambda c: c.prompt_index):
        h.update(struct.pack(f"{len(c.tokens)}q", *c.tokens))
        h.update(struct.pack(f"{len(c.logprobs)}f", *c.logprobs))
    med = lambda xs: 1e3 * statistics.median(xs)
    return dict(steps=len(steps), step_ms=med([s[0] for s in steps]), forward_ms=med([s[1] for s in steps]),
                sample_ms=med([s[2] for s in steps]), host_ms=med([s[0] - s[1] - s[2] for s in steps]),
                tokens=sum(len(c.tokens) for c in done)), h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--graphs", default="padded", choices=["padded", "off"])
    p.add_argument("--clock", default="cpu", choices=["cpu", "wall"],
                   help="cpu: this thread's CPU time (robust on a shared machine), wall: perf_counter")
    p.add_argument("--api", default="step", choices=["step", "generate"],
                   help="step: engine.step() (one StepOutput per token); generate: the step generate() runs")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--stops", action="store_true", help="one stop token id (some samples end early)")
    p.add_argument("--overlap", default="off", choices=["on", "off"],
                   help="RolloutConfig.overlap (with --graphs padded: the overlap state machine; nothing overlaps "
                        "in time on the CPU, so this prices its host work)")
    p.add_argument("--profile", action="store_true", help="cProfile one run instead")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.runcall(run_once, args)
        pstats.Stats(prof).sort_stats("cumtime").print_stats("rollout|numpy|built-in", 40)
        return
    rows = []
    for _ in range(args.runs):
        row, digest = run_once(args)
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, "outputs", digest, flush=True)
    print("median host_ms", round(statistics.median(r["host_ms"] for r in rows), 3),
          "median step_ms", round(statistics.median(r["step_ms"] for r in rows), 3))


if __name__ == "__main__":
    main()
